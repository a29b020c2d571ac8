"""
reward.py: the rule-based math reward of DAPO (paper Eq. 7), right, fast, and never hanging.

    R(y, y*) = +1 if is_equivalent(extract_answer(y), y*) else -1

Public names: extract_answer, is_equivalent, is_correct, compute_score, math_reward, as_result,
score_batch, majority_correct.

The reward contract (dapo.py's --reward module:function, or path/to/file.py:function; as verl's
compute_score and TRL's reward_funcs): fn(response, row) gets the response text and the whole data row
(its "prompt", its "answer": the ground truth as the file gives it, and every other column) and returns
- a bool: Eq. 7's +1 or -1, a success if True;
- a number: the reward, a success where it is > 0 (so a graded reward whose partial credit is no
  success returns a dict);
- a dict: "reward" (or verl's "score"), and optionally "success" (a bool; default: reward > 0),
  "answer" (what the response answered, None where it gave none: identical answers vote together in
  maj@k, and eval/answered counts the others; a reward that never returns the key reports neither) and
  more numbers, each logged as score/<name> (other values are ignored).
A reward is a finite number of magnitude at most MAX_REWARD (1e9); a number named "mean" is refused
(score/mean is the reward's own mean). A response on which it raises, crashes its worker, overruns
--reward-timeout or returns anything else is no success, is counted (reward/errors, reward/timeouts),
and scores the lowest reward of its group, at most -1 (Eq. 7's wrong answer): a failure never outscores an
answer. math_reward, this file's checker through the contract, is the default.

Conventions (what a careful grader does; every one has a test in tests/test_reward.py)
- Markers. A line holding `Answer:` (any case; also `Final Answer:`, `**Answer:**`) gives
  the rest of that line, or, when that is blank, the next line with content (lines of only
  `$$`, `\\[`, `\\]` skipped). Minerva's `The final answer is $42$. I hope it is correct.`
  gives `$42$`, whatever follows on that line. A chat-template token (`<|im_end|>`,
  `<|im_start|>user`) ends the line and the value: the model's turn is over.
  `\\boxed{...}`, `\\boxed X` and `\\fbox{...}` give the box content, braces balanced;
  redundant grouping braces go (`\\boxed{{42}}` is 42). The marker that starts LAST in the
  text wins, so `Answer: \\boxed{42}` reads 42 and a later box overrides an earlier Answer
  line.
- No fallback to "the last number in the text". No marker, an empty value or an unclosed
  box is incorrect.
- Decoration is dropped: `$`, `\\(`/`\\)`, `\\text{}`/`\\mathrm{}`/`\\textbf{}`,
  `\\left`/`\\right`, LaTeX spaces, a trailing period, thousands separators (`1,000`,
  `12{,}345`, `1,\\!000`, `1,\\! 000`, `1\\,000`), degree signs (`^\\circ`, `°`), percent
  signs (never rescaled: `25\\%` = 25, and 0.25 is not 25%), a leading `x =`, `x \\in`,
  `(x, y) =` or `f(x) =`, and trailing units.
- A unit is a `\\text{}`/`\\mbox{}`/`\\textnormal{}`/`\\mathrm{}` group of words after a number
  or expression (`\\frac34\\text{ inches}`, `15\\mbox{ cm}^2`), a known unit word (`42 cm`,
  `5ft`), or space-separated words of three or more letters (`5 apples`). After `\\pi` the
  first two count (`8\\pi \\text{ square units}`, `8\\pi cm` are 8pi), the last does not:
  `\\pi abc` is a product. A single letter after a number is never a unit: `3x` is the
  expression 3x, not 3; nor are hedge words (`or`, `about`) or function names.
- Hedged answers are incorrect unless the ground truth is itself a list: several values
  (`42 or 43`, `42, 43`), `\\pm`, `\\approx`, `~`, "about", "approximately".
- Integers compare by exact value, never through floats (`042` = `42` = `42.0`).
- Other numbers compare exactly as fractions (`0.5` = `\\frac12` = `1/2`; `0.333` != `1/3`).
  An integer directly followed by an integer fraction is a mixed number: `2\\frac{1}{3}` and
  `2 1/3` are 7/3 (a product needs `\\cdot`). Scientific notation (`1.5e3`, `1.5\\times10^{3}`)
  and integer powers (`2^{10}`) are numbers too, read by string work; one whose value is too
  large to build (`1e999999999`) is compared by its digits and exponent, never computed,
  and equals no other kind of answer.
- Symbolic answers (`\\sqrt{12}` = `2\\sqrt3`, `\\frac{1+\\sqrt5}{2}`, `x^2+2x+1` = `(x+1)^2`)
  go through a small LaTeX-to-sympy translator that only emits whitelisted tokens, with
  decimals made exact rationals (`10\\sqrt{10.5}` = `5\\sqrt{42}`), and sympy decides
  `simplify(a - b) == 0`. Before any sympy call the input is capped: length, nesting depth,
  size of exponents and factorials, no power towers, no float literals, at most 3 powers
  sympy could expand (a small power of a symbol or a number, `x^2`, `x^{-2/3}`, is one term
  and is not counted), at most MAX_SYMPY_CALLS calls per comparison. So a 200,000-character
  answer or `2^{2^{2^{99}}}` is rejected in microseconds. An answer with no sympy form
  (`\\alpha+\\beta`, `AB`) compares as normalised text, whitespace- and case-insensitively.
- Structure is compared item by item, each item with these same rules, nested as needed.
  Tuples `(a, b)` and intervals `[a, b)` are ordered and their brackets must match; with no
  comma, `;` separates the coordinates (`(0;-2;6)`). Sets `\\{a, b\\}` or `{a, b}`, bare lists
  `a, b` and prose lists `a and b` are unordered. Against a set of tuples (solutions) a tuple
  listed twice names the same set; other items keep their count (`2, 2, 3` is not `2, 3`: a
  repeated root may claim a multiplicity). Unions of intervals (`\\cup`) are unordered;
  matrices (`pmatrix`, `bmatrix`, ...: the delimiters do not matter) must have the same
  shape. Relations compare operator and sides, with `\\ge` = `\\geq` = `>=` and `5 \\le x` =
  `x \\ge 5`.
- Text answers (`\\text{B}`, `yes`) compare case-insensitively after normalisation; a
  multiple-choice letter may be written `\\text{(C)}`, `(C)` or `C`.

score_batch() is the trainer's entry point: the math checker's answers that need no sympy are
decided in the calling process (linear-time string work, so it cannot hang); the rest, and every
response a reward of one's own scores, go to a pool of worker processes, and a worker that overruns
the per-item time limit is killed (not signal.alarm, which cannot interrupt a long C call and only
works in the main thread). A timed-out, raising or crashing item, or one whose reward is garbage,
scores as a wrong answer (-1), is counted, and never takes the batch down.

    python reward.py --bench     # throughput and worst-case timings
"""

import math
import numbers
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


_MINERVA_HEAD = re.compile(r"^(?:the\s+)?(?:final\s+)?answer\s+is\s*:?\s*", re.I)
_MINERVA_TAIL = re.compile(r"I hope it is correct", re.I)
_CHAT_TOKEN = re.compile(r"<\|[a-z_]+\|>")  # `<|im_end|>`, `<|im_start|>`, `<|endoftext|>`
_DELIM_ONLY = re.compile(r"^(?:[\s$*_]|\\\[|\\\])*$")


def _rstrip_decor(s):
    """`s` without trailing whitespace, `*` and `_`. A loop, because `[\\s*_]+$` backtracks:
    quadratic time on a long run of spaces inside a line."""
    n = len(s)
    while n and (s[n - 1].isspace() or s[n - 1] in "*_"):
        n -= 1
    return s[:n]


def _answer_line(text, pos):
    """The value of an `Answer:` marker ending at `pos`: the rest of its line or, when that
    is blank, the next line with content (lines holding only `$$`, `\\[`, `\\]` skipped)."""
    while True:
        end = text.find("\n", pos)
        line = text[pos: end if end >= 0 else len(text)]
        turn_end = _CHAT_TOKEN.search(line)
        if turn_end:  # the model's turn is over: nothing after it, on this line or the next
            line, end = line[:turn_end.start()], -1
        value = _rstrip_decor(_HEAD_DECOR.sub("", line))
        if not _DELIM_ONLY.match(value):
            break
        if end < 0:
            return None
        pos = end + 1
    # Minerva style: `Final Answer: The final answer is $42$. I hope it is correct.`; more
    # sentences after it on the line are not the answer (lm-eval's Minerva parser agrees)
    tail = _MINERVA_TAIL.search(value)
    if tail:
        value = value[:tail.start()].rstrip()
    head = _MINERVA_HEAD.match(value)
    if head:
        value = value[head.end():]
    if (tail or head) and value.endswith("."):
        value = value[:-1].rstrip()
    return value


def _group_inner(s, opening="{", closing="}"):
    """The inside of `s` when its first character opens a group closed by its last one."""
    if len(s) < 2 or not s.startswith(opening) or not s.endswith(closing):
        return None
    depth = 0
    for k, c in enumerate(s):
        depth += c == "{"
        depth -= c == "}"
        if depth == 0:
            return s[1:-1] if k == len(s) - 1 else None
    return None


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
    else:
        value = _answer_line(text, ans[1])
    if value is None:
        return None
    value = value.strip()
    inner = _group_inner(value)
    while inner is not None and len(_split_top(inner)) == 1:  # `\boxed{{42}}` is 42
        value = inner.strip()
        inner = _group_inner(value)
    return value if value else None


# ----------------------------------------------------------------------------------------
# Normalisation

_TEXT_CMD = re.compile(r"\\(?:text|textbf|textit|textnormal|textrm|mathrm|mathbf|mbox|operatorname)"
                       r"\s*\{([^{}]*)\}")
_SPACES = re.compile(r"\\[,;:! ]|\\quad|\\qquad|~")
# 12{,}345 1,\!000 1\,000; after an explicit comma a space may follow: `11,\! 111,\! 100`
_LATEX_THOUSANDS = re.compile(r"(?<=\d)(?:(?:\{,\}|,\\!)\s*|\\,)(?=\d{3}(?!\d))")
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_MATRIX = re.compile(r"\\begin\{([pbBvV]?matrix)\}(.*?)\\end\{\1\}", re.S)
_RELATIONS = [(re.compile(r"\\geqslant|\\geq?(?![a-zA-Z])|≥"), ">="),
              (re.compile(r"\\leqslant|\\leq?(?![a-zA-Z])|≤"), "<="),
              (re.compile(r"\\neq?(?![a-zA-Z])|≠"), "!="),
              (re.compile(r"\\gt(?![a-zA-Z])"), ">"), (re.compile(r"\\lt(?![a-zA-Z])"), "<")]
# `x =`, `x \in`, `(x, y) =`, `f(x) =` before an answer are dropped
_PREFIX = re.compile(r"^(?:[a-zA-Z]|\(\s*[a-zA-Z](?:\s*,\s*[a-zA-Z])+\s*\)|[a-zA-Z]\s*\(\s*[a-zA-Z]\s*\))"
                     r"\s*(?:=|\\in(?![a-zA-Z]))\s*(?=\S)")
_TEXT_UNIT = re.compile(r"^(.*?(?:[\d})]|\\pi))\s*\\(?:text|textnormal|textrm|mbox|mathrm)\s*"
                        r"\{\s*([a-zA-Z][a-zA-Z. ]*)\}\s*(?:\^\s*\{?\s*[23]\s*\}?)?$")
_UNIT_TAIL = re.compile(r"^(.*?(?:[\d})]|\\pi))(\s*)((?:[a-zA-Z]+\.?\s*){1,3})(?:\^\s*\{?\s*[23]\s*\}?)?$")
_UNIT_WORDS = set("""cm mm km nm ft in yd mi kg mg lb lbs oz ml hr hrs min mins sec secs sq cu mph kph
    km/h units unit meter meters metre metres inch inches foot feet yard yards mile miles second seconds
    minute minutes hour hours day days week weeks month months year years dollar dollars cent cents
    degree degrees deg radian radians square cubic gram grams pound pounds ounce ounces liter liters
    litre litres gallon gallons cup cups percent""".split())
_HEDGE_WORDS = {"or", "and", "to", "plus", "minus", "approximately", "about", "roughly",
                "around", "nearly", "almost", "maybe", "possibly", "probably", "either", "not",
                "than", "less", "more", "pi", "i", "e", "sqrt", "sin", "cos", "tan", "cot", "csc",
                "log", "ln", "exp", "mod", "is", "are", "the"}
_HEDGE = re.compile(r"\\pm|\\mp|±|\\approx|≈|\\sim|\\lesssim|\\gtrsim|\bapprox|\babout\b|"
                    r"\bapproximately\b|\broughly\b|\baround\b|\bor\b|\beither\b|\bmaybe\b")
_CHOICE = re.compile(r"^\(\s*([A-Za-z])\s*\)$")


def _strip_unit(s):
    """`42 cm`, `\\frac34 \\text{ inches}`, `8\\pi \\text{ cm}` -> the number. A unit is a
    `\\text{}`-like group of words, a known unit word, or space-separated words of 3+ letters
    (not after `\\pi`: `\\pi abc` is a product); never a single letter (`3x` is not 3) and
    never a hedge or function word."""
    m = _TEXT_UNIT.match(s)
    if m and re.search(r"\d|\\pi", m.group(1)):
        if not set(m.group(2).lower().replace(".", " ").split()) & _HEDGE_WORDS:
            return m.group(1)
    m = _UNIT_TAIL.match(s)
    if m:
        words = m.group(3).lower().replace(".", " ").split()
        spaced_words = m.group(2) and not m.group(1).endswith("\\pi")
        if words and not set(words) & _HEDGE_WORDS and (
                all(w in _UNIT_WORDS for w in words) or (spaced_words and all(len(w) >= 3 for w in words))):
            return m.group(1)
    return s


def _matrix_to_text(m):
    """`\\begin{pmatrix} a & b \\\\ c & d \\end{pmatrix}` -> `\\matrix{a,b;c,d}` (any delimiters)."""
    return "\\matrix{" + m.group(2).replace("\\\\", ";").replace("&", ",") + "}"


def _normalize(s):
    """Strip decoration (see the module docstring). Returns a canonical string."""
    s = s.strip()
    if len(s) > MAX_ANSWER_CHARS:
        return None
    s = _MATRIX.sub(_matrix_to_text, s)
    s = re.sub(r"^(?:\\left)?[\[(]\s*(\\matrix\{.*\})\s*(?:\\right)?[\])]$", r"\1", s)  # [matrix]
    s = s.replace("\\$", "").replace("$", "").replace("\u2212", "-")
    s = re.sub(r"(?<!\\)\\[()]", "", s)  # `\(42\)`: math delimiters, like `$`
    s = _LATEX_THOUSANDS.sub("", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\displaystyle", "")
    s = re.sub(r"\\[dtc]frac(?![a-zA-Z])", r"\\frac", s)
    s = _strip_unit(s.strip().rstrip(".").strip())      # `\text{ inches}` before \text{} goes
    for _ in range(3):  # \text{\textbf{..}} nests
        s = _TEXT_CMD.sub(r"\1", s)
    s = _SPACES.sub(" ", s)
    s = re.sub(r"\^\s*\{?\\circ\}?|°|\\degree", "", s)
    s = s.replace("\\%", "").replace("%", "")
    for rel, op in _RELATIONS:
        s = rel.sub(f" {op} ", s)
    s = re.sub(r"^\\\[|\\\]$", "", s.strip()).strip().rstrip(".").strip()
    s = _PREFIX.sub("", s)                               # `x = 5` -> `5`
    s = _strip_unit(s)                                  # `42 cm` -> `42`
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    s = _CHOICE.sub(r"\1", s)                            # `(C)` -> `C`
    inner = _group_inner(s)
    while inner is not None:                             # `{42}` -> 42, `{2, 3}` -> a set
        if len(_split_top(inner)) > 1:
            s = "\\{" + inner + "\\}"
            break
        s, inner = inner.strip(), _group_inner(inner.strip())
    return re.sub(r"\s+", " ", s).strip()


# ----------------------------------------------------------------------------------------
# Numbers: exact, and never big-number arithmetic on a huge exponent

_INT = re.compile(r"^([+-]?)0*(\d+)(?:\.0*)?$")
_DEC = re.compile(r"^[+-]?(?:\d+\.?\d*|\.\d+)$")
_FRAC = re.compile(r"^([+-]?)\\frac\s*(?:\{\s*([+-]?\d+)\s*\}|(\d))\s*(?:\{\s*(\d+)\s*\}|(\d))$")
_SLASH = re.compile(r"^([+-]?\d+)\s*/\s*(\d+)$")
_MIXED = re.compile(r"^([+-]?)(\d+)\s*(?:\\frac\s*(?:\{\s*(\d+)\s*\}|(\d))\s*(?:\{\s*(\d+)\s*\}|(\d))"
                    r"|\s(\d+)\s*/\s*(\d+))$")
_SCI = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))\s*(?:[eE]|(?:\\times|\\cdot|\*|×)\s*10\s*(?:\^|\*\*))"
                  r"\s*\{?\s*([+-]?\d+)\s*\}?$")
_POW = re.compile(r"^([+-]?)(\d+)\s*(?:\^|\*\*)\s*\{?\s*([+-]?\d+)\s*\}?$")


def _decimal_value(sign, digits, exp10):
    """sign * int(digits) * 10**exp10, exactly; a ('big', ...) key when 10**exp10 is too large
    to build (two such keys are equal iff the numbers are, and no Fraction equals one)."""
    stripped = digits.lstrip("0").rstrip("0")
    if not stripped:
        return Fraction(0)
    exp10 += len(digits.lstrip("0")) - len(stripped)
    if abs(exp10) > MAX_EXPONENT + MAX_ANSWER_CHARS:
        return ("big", sign, stripped, exp10)
    return (-1 if sign == "-" else 1) * Fraction(int(stripped)) * Fraction(10) ** exp10


def _as_number(s):
    """Exact value of a numeric answer (integer, decimal, fraction, mixed number, scientific
    notation, integer power) as a Fraction, a ('big', ...) key, or None if not numeric."""
    m = _INT.match(s)
    if m:
        return Fraction(int(m.group(1) + m.group(2)))
    if _DEC.match(s):
        return Fraction(s)
    m = _FRAC.match(s)
    if m:
        num, den = int(m.group(2) or m.group(3)), int(m.group(4) or m.group(5))
        return Fraction((-1 if m.group(1) == "-" else 1) * num, den) if den else None
    m = _SLASH.match(s)
    if m:
        return Fraction(int(m.group(1)), int(m.group(2))) if int(m.group(2)) else None
    m = _MIXED.match(s)  # `2\frac{1}{3}` and `2 1/3` are 7/3, not 2/3
    if m:
        num, den = int(m.group(3) or m.group(4) or m.group(7)), int(m.group(5) or m.group(6) or m.group(8))
        return (-1 if m.group(1) == "-" else 1) * (int(m.group(2)) + Fraction(num, den)) if den else None
    m = _SCI.match(s)
    if m:
        sign, mant = m.group(1)[:1] if m.group(1)[:1] in "+-" else "", m.group(1).lstrip("+-")
        whole, _, frac = mant.partition(".")
        return _decimal_value(sign, whole + frac, int(m.group(2)) - len(frac))
    m = _POW.match(s)
    if m:
        sign, base, exp = m.group(1), m.group(2).lstrip("0") or "0", int(m.group(3))
        if re.fullmatch(r"10*", base):  # 10^n, 100^n: a power of ten
            return _decimal_value(sign, "1", exp * (len(base) - 1))
        if base in ("0", "1") or len(base) * abs(exp) <= 10 * MAX_EXPONENT:
            if base == "0" and exp < 0:
                return None
            return (-1 if sign == "-" else 1) * Fraction(int(base)) ** exp
        return ("pow", sign, base, exp)  # too large to build: equal only in the same form
    return None


# ----------------------------------------------------------------------------------------
# Structure: lists, sets, tuples, intervals, unions, matrices, relations

_LIST_SEP = re.compile(r"\s*(?:,\s*and(?![a-zA-Z])|,|;|(?<![a-zA-Z\\])and(?![a-zA-Z]))\s*")
_COMMA = re.compile(",")
_SEMICOLON = re.compile(";")
_UNION = re.compile(r"\\cup(?![a-zA-Z])|∪")
_REL_OP = re.compile(r"<=|>=|!=|<|>|=")
_FLIP = {"<": ">", ">": "<", "<=": ">=", ">=": "<=", "=": "=", "!=": "!="}


def _split_top(s, sep=_COMMA):
    """Split on matches of `sep` that are not inside brackets."""
    level, depth = [], 0
    for c in s:
        if c in ")]}":
            depth -= 1
        level.append(depth)
        if c in "([{":
            depth += 1
    parts, start = [], 0
    for m in sep.finditer(s):
        if level[m.start()] == 0 and m.start() >= start and m.end() > m.start():
            parts.append(s[start:m.start()])
            start = m.end()
    parts.append(s[start:])
    return [p.strip() for p in parts]


def _balanced(s):
    depth = 0
    for c in s:
        depth += c in "([{"
        depth -= c in ")]}"
        if depth < 0:
            return False
    return depth == 0


def _structure(s):
    """(kind, tag, items): kind is 'matrix' (tag: row lengths), 'union', 'set', 'tuple',
    'interval' (tag: brackets), 'list', 'relation' (tag: the operators) or 'scalar'."""
    m = re.fullmatch(r"\\matrix\{(.*)\}", s)
    if m:
        rows = [_split_top(r) for r in _split_top(m.group(1), _SEMICOLON) if r]
        return "matrix", tuple(len(r) for r in rows), [x for r in rows for x in r]
    parts = _split_top(s, _UNION)
    if len(parts) >= 2:
        return "union", "", parts
    if s.startswith("\\{") and s.endswith("\\}") and _balanced(s[2:-2]):
        return "set", "", _split_top(s[2:-2])
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        inner = s[1:-1]
        items = _split_top(inner)
        if len(items) == 1:  # `(0;-2;6)`: `;` separates the coordinates where no comma does
            items = _split_top(inner, _SEMICOLON)
        if len(items) >= 2 and _balanced(inner):
            return ("tuple" if s[0] + s[-1] == "()" else "interval"), s[0] + s[-1], items
    items = _split_top(s, _LIST_SEP)
    if len(items) >= 2:
        return "list", "", items
    sides = _split_top(s, _REL_OP)
    if len(sides) >= 2 and all(sides):
        ops = tuple(m.group(0) for m in _REL_OP.finditer(s))
        if len(ops) == len(sides) - 1:
            return "relation", ops, sides
    return "scalar", "", [s]


# ----------------------------------------------------------------------------------------
# Symbolic comparison: a tiny LaTeX -> sympy translator with caps

_SYMPY_OK = re.compile(r"^[0-9a-z+\-*/()., ]*$")
_FUNCS = {"sqrt", "pi", "sin", "cos", "tan", "log", "ln", "exp", "factorial", "root", "e", "i", "I", "E"}
# \frac{a}{b}, \frac12, \frac1{7}, \frac{\sqrt3}2: each argument a group or a single token
_FRAC_ANY = re.compile(r"\\frac\s*(?:\{([^{}]*)\}|([0-9a-zA-Z]))\s*(?:\{([^{}]*)\}|([0-9a-zA-Z]))")


def _latex_to_sympy(s):
    """Translate a small LaTeX subset to a sympy-parsable string, or None if outside it."""
    t = s
    t = t.replace("\\cdot", "*").replace("\\times", "*").replace("\\div", "/").replace("×", "*")
    t = t.replace("\\pi", " pi ").replace("\\infty", " oo ")
    t = re.sub(r"\\(sin|cos|tan|ln|log|exp)\b", r" \1", t)
    for _ in range(MAX_DEPTH):  # innermost first
        before = t
        t = _FRAC_ANY.sub(r"((\1\2)/(\3\4))", t)
        t = re.sub(r"\\sqrt\s*\[([^\[\]{}]*)\]\s*\{([^{}]*)\}", r"root((\2),(\1))", t)
        t = re.sub(r"\\sqrt\s*\{([^{}]*)\}", r"sqrt(\1)", t)
        t = re.sub(r"\\sqrt\s*(\d|[a-z])", r"sqrt(\1)", t)
        t = re.sub(r"\^\s*\{([^{}]*)\}", r"**(\1)", t)
        # plain grouping braces; not a command's argument (`\frac{`, `}{`), which waits above
        t = re.sub(r"(?<![a-zA-Z}\]])\{([^{}]*)\}", r"(\1)", t)
        if t == before:
            break
    t = re.sub(r"\^\s*([+-]?\d+(?:\.\d+)?|[a-zA-Z])", r"**(\1)", t)  # `x^2+1` is (x^2)+1
    t = t.replace("^", "**").replace("!", " !")
    if "\\" in t or "{" in t or "}" in t:
        return None
    t = re.sub(r"(?<![\w.])(\d+(?:\.\d+)?)[eE]([+-]?\d+)", r"(\1*10**(\2))", t)  # 1e5 -> 1*10**5
    # decimals as exact rationals: 10\sqrt{10.5} = 5\sqrt{42}
    t = re.sub(r"(?<![\w.])(\d*)\.(\d+)(?![\w.])", lambda m: f"({int(m.group(1) + m.group(2))}/1{'0' * len(m.group(2))})", t)
    t = re.sub(r"(\w+|\))\s*!", r"factorial(\1)", t)
    if not _SYMPY_OK.match(t.replace("**", "*")):
        return None
    words = set(re.findall(r"[a-zA-Z]+", t))
    if not words <= _FUNCS | {"oo", "x", "y", "z", "n", "a", "b", "c", "k", "m", "t"}:
        return None
    return t


_MONOMIAL_BASE = re.compile(r"(?:(?<![a-z])[a-z]|pi|\d)\s*$")  # what `**` follows: `x`, `pi`, `10`
_SMALL_EXPONENT = re.compile(r"[+-]?\d(?:/[1-9])?")             # `2`, `-1`, `2/3`


def _safe_for_sympy(expr):
    """Caps that keep every sympy call small: depth, exponents, factorials, power towers."""
    if len(expr) > MAX_SYMPY_CHARS or re.search(r"(?<![a-zA-Z])[\d.]+[eE][+-]?\d", expr):
        return False  # a float literal like 1e999999999 would be built by the parser
    depth = 0
    for c in expr:
        depth += c == "("
        depth -= c == ")"
        if depth > MAX_DEPTH or depth < 0:
            return False
    expandable = 0
    for m in re.finditer(r"\*\*\s*\(?\s*([^()*]*)", expr):
        exp = m.group(1).strip()
        # `x^2`, `2^{1/3}`: a small power of a symbol or a number is one term, nothing for
        # sympy to expand; any other power counts against the cap of 3
        if not (_MONOMIAL_BASE.search(expr, 0, m.start()) and _SMALL_EXPONENT.fullmatch(exp)
                and abs(Fraction(exp)) <= 2):
            expandable += 1
        tail = expr[m.end():m.end() + 3]
        if "**" in tail or re.match(r"\s*\*\*", expr[m.end():]):
            return False  # power tower
        if not re.fullmatch(r"[+-]?\d+(?:\.\d+)?|[+-]?\d+/\d+|[a-z]|pi", exp):
            return False  # symbolic or nested exponents are out of scope
        if re.fullmatch(r"[+-]?\d+", exp) and abs(int(exp)) > MAX_EXPONENT:
            return False
    if expandable > 3:
        return False
    for m in re.finditer(r"factorial\((\d+)\)", expr):
        if int(m.group(1)) > MAX_FACTORIAL:
            return False
    if "factorial(" in expr and re.search(r"factorial\([^0-9]", expr):
        return False
    return all(len(d) <= 50 for d in re.findall(r"\d+", expr))


def _sympy_form(s, number):
    """The capped sympy string for `s` (its exact value when numeric), or None."""
    if isinstance(number, Fraction):
        t = f"({number.numerator}/{number.denominator})"
    else:
        t = _latex_to_sympy(s)
    return t if t is not None and _safe_for_sympy(t) else None


def _sympy_equal(ea, eb):
    """True/False when sympy decides, None when it cannot parse (inputs from _sympy_form)."""
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

MAX_SYMPY_CALLS = 16  # per comparison: a long list of symbolic items cannot run for minutes


def _squash(s):
    return re.sub(r"\s+", "", s).lower()


def _scalar_equal(p, g, allow_sympy=True, budget=None):
    if p == g or p.lower() == g.lower():
        return True
    np_, ng = _as_number(p), _as_number(g)
    if np_ is not None and ng is not None:
        return np_ == ng
    if isinstance(np_, tuple) or isinstance(ng, tuple):
        return False  # a number too large to build equals no expression we could check
    if _HEDGE.search(p):
        return False
    if not any(c in p + g for c in "\\^(*/+-!") and not re.search(r"[a-z]", p + g):
        return False  # plain different numbers/strings: nothing symbolic to decide
    ea, eb = _sympy_form(p, np_), _sympy_form(g, ng)
    if ea is None or eb is None:  # no sympy form: compare the normalised text
        return _squash(p) == _squash(g)
    if not allow_sympy:
        return None
    budget = budget if budget is not None else [MAX_SYMPY_CALLS]
    if budget[0] <= 0:
        return False
    budget[0] -= 1
    verdict = _sympy_equal(ea, eb)
    return _squash(p) == _squash(g) if verdict is None else verdict


def _first_hit(pairs, allow_sympy, budget):
    """Index of the first (pred, truth) pair that matches, or None; and whether a pair before
    it was undecided (None: only sympy could tell)."""
    undecided = False
    for k, (p, g) in enumerate(pairs):
        r = _match(p, g, allow_sympy, budget) if p and g else p == g
        if r:
            return k, undecided
        undecided = undecided or r is None
    return None, undecided


def _match(p, g, allow_sympy, budget):
    """Normalised answers: True / False, or None where only sympy could decide."""
    kp, tp, ip = _structure(p)
    kg, tg, ig = _structure(g)
    if kg == "scalar":
        if kp != "scalar" or (_HEDGE.search(p) and not _HEDGE.search(g)):
            return False  # hedged or several values against one value
        return _scalar_equal(p, g, allow_sympy, budget)
    unordered = {"list", "set", "union"}
    if kp == kg == "relation" and tp != tg and tuple(_FLIP[o] for o in reversed(tp)) == tg:
        tp, ip = tg, ip[::-1]  # `5 <= x` is `x >= 5`
    if not ({kp, kg} <= {"list", "set"}) and (kp, tp) != (kg, tg):
        return False  # a tuple is not an interval, nor a set; brackets and shapes must match
    ip, ig = [_normalize(x) or "" for x in ip], [_normalize(x) or "" for x in ig]
    # a set of tuples (solutions) is a set: a tuple listed twice names the same set
    repeats = len(ip) > len(ig) and kg in ("list", "set") and all(
        _structure(x)[0] == "tuple" for x in ig)
    if len(ip) != len(ig) and not repeats:
        return False
    if kg in unordered:  # match each item once, order-free
        left, undecided = list(ip), False
        for x in ig:
            hit, u = _first_hit([(y, x) for y in left], allow_sympy, budget)
            undecided = undecided or u
            if hit is None:
                return None if undecided else False
            left.pop(hit)
        for y in left:  # only where repeats: each tuple left over must be one of the set's
            hit, u = _first_hit([(y, x) for x in ig], allow_sympy, budget)
            undecided = undecided or u
            if hit is None:
                return None if undecided else False
        return True
    results = [_match(a, b, allow_sympy, budget) if a and b else a == b for a, b in zip(ip, ig)]
    if any(r is False for r in results):
        return False
    return None if any(r is None for r in results) else True


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
    return _match(p, g, allow_sympy, [MAX_SYMPY_CALLS])


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
# The reward contract: dapo.py's --reward names a function fn(response, row)

MATH = "reward:math_reward"           # dapo.py's default --reward: this file's checker, Eq. 7
EQUIVALENT = "reward:is_equivalent"   # maj@k's comparisons of two answers
FAILED = {"reward": -1.0, "success": False, "failed": True}  # timed out, raised or garbage: Eq. 7's wrong
MAX_REWARD = 1e9  # larger is garbage: float32 rounds Eq. 13's penalty away, and past 3.4e38 it is inf
RESERVED = ("mean",)  # score/mean is the reward's own mean: a metric of one's own cannot take the name


class RewardError(ValueError):
    """A reward that cannot run at all (its module stopped importing, its worker cannot start): one line."""


def math_reward(response, row, allow_sympy=True):
    """Eq. 7 through the contract: +1 if the answer read from the response (extract_answer) equals
    row["answer"], else -1, with the answer read, for maj@k and eval/answered. allow_sympy=False: None
    where only sympy could decide (score_batch's in-process fast path)."""
    try:
        answer = extract_answer(response)
        ok = _equivalent(answer, row["answer"], allow_sympy)
    except Exception:
        answer, ok = None, False
    if ok is None:
        return None
    return {"reward": 1.0 if ok else -1.0, "success": bool(ok), "answer": answer}


def as_result(value):
    """What a reward function returned, as {"reward": float, "success": bool, "answer"?, "metrics"?}:
    - a bool: Eq. 7's +1 or -1, a success if True;
    - a number: the reward itself, a success where it is > 0;
    - a dict: "reward" (or verl's "score"), and optionally "success" (a bool), "answer" (what the response
      answered: identical answers vote together in maj@k) and other numbers, logged as score/<name>.
    Anything else, a reward that is not finite or beyond MAX_REWARD, or a number named "mean", raises
    ValueError."""
    if isinstance(value, bool):
        return {"reward": 1.0 if value else -1.0, "success": value}
    if isinstance(value, numbers.Real):
        value = {"reward": value}
    if not isinstance(value, dict):
        raise ValueError(f"returned {type(value).__name__} {str(value)[:40]!r}: return a bool, a number or a dict")
    score = value.get("reward", value.get("score"))
    if isinstance(score, bool) or not isinstance(score, numbers.Real):
        raise ValueError(f"returned {str(value)[:80]}: the dict needs a number under 'reward'")
    if not math.isfinite(score) or abs(score) > MAX_REWARD:
        raise ValueError(f"returned a reward of {'NaN' if score != score else f'{score:g}'}: give a finite number "
                         f"of magnitude at most {MAX_REWARD:g}")
    reserved = [k for k in RESERVED if k in value]
    if reserved:
        raise ValueError(f"returned a number named {reserved[0]!r}: score/{reserved[0]} is the reward's own mean; "
                         f"rename it")
    success = value.get("success", score > 0)
    if success not in (True, False):
        raise ValueError(f"returned success={success!r}: give a bool")
    out = {"reward": float(score), "success": bool(success)}
    if "answer" in value:
        a = value["answer"]
        out["answer"] = a if a is None or isinstance(a, str) else repr(a)
    metrics = {k: float(v) for k, v in value.items() if k not in ("reward", "score", "success", "answer")
               and isinstance(v, numbers.Real) and math.isfinite(v)}
    if metrics:
        out["metrics"] = metrics
    return out


def load_reward(spec):
    """'module:function' or 'path/to/file.py:function' -> the function. A module that does not import, a
    missing function or one that cannot take (response, row) raises ValueError, in one line."""
    import importlib
    import importlib.util
    import inspect
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"--reward {spec!r}: give module:function or path/to/file.py:function")
    try:
        if where.endswith(".py"):
            if not os.path.isfile(where):
                raise FileNotFoundError(f"no such file: {where}")
            found = importlib.util.spec_from_file_location(os.path.basename(where)[:-3], where)
            module = importlib.util.module_from_spec(found)
            found.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except BaseException as e:  # the module's own error: SyntaxError, ImportError, an exception it raised
        raise ValueError(f"--reward {spec}: importing {where} failed ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]})")
    fn = getattr(module, name, None)
    if not callable(fn):
        mine = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")][:8]
        raise ValueError(f"--reward {spec}: {where} has no function {name} (it has {', '.join(mine) or 'none'})")
    try:
        inspect.signature(fn).bind("response", {})
    except TypeError:
        raise ValueError(f"--reward {spec}: {name}{inspect.signature(fn)} cannot be called as {name}(response, "
                         f"row): take the response text and the data row")
    except ValueError:  # a builtin with no signature to read
        pass
    return fn


def _worker_main(spec):
    """A worker: loads `spec`, says {"ready": true} (or {"error": why}), then reads one JSON list of
    arguments per line and writes one JSON result per line (as_result; {"error": why} where the function
    raised or returned garbage). Whatever the function prints goes to stderr, never into the answers."""
    import json
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # fd 1 (print, C code) now writes to stderr
    sys.stdout = sys.stderr

    def say(obj):
        answers.write(json.dumps(obj) + "\n")
        answers.flush()
    try:
        fn = load_reward(spec)
        if spec.startswith("reward:"):
            import sympy  # noqa: F401  (imported once here, not inside the first item's time limit)
    except ValueError as e:
        return say({"error": str(e)})
    say({"ready": True})  # the per-item clock starts after start-up
    for line in sys.stdin:
        try:
            say(as_result(fn(*json.loads(line))))
        except Exception as e:
            say({"error": f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"})


class _Worker:
    """One worker process; killed and replaced when it overruns. Its working directory is the trainer's, and
    this file's folder comes first on its path (for `import reward`)."""

    def __init__(self, spec):
        code = f"import sys; sys.path.insert(0, {_HERE!r}); import reward; reward._worker_main({spec!r})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL if spec.startswith("reward:") else None,
                                     text=True, bufsize=1)
        self.item, self.started = None, 0.0
        self.spec, self.ready = spec, False

    def wait_ready(self, timeout=60.0):
        """The worker, once it has loaded the function; RewardError in one line if it cannot."""
        if not self.ready:
            up = select.select([self.proc.stdout], [], [], timeout)[0]
            self.read_ready(self.proc.stdout.readline() if up else None, timeout)
        return self

    def read_ready(self, line, timeout):
        """Its first line (None: nothing within timeout s): ready, or RewardError saying why not."""
        import json
        if line is not None and line.strip() == '{"ready": true}':
            self.ready = True
            return
        self.kill()
        if line is None:
            raise RewardError(f"--reward {self.spec}: loading it took over {timeout:.0f} s (does its module "
                              f"hang on import?)")
        raise RewardError(json.loads(line)["error"] if line.startswith('{"error"') else (
            f"--reward {self.spec}: the worker process exited while loading it (exit code {self.proc.returncode})"))

    def submit(self, idx, payload):
        self.item, self.started = idx, time.monotonic()
        self.proc.stdin.write(payload)
        self.proc.stdin.flush()

    def kill(self):
        self.proc.kill()
        self.proc.wait()


_POOL = {}
_HERE = os.path.dirname(os.path.abspath(__file__))
_WARNED = set()


def _pool(spec, n, timeout=60.0):
    """At least n live workers for `spec`: the pool's own list, kept between calls, in which
    score_batch replaces a killed worker in place."""
    workers = _POOL[spec] = [w for w in _POOL.get(spec, []) if w.proc.poll() is None]
    while len(workers) < n:
        workers.append(_Worker(spec))
    for w in workers:
        w.wait_ready(timeout)  # they start in parallel, then we wait
    return workers


def check_reward(spec, timeout=60.0):
    """Load `spec` in a worker process, before anything slow starts (the trainer's process never imports
    it): ValueError in one line if its module does not import (or hangs, or crashes, importing), the
    function is missing, or it cannot take (response, row). The worker stays in the pool."""
    _pool(spec, 1, timeout)


def close_pool():
    """Kill every worker now (on Ctrl-C or exit); the next score_batch starts fresh ones.
    Only SIGKILL and wait, so it is quick and safe to call at any moment."""
    for spec in list(_POOL):
        for w in _POOL.pop(spec, []):
            try:
                w.kill()
            except Exception:
                pass


def _in_process(fn, response, row):
    """The result where it needs no sympy, decided here by linear-time string work (it cannot hang), for
    this file's own functions; else None."""
    if fn == MATH:
        return math_reward(response, row, allow_sympy=False)
    if fn == EQUIVALENT:
        try:
            same = _equivalent(response, row, allow_sympy=False)
        except Exception:
            same = False
        return None if same is None else as_result(bool(same))
    return None


def score_batch(responses, rows, fn=MATH, timeout=5.0, num_workers=2, group_size=1):
    """Score many responses with the reward function `fn` ('module:function', called as fn(response, row));
    the trainer's entry point. Returns (results, stats): one as_result dict per response, and
    {"timeouts", "errors", "in_process"}. The math checker's answers that need no sympy are decided in this
    process; everything else runs in `num_workers` worker processes, each item with a hard wall-clock limit
    of `timeout` s. An item that overruns (its worker is killed), raises, crashes its worker or returns
    garbage is counted, marked "failed", and scores the lowest reward of its group (responses in contiguous
    blocks of group_size), at most -1; the first error is printed once. A killed or crashed worker is
    replaced while the others work on; a replacement that cannot load the function raises RewardError."""
    import json
    assert len(responses) == len(rows)
    results, todo = [None] * len(responses), []
    for i, (r, row) in enumerate(zip(responses, rows)):
        results[i] = _in_process(fn, r, row)
        if results[i] is None:
            todo.append(i)
    stats = {"timeouts": 0, "errors": 0, "in_process": len(responses) - len(todo)}
    if not todo:
        return results, stats
    workers = _pool(fn, max(1, min(num_workers, len(todo))))
    queue = list(reversed(todo))
    busy, starting = {}, {}  # by output fd: workers scoring an item; replacements loading the function

    def fail(i, why):
        results[i] = dict(FAILED)
        if why and fn not in _WARNED:
            _WARNED.add(fn)
            print(f"warning: --reward {fn} failed on a response ({why}); such a response is no success, scores "
                  f"the lowest reward of its group (at most {FAILED['reward']:g}) and is counted in "
                  f"reward/errors", file=sys.stderr)

    def replace(w):  # not waited for: the other workers go on meanwhile
        new = workers[workers.index(w)] = _Worker(fn)
        new.started = time.monotonic()
        starting[new.proc.stdout.fileno()] = new

    while queue or busy:
        for w in workers:  # hand out work
            if w.ready and w.item is None and queue:
                i = queue.pop()
                w.submit(i, json.dumps([str(responses[i])[-MAX_RESPONSE_CHARS:], rows[i]], default=str) + "\n")
                busy[w.proc.stdout.fileno()] = w
        now = time.monotonic()
        deadlines = [w.started + timeout for w in busy.values()] + [w.started + 60.0 for w in starting.values()]
        ready, _, _ = select.select(list(busy) + list(starting), [], [], max(0.0, min(deadlines) - now))
        for fd in ready:
            if fd in starting:
                w = starting.pop(fd)
                w.read_ready(w.proc.stdout.readline(), 60.0)
                continue
            w = busy.pop(fd)
            line = w.proc.stdout.readline()
            out = json.loads(line) if line.startswith("{") else {"error": "its worker process died"}
            if "error" in out:
                stats["errors"] += 1
                fail(w.item, out["error"])
                if not line:  # the worker died: replace it
                    replace(w)
                    continue
            else:
                results[w.item] = out
            w.item = None
        now = time.monotonic()
        for fd, w in list(busy.items()):
            if now - w.started >= timeout:  # overran: kill, count, replace
                busy.pop(fd)
                w.kill()
                stats["timeouts"] += 1
                fail(w.item, None)
                replace(w)
        for fd, w in list(starting.items()):
            if now - w.started >= 60.0:
                starting.pop(fd).read_ready(None, 60.0)
    lowest = {}  # a failure scores the lowest reward of its group, at most -1
    for i, r in enumerate(results):
        if not r.get("failed"):
            lowest[i // group_size] = min(lowest.get(i // group_size, FAILED["reward"]), r["reward"])
    for i, r in enumerate(results):
        if r.get("failed"):
            r["reward"] = lowest.get(i // group_size, FAILED["reward"])
    return results, stats


def majority_correct(answers, successes, timeout=5.0, num_workers=2, by_equivalence=True):
    """maj@k (the DAPO paper's cons@k): whether the most common answer was a success. None never votes; a
    tie goes to the first seen. by_equivalence: answers vote by the checker's equivalence class ("1/2" and
    "0.5" are one answer), every comparison through score_batch under its time limit, as the training reward
    is (an overrun counts as different); else identical answers vote together (a reward of one's own)."""
    votes = [(a, s) for a, s in zip(answers, successes) if a is not None]
    distinct = list(dict.fromkeys(a for a, _ in votes))
    same = {(a, a): True for a in distinct}
    if by_equivalence:  # each answer against every one seen before it
        pairs = [(a, b) for i, a in enumerate(distinct) for b in distinct[:i]]
        if pairs:
            verdicts = score_batch(*zip(*pairs), fn=EQUIVALENT, timeout=timeout, num_workers=num_workers)[0]
            same.update(zip(pairs, (v["success"] for v in verdicts)))
    classes = []  # [the first answer of the class, its votes, whether it was a success]
    for a, s in votes:
        for c in classes:
            if same.get((a, c[0])):
                c[1] += 1
                break
        else:
            classes.append([a, 1, s])
    return float(max(classes, key=lambda c: c[1])[2]) if classes else 0.0  # max() keeps the first of a tie


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
        "1e999999999": "Answer: 1e999999999",
        "1e-999999999": "Answer: 1e-999999999",
        "1.5 x 10^999999999": "\\boxed{1.5\\times10^{999999999}}",
        "10**999999999": "Answer: 10**999999999",
        "1e999999999 inside an expression": "\\boxed{1e999999999x+1}",
        "999999999^999999999": "\\boxed{999999999^{999999999}}",
        "200-char decimal": "Answer: 0." + "0" * 190 + "1",
        "mixed number": "\\boxed{2\\frac{1}{3}}",
    }
    compute_score("\\boxed{\\sqrt{12}}", "2\\sqrt3")  # sympy's one-off import is not a per-call cost
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
