"""
reward.py: the rule-based math reward of DAPO (paper Eq. 7), right, fast, and never hanging.

    R(y, y*) = +1 if is_equivalent(extract_answer(y), y*) else -1

Public names: extract_answer, is_equivalent, is_correct, compute_score, score_batch.

Conventions (what a careful grader does; every one has a test in test_dapo.py)
- Markers. A line holding `Answer:` (any case; also `Final Answer:`, `**Answer:**`) gives
  the rest of that line. `\\boxed{...}`, `\\boxed X` and `\\fbox{...}` give the box content,
  braces balanced. The marker that starts LAST in the text wins, so `Answer: \\boxed{42}`
  reads 42 and a later box overrides an earlier Answer line.
- No fallback to "the last number in the text". No marker, an empty value or an unclosed
  box is incorrect.
- Decoration is dropped: `$`, `\\text{}`/`\\mathrm{}`/`\\textbf{}`, `\\left`/`\\right`, LaTeX
  spaces, a trailing period, thousands separators (`1,000`), degree signs (`^\\circ`, `°`),
  percent signs (never rescaled: `25\\%` = 25, and 0.25 is not 25%), trailing unit words
  (`42 cm`, `42 \\text{ dollars}`) and a leading `x =`.
- Hedged answers are incorrect unless the ground truth is itself a list: several values
  (`42 or 43`, `42, 43`), `\\pm`, `\\approx`, `~`, "about", "approximately".
- Integers compare by exact value, never through floats (`042` = `42` = `42.0`).
- Other numbers compare exactly as fractions (`0.5` = `\\frac12` = `1/2`; `0.333` != `1/3`).
- Symbolic answers (`\\sqrt{12}` = `2\\sqrt3`, `\\frac{\\pi}{2}` = `\\pi/2`) go through a small
  LaTeX-to-sympy translator that only emits whitelisted tokens, and sympy decides
  `simplify(a - b) == 0`. Before any sympy call the input is capped: length, nesting depth,
  size of exponents and factorials, no power towers. So a 200,000-character answer or
  `2^{2^{2^{99}}}` is rejected in microseconds.
- Tuples `(a, b)` and intervals `[a, b)` are ordered and their brackets must match; sets
  `\\{a, b\\}` and bare lists `a, b` are unordered.
- Text answers (`\\text{B}`, `yes`) compare case-insensitively after normalisation.

score_batch() is the trainer's entry point: answers that need no sympy are decided in the
calling process (linear-time string work, so it cannot hang); the rest go to a pool of worker
processes, and a worker that overruns the per-item time limit is killed (not signal.alarm,
which cannot interrupt a long C call and only works in the main thread). A timed-out or
crashing item scores as incorrect, is counted, and never takes the batch down.

    python reward.py --bench     # throughput and worst-case timings
"""

import os
import re
import select
import subprocess
import sys
import time
from fractions import Fraction

MAX_RESPONSE_CHARS = 1_000_000  # longer responses are cut to their last this-many chars
MAX_ANSWER_CHARS = 200          # an extracted answer longer than this is rejected
MAX_SYMPY_CHARS = 120           # ...and a symbolic one longer than this never reaches sympy
MAX_DEPTH = 8                   # brace/parenthesis nesting
MAX_EXPONENT = 1000             # |n| in x^n
MAX_FACTORIAL = 100             # n in n!

# ----------------------------------------------------------------------------------------
# Extraction

_ANSWER_TAIL = re.compile(r"[ \t]*(?:\*\*|__)?[ \t]*:")
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\b")
_HEAD_DECOR = re.compile(r"^[\s*_:]+")


def _box_content(text, start):
    """Content of the box whose command ends at `start`; None if unclosed or empty."""
    i = start
    n = len(text)
    while i < n and text[i] == " ":
        i += 1
    if i < n and text[i] == "{":
        depth = 0
        for j in range(i, min(n, i + 10 * MAX_ANSWER_CHARS)):
            c = text[j]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[i + 1:j]
        return None  # unclosed (or absurdly long) box
    if i > start:  # `\boxed 42`: the next whitespace- or `$`-delimited token
        m = re.match(r"[^\s$]+", text[i:i + MAX_ANSWER_CHARS + 1])
        return m.group(0) if m else None
    return None


def _last_match(regex, text):
    """Last match of `regex` in `text`, scanning backwards in growing windows: in a long
    chain of thought the answer is near the end, so the usual cost is one small window."""
    size = 2048
    while True:
        start = max(0, len(text) - size)
        found = list(regex.finditer(text, start))
        if found or start == 0:
            return found[-1] if found else None
        size *= 8


def _last_answer_marker(text):
    """(start, end) of the last `answer:` marker (any case, `**`/`__` before the colon), or
    None; a plain rfind loop, several times faster than a case-insensitive regex scan."""
    low = text.lower()
    if len(low) != len(text):  # a few non-ASCII letters change length when lowered
        low = re.sub(r"[^\x00-\x7f]", "?", text).lower()
    end = len(low)
    while True:
        i = low.rfind("answer", 0, end)
        if i < 0:
            return None
        m = _ANSWER_TAIL.match(low, i + 6)
        if m and (i == 0 or not low[i - 1].isalnum()):
            return i, m.end()
        end = i


def extract_answer(response):
    """The final answer in `response` (see the module docstring), or None."""
    if not isinstance(response, str):
        return None
    text = response[-MAX_RESPONSE_CHARS:]
    ans = _last_answer_marker(text)
    box = _last_match(_BOX_RE, text)
    if ans is None and box is None:
        return None
    if box is not None and (ans is None or box.start() > ans[0]):
        value = _box_content(text, box.end())
    else:  # the rest of the Answer line
        line_end = text.find("\n", ans[1])
        value = text[ans[1]: line_end if line_end >= 0 else len(text)]
        value = _HEAD_DECOR.sub("", value)
        value = re.sub(r"[\s*_]+$", "", value)
    if value is None:
        return None
    value = value.strip()
    return value if value else None


# ----------------------------------------------------------------------------------------
# Normalisation

_TEXT_CMD = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_SPACES = re.compile(r"\\[,;:! ]|\\quad|\\qquad|~")
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_INT = re.compile(r"^([+-]?)0*(\d+)(?:\.0*)?$")
_DEC = re.compile(r"^[+-]?(?:\d+\.?\d*|\.\d+)$")
_FRAC = re.compile(r"^([+-]?)\\[dt]?frac\s*(?:\{\s*(\d+)\s*\}|(\d))\s*(?:\{\s*(\d+)\s*\}|(\d))$")
_SLASH = re.compile(r"^([+-]?\d+)\s*/\s*(\d+)$")
_UNIT_TAIL = re.compile(r"^(.*?\d)\s*((?:[a-zA-Z]+\.?\s*){1,3})$")
_HEDGE_WORDS = {"or", "and", "to", "plus", "minus", "approximately", "about", "roughly",
                "around", "nearly", "almost", "maybe", "possibly", "probably", "either", "not",
                "than", "less", "more", "pi", "i", "e", "sqrt"}
_HEDGE = re.compile(r"\\pm|\\mp|±|\\approx|≈|\\sim|\\lesssim|\\gtrsim|\bapprox|\babout\b|"
                    r"\bapproximately\b|\broughly\b|\baround\b|\bor\b|\beither\b|\bmaybe\b")


def _normalize(s):
    """Strip decoration (see the module docstring). Returns a canonical string."""
    s = s.strip()
    if len(s) > MAX_ANSWER_CHARS:
        return None
    s = s.replace("\\$", "").replace("$", "").replace("\u2212", "-")
    s = s.replace("\\left", "").replace("\\right", "").replace("\\displaystyle", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for _ in range(3):  # \text{\textbf{..}} nests
        s = _TEXT_CMD.sub(r"\1", s)
    s = _SPACES.sub(" ", s)
    s = re.sub(r"\^\s*\{?\\circ\}?|°|\\degree", "", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.strip().rstrip(".").strip()
    s = re.sub(r"^[a-zA-Z]\s*=\s*(?=\S)", "", s)       # `x = 5` -> `5`
    m = _UNIT_TAIL.match(s)                             # `42 cm` -> `42`
    if m and not (set(m.group(2).lower().replace(".", "").split()) & _HEDGE_WORDS):
        s = m.group(1)
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    return re.sub(r"\s+", " ", s).strip()


def _as_fraction(s):
    """Exact value of an integer, decimal or simple fraction string, else None."""
    m = _INT.match(s)
    if m:
        return Fraction(int(m.group(1) + m.group(2)))
    if _DEC.match(s):
        return Fraction(s)
    m = _FRAC.match(s) or None
    if m:
        num = int(m.group(2) or m.group(3))
        den = int(m.group(4) or m.group(5))
        return Fraction((-1 if m.group(1) == "-" else 1) * num, den) if den else None
    m = _SLASH.match(s)
    if m and int(m.group(2)):
        return Fraction(int(m.group(1)), int(m.group(2)))
    return None


def _split_top(s, seps=","):
    """Split on separators that are not inside brackets."""
    parts, depth, cur = [], 0, []
    for c in s:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c in seps and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def _structure(s):
    """('tuple'|'interval'|'set'|'list'|'scalar', open, close, items)."""
    if s.startswith("\\{") and s.endswith("\\}"):
        return "set", "{", "}", _split_top(s[2:-2])
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        inner = s[1:-1]
        items = _split_top(inner)
        if len(items) >= 2 and _balanced(inner):
            kind = "tuple" if (s[0], s[-1]) in {("(", ")")} else "interval"
            return kind, s[0], s[-1], items
    items = _split_top(s, ",;")
    if len(items) >= 2:
        return "list", "", "", items
    return "scalar", "", "", [s]


def _balanced(s):
    depth = 0
    for c in s:
        depth += c in "([{"
        depth -= c in ")]}"
        if depth < 0:
            return False
    return depth == 0


# ----------------------------------------------------------------------------------------
# Symbolic comparison: a tiny LaTeX -> sympy translator with caps

_SYMPY_OK = re.compile(r"^[0-9a-z+\-*/()., ]*$")
_FUNCS = {"sqrt", "pi", "sin", "cos", "tan", "log", "ln", "exp", "factorial", "root", "e", "i", "I", "E"}


def _latex_to_sympy(s):
    """Translate a small LaTeX subset to a sympy-parsable string, or None if outside it."""
    t = s
    t = t.replace("\\cdot", "*").replace("\\times", "*").replace("\\div", "/")
    t = t.replace("\\pi", " pi ").replace("\\infty", " oo ")
    t = re.sub(r"\\(sin|cos|tan|ln|log|exp)\b", r" \1", t)
    for _ in range(MAX_DEPTH):  # innermost first: \frac{a}{b}, \sqrt[n]{x}, \sqrt{x}, \frac12, \sqrt3
        before = t
        t = re.sub(r"\\frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"((\1)/(\2))", t)
        t = re.sub(r"\\frac\s*(\d)\s*(\d)", r"((\1)/(\2))", t)
        t = re.sub(r"\\frac\s*\{([^{}]*)\}\s*(\d)", r"((\1)/(\2))", t)
        t = re.sub(r"\\sqrt\s*\[([^\[\]{}]*)\]\s*\{([^{}]*)\}", r"root((\2),(\1))", t)
        t = re.sub(r"\\sqrt\s*\{([^{}]*)\}", r"sqrt(\1)", t)
        t = re.sub(r"\\sqrt\s*(\d|[a-z])", r"sqrt(\1)", t)
        t = re.sub(r"\^\s*\{([^{}]*)\}", r"**(\1)", t)
        t = re.sub(r"\{([^{}]*)\}", r"(\1)", t)
        if t == before:
            break
    t = t.replace("^", "**").replace("!", " !")
    if "\\" in t or "{" in t or "}" in t:
        return None
    t = re.sub(r"(\w+|\))\s*!", r"factorial(\1)", t)
    if not _SYMPY_OK.match(t.replace("**", "*")):
        return None
    words = set(re.findall(r"[a-zA-Z]+", t))
    if not words <= _FUNCS | {"oo", "x", "y", "z", "n", "a", "b", "c", "k", "m", "t"}:
        return None
    return t


def _safe_for_sympy(expr):
    """Caps that keep every sympy call small: depth, exponents, factorials, power towers."""
    if len(expr) > MAX_SYMPY_CHARS:
        return False
    depth = 0
    for c in expr:
        depth += c == "("
        depth -= c == ")"
        if depth > MAX_DEPTH or depth < 0:
            return False
    if expr.count("**") > 3:
        return False
    for m in re.finditer(r"\*\*\s*\(?\s*([^()*]*)", expr):
        exp = m.group(1).strip()
        tail = expr[m.end():m.end() + 3]
        if "**" in tail or re.match(r"\s*\*\*", expr[m.end():]):
            return False  # power tower
        if not re.fullmatch(r"[+-]?\d+(?:\.\d+)?|[+-]?\d+/\d+|[a-z]|pi", exp):
            return False  # symbolic or nested exponents are out of scope
        if re.fullmatch(r"[+-]?\d+", exp) and abs(int(exp)) > MAX_EXPONENT:
            return False
    for m in re.finditer(r"factorial\((\d+)\)", expr):
        if int(m.group(1)) > MAX_FACTORIAL:
            return False
    if "factorial(" in expr and re.search(r"factorial\([^0-9]", expr):
        return False
    return all(len(d) <= 50 for d in re.findall(r"\d+", expr))


def _sympy_equal(a, b):
    """True/False when sympy decides, None when it cannot parse."""
    ea, eb = _latex_to_sympy(a), _latex_to_sympy(b)
    if ea is None or eb is None or not (_safe_for_sympy(ea) and _safe_for_sympy(eb)):
        return None
    import sympy
    from sympy.parsing.sympy_parser import (parse_expr, standard_transformations,
                                            implicit_multiplication_application)
    tr = standard_transformations + (implicit_multiplication_application,)
    names = {"pi": sympy.pi, "e": sympy.E, "E": sympy.E, "i": sympy.I, "I": sympy.I,
             "ln": sympy.log, "root": sympy.root, "oo": sympy.oo}
    try:
        xa = parse_expr(ea, local_dict=names, transformations=tr, evaluate=True)
        xb = parse_expr(eb, local_dict=names, transformations=tr, evaluate=True)
        if xa.free_symbols != xb.free_symbols:
            return False
        d = xa - xb
        if not d.free_symbols:  # numbers: a cheap high-precision check before simplify
            v = complex(d.evalf(60))
            if abs(v) > 1e-40:
                return False
        return bool(sympy.simplify(d) == 0)
    except Exception:
        return None


# ----------------------------------------------------------------------------------------
# Equivalence

def _scalar_equal(p, g, allow_sympy=True):
    if p == g or p.lower() == g.lower():
        return True
    fp, fg = _as_fraction(p), _as_fraction(g)
    if fp is not None and fg is not None:
        return fp == fg
    if _HEDGE.search(p):
        return False
    if not allow_sympy:
        return None
    if not any(c in p + g for c in "\\^(*/+-!") and not re.search(r"[a-z]", p + g):
        return False  # plain different numbers/strings: nothing symbolic to decide
    return bool(_sympy_equal(p, g))


def _equivalent(pred, gt, allow_sympy=True):
    """True / False, or None where only sympy could decide and allow_sympy is False."""
    if pred is None or gt is None:
        return False
    pred, gt = str(pred).strip(), str(gt).strip()
    if pred.isascii() and gt.isascii() and pred.isdigit() and gt.isdigit() and len(pred) < 100:
        return int(pred) == int(gt)  # the common AIME case, exact and fast
    p, g = _normalize(pred), _normalize(gt)
    if not p or not g:
        return False
    kp, op_, cp, ip = _structure(p)
    kg, og, cg, ig = _structure(g)
    if kg == "scalar":
        if kp != "scalar" or (_HEDGE.search(p) and not _HEDGE.search(g)):
            return False  # hedged or several values against one value
        return _scalar_equal(p, g, allow_sympy)
    # The ground truth is a collection. Bare lists may be answered with `and` between items.
    if kp == "scalar" and kg in ("list", "set"):
        ip = [x.strip() for x in re.split(r"\s*(?:,|\band\b)\s*", p)]
        kp = "list" if len(ip) > 1 else "scalar"
    unordered = {"list", "set"}
    if not (kg in unordered and kp in unordered) and (kg, og, cg) != (kp, op_, cp):
        return False  # a tuple is not an interval, nor a set; brackets must match
    if len(ip) != len(ig):
        return False
    ip, ig = [_normalize(x) or "" for x in ip], [_normalize(x) or "" for x in ig]
    if kg in unordered:  # match each item once, order-free
        left = list(ip)
        for x in ig:
            hit = next((k for k, y in enumerate(left) if _scalar_equal(y, x, allow_sympy)), None)
            if hit is None:
                return False
            left.pop(hit)
        return True
    results = [_scalar_equal(a, b, allow_sympy) for a, b in zip(ip, ig)]
    if any(r is False for r in results):
        return False
    return None if any(r is None for r in results) else True


def is_equivalent(pred, ground_truth):
    """Is the extracted answer `pred` equal to `ground_truth` (conventions above)?"""
    try:
        return bool(_equivalent(pred, ground_truth))
    except Exception:
        return False


def is_correct(response, ground_truth):
    """Extract and compare. Never raises."""
    try:
        return is_equivalent(extract_answer(response), ground_truth)
    except Exception:
        return False


def compute_score(response, ground_truth):
    """Paper Eq. 7: +1.0 if correct else -1.0."""
    return 1.0 if is_correct(response, ground_truth) else -1.0


# ----------------------------------------------------------------------------------------
# Batch scoring with killable workers

def _fast_verdict(response, ground_truth):
    """True/False when decidable without sympy (linear-time string work), else None."""
    try:
        pred = extract_answer(response)
        if pred is None:
            return False
        return _equivalent(pred, ground_truth, allow_sympy=False)
    except Exception:
        return False


def _load_fn(spec):
    """'module:function' -> the function (lets a researcher swap in a reward of their own)."""
    import importlib
    mod, _, name = spec.partition(":")
    return getattr(importlib.import_module(mod), name)


def _worker_main(spec):
    """Worker loop: one `repr((response, ground_truth))` per line in, one verdict per line out."""
    import ast
    fn = _load_fn(spec)
    import sympy  # noqa: F401  (imported once here, not inside the first item's time limit)
    sys.stdout.write("ready\n")  # the per-item clock starts after start-up
    sys.stdout.flush()
    for line in sys.stdin:
        try:
            resp, gt = ast.literal_eval(line)
            ok = bool(fn(resp, gt))
            sys.stdout.write("1\n" if ok else "0\n")
        except Exception:
            sys.stdout.write("E\n")
        sys.stdout.flush()


class _Worker:
    """One worker process; killed and replaced when it overruns."""

    def __init__(self, spec, path):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([path, os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"import reward; reward._worker_main({spec!r})"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, bufsize=1, env=env, cwd=path)
        self.item, self.started = None, 0.0
        self.spec, self.ready = spec, False

    def wait_ready(self, timeout=120.0):
        if not self.ready:
            ok = select.select([self.proc.stdout], [], [], timeout)[0] and self.proc.stdout.readline() == "ready\n"
            if not ok:
                self.kill()
                raise RuntimeError(f"reward worker for '{self.spec}' did not start (does it import?)")
            self.ready = True
        return self

    def submit(self, idx, payload):
        self.item, self.started = idx, time.monotonic()
        self.proc.stdin.write(payload)
        self.proc.stdin.flush()

    def kill(self):
        self.proc.kill()
        self.proc.wait()


_POOL = {}
_HERE = os.path.dirname(os.path.abspath(__file__))


def _pool(spec, n):
    """At least n live workers for `spec`: the pool's own list, kept between calls, in which
    score_batch replaces a killed worker in place."""
    workers = _POOL[spec] = [w for w in _POOL.get(spec, []) if w.proc.poll() is None]
    while len(workers) < n:
        workers.append(_Worker(spec, _HERE))
    for w in workers:
        w.wait_ready()  # they start in parallel, then we wait
    return workers


def score_batch(responses, ground_truths, timeout=5.0, num_workers=4, fn="reward:is_correct"):
    """Score many responses; the trainer's entry point.

    Returns (correct: list[bool], stats: dict with 'timeouts', 'errors', 'in_process').
    Items decidable without sympy are scored here (default checker only); the rest run in
    `num_workers` worker processes, each item with a hard wall-clock limit of `timeout` s.
    `fn` names a 'module:function(response, ground_truth) -> bool' to use instead.
    """
    assert len(responses) == len(ground_truths)
    correct = [False] * len(responses)
    todo = []
    for i, (r, g) in enumerate(zip(responses, ground_truths)):
        v = _fast_verdict(r, g) if fn == "reward:is_correct" else None
        if v is None:
            todo.append(i)
        else:
            correct[i] = v
    stats = {"timeouts": 0, "errors": 0, "in_process": len(responses) - len(todo)}
    if not todo:
        return correct, stats
    workers = _pool(fn, max(1, min(num_workers, len(todo))))
    queue = list(reversed(todo))
    busy = {}
    while queue or busy:
        for w in workers:  # hand out work
            if w.item is None and queue:
                i = queue.pop()
                w.submit(i, repr((str(responses[i])[-MAX_RESPONSE_CHARS:], str(ground_truths[i]))) + "\n")
                busy[w.proc.stdout.fileno()] = w
        now = time.monotonic()
        wait = max(0.0, min(w.started + timeout - now for w in busy.values()))
        ready, _, _ = select.select(list(busy), [], [], wait)
        for fd in ready:
            w = busy.pop(fd)
            line = w.proc.stdout.readline().strip()
            if line in ("0", "1"):
                correct[w.item] = line == "1"
            else:
                stats["errors"] += 1
                if not line:  # the worker died: replace it
                    workers[workers.index(w)] = _Worker(fn, _HERE).wait_ready()
                    continue
            w.item = None
        now = time.monotonic()
        for fd, w in list(busy.items()):
            if now - w.started >= timeout:  # overran: kill, count, replace
                busy.pop(fd)
                w.kill()
                stats["timeouts"] += 1
                workers[workers.index(w)] = _Worker(fn, _HERE).wait_ready()
    return correct, stats


def _bench():
    import random
    import statistics
    rng = random.Random(0)
    filler = "Let me think step by step about this problem. " * 40
    resps = [filler + f"\nAnswer: {rng.randint(0, 999)}" for _ in range(20000)]
    gts = [str(rng.randint(0, 999)) for _ in range(20000)]
    rates = []
    for _ in range(5):
        t = time.perf_counter()
        for r, g in zip(resps, gts):
            compute_score(r, g)
        rates.append(len(resps) / (time.perf_counter() - t))
    print(f"integer answers, ~{len(resps[0])} chars each: median {statistics.median(rates):,.0f} "
          f"responses/s on one core (5 runs: {', '.join(f'{r:,.0f}' for r in rates)})")
    hard = {
        "200k-char answer": "Answer: " + "1" * 200_000,
        "200k reasoning then Answer: 42": "x" * 200_000 + "\nAnswer: 42",
        "power tower": "Answer: 2^{2^{2^{2^{99}}}}",
        "huge exponent": "\\boxed{9^{999999999}}",
        "huge factorial": "\\boxed{100000!}",
        "deep nesting": "\\boxed{" + "\\sqrt{" * 300 + "2" + "}" * 300 + "}",
        "unclosed box x100k": "\\boxed{" * 100_000,
        "symbolic sqrt": "\\boxed{2\\sqrt3}",
    }
    worst = 0.0
    for name, r in hard.items():
        t = time.perf_counter()
        compute_score(r, "2\\sqrt{3}" if "sqrt" in name else "42")
        dt = time.perf_counter() - t
        worst = max(worst, dt)
        print(f"  {name:32s} {dt * 1e3:8.2f} ms")
    print(f"worst single response: {worst * 1e3:.1f} ms")


if __name__ == "__main__":
    if "--bench" in sys.argv:
        _bench()
    else:
        print(__doc__)
