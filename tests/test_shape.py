"""The project's shape: dapo.py reads as the algorithm first, imports run one way, and the words say what the
project is, never how it was made."""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
import re
import pytest
from tests.shared import HERE, _run


# How the project was made, which no user can follow. Each pattern, case-insensitive, on one line:
PROCESS_WORDS = [
    r"\bissues?\s+#?\d+",                    # the project's own issue numbers ("issue 14", "issues 13 and 26")
    r"\b(this|that|same|earlier|later|next|previous|each|one)\s+turn\b",   # a turn of the project's work
    r"\bsessions?\b",                        # the project's work sessions (real meanings: SESSION_OK)
    r"\blent\b",                             # "no GPU was lent"
    r"\.\./shared",                          # a folder no clone has
    r"this\s+project.s\s+machines?",
    r"\bfeasibility\s+study\b",
    r"\bmeasured\s+here\b",                  # where "here" is the machine the project was built on
    r"(?<![\w/-])#\d{2,}\b",                 # a bare reference: outside ones read OUTSIDE_REF (vLLM #42609)
    r"\b(it|this|that|which)\s+used\s+to\b",   # a changelog: "it used to scale every gradient to zero"
    r"\b(crashed|failed|broke)\b[^.]*\bbefore\b(?![^.]*\b(any|its|the|a|an|vLLM)\b)",   # "this crashed ... before"
    r"\bnow\s+(says|does|gives|takes|runs)\b",   # "dapo.py now says so"
    r"\b(once|twice)\s+in\s+\d+\s+(rounds|runs)\b",   # a flake's history
]


SESSION_OK = r'scope="session"|start_new_session|_session\b|in_session|process sessions?|its own session|' \
             r'test session|in any session|session sid'   # a pytest session; a process session (setsid)


OUTSIDE_REF = r"\b(vLLM|verl|TRL|trl|PyTorch|pytorch|transformers|DAPO)\s?#\d+"


pytestmark = pytest.mark.timeout(1200, method="thread")  # the subprocess helpers time out first


def test_dapo_py_reads_as_the_algorithm_first():
    """dapo.py's structure, each failure naming what to fix; no bound on its size, so a fork can add lines.
    One `# Part 2` banner, then one `# Part 3`. Part 1 holds every equation's implementation (Eq. 7-13: Eq. 8 at
    policy_loss, Eq. 9's ratio where it is computed), and the functions of one step (the maths, train(), the
    rollout, the update, evaluation), in lines of at most 100 characters. No later objective, estimator or
    correction lives in Part 1: none is named in its code, policy_loss and set_advantages branch only for
    DAPO's own default (dapo_token_loss, group_advantages, called by name) and leave every other --loss and
    --adv-estimator to the tables, and Part 1 reaches Part 2 only through its two tables (DAPO's own entries
    first) and its five hooks. (That train() makes Algorithm 1's calls in order: test_dapo.py.)"""
    import ast
    src = open(os.path.join(HERE, "dapo.py")).read()
    lines = src.splitlines()
    banners = {k: [i for i, line in enumerate(lines, 1) if line.startswith(f"# Part {k}")] for k in (2, 3)}
    assert len(banners[2]) == 1 and len(banners[3]) == 1 and banners[2] < banners[3], \
        f"dapo.py needs one '# Part 2' banner line, then one '# Part 3': found {banners}"
    part1, part2 = banners[2][0] - 1, banners[3][0] - 1
    print(f"dapo.py: {len(lines)} lines; Part 1 {part1}, Part 2 {part2 - part1}, Part 3 {len(lines) - part2}")
    body = ast.parse(src).body
    defs = {n.name: n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    tables = {t.id: n for n in body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    for name in ("DapoConfig", "policy_loss", "group_advantages", "dapo_token_loss", "dynamic_sampling_mask",
                 "loss_normaliser", "overlong_penalty", "overlong_filtering", "train", "sample_groups", "collect_batch",
                 "shape_rewards", "set_advantages", "update_policy", "policy_gradient", "evaluate"):
        assert defs[name].end_lineno <= part1, f"{name}() is DAPO: move it above the '# Part 2' banner"
    long = [i for i, line in enumerate(lines[:part1], 1) if len(line) > 100]
    assert not long, f"Part 1's lines {long[:5]} are over 100 characters: wrap them"
    for n in (7, 8, 9, 10, 11, 12, 13):
        assert f"Eq. {n}" in "\n".join(lines[:part1]), f"Eq. {n} is cited nowhere in Part 1: cite it where it is implemented"
    policy = ast.get_source_segment(src, defs["policy_loss"])
    assert "Eq. 8" in policy and "r_{i,t}" in policy, "policy_loss is Eq. 8, J_DAPO; it computes Eq. 9's r_{i,t}: say so"
    for fn, own, table in (("policy_loss", "dapo_token_loss", "OBJECTIVES"),
                           ("set_advantages", "group_advantages", "ADV_ESTIMATORS")):
        named = {x.id for x in ast.walk(defs[fn]) if isinstance(x, ast.Name)}
        assert {own, table} <= named, f"{fn} runs DAPO's {own} by name, and a later one from {table}"
    for name, first in (("OBJECTIVES", "dapo"), ("ADV_ESTIMATORS", "grpo")):
        node = tables[name]
        assert part1 < node.lineno <= part2, f"{name} is after DAPO: it belongs in Part 2"
        assert node.value.keys[0].value == first, f"{name} names DAPO's own entry first ({first!r})"
    later = {k.value for k in tables["OBJECTIVES"].value.keys + tables["ADV_ESTIMATORS"].value.keys} - {"dapo", "grpo"}
    part2_defs = {n for n, d in defs.items() if part1 < d.lineno <= part2}
    hooks = {"adjust_token_losses", "after_rollout", "end_of_step", "loss_terms", "select_tokens"}
    for n in body:
        if n.lineno > part1 or isinstance(n, ast.ClassDef):  # Config's fields name flags, not functions
            continue
        code = ast.get_source_segment(src, n) if not isinstance(n, ast.ClassDef) else ""
        words = {x.value for x in ast.walk(ast.parse(code)) if isinstance(x, ast.Constant) and isinstance(x.value, str)} \
            if code else set()
        named = {x.id for x in ast.walk(n) if isinstance(x, ast.Name)}
        assert not words & later, f"line {n.lineno} names {sorted(words & later)}: later objectives live in Part 2"
        assert not named & part2_defs - hooks, (f"line {n.lineno} calls {sorted(named & part2_defs - hooks)} of Part 2:"
                                                f" Part 1 reaches Part 2 through {sorted(hooks)} and the tables")


def test_imports_run_one_way():
    """dapo.py imports reward.py and lib/ only; lib/ and reward.py import no project module that imports dapo.py
    (nothing in lib/ imports dapo or tools); tools/ may import dapo.py and lib/, never the other way; nothing
    imports examples/; no cycle (imports inside functions count). Every script among them runs on its own
    (--help)."""
    files = _module_files()
    graph = {m: _project_imports(os.path.join(HERE, f)) for m, f in files.items()}
    assert not {m for m in graph["dapo"] if m.startswith("tools.")}, \
        f"dapo.py imports {sorted(graph['dapo'])}: what dapo.py imports belongs in lib/, not tools/"
    for m, deps in graph.items():
        if m.startswith("lib.") or m == "reward":
            bad = {d for d in deps if d == "dapo" or d.startswith("tools.")}
            assert not bad, f"{files[m]} imports {sorted(bad)}: lib/ and reward.py sit below dapo.py; move it to tools/"
        if not m.startswith("examples."):
            used = {d for d in deps if d.startswith("examples.")}
            assert not used, f"{files[m]} imports {sorted(used)}: examples/ are forks to copy, which nothing imports"

    def reaches(a, b, seen=()):
        return any(n == b or (n not in seen and reaches(n, b, seen + (n,))) for n in graph.get(a, ()))
    cycles = [m for m in graph if reaches(m, m)]
    assert not cycles, f"import cycle through {cycles}: {graph}"
    helps = ("import runpy, sys\nfor f in sys.argv[1:]:\n    sys.argv = [f, '--help']\n    print('=== ' + f)\n"
             "    try:\n        runpy.run_path(f, run_name='__main__')\n        print('=== exit 0')\n"
             "    except SystemExit as e:\n        print('=== exit', e.code or 0)\n")   # each as __main__, one interpreter
    scripts = [f for m, f in files.items() if m != "dapo" and "__main__" in open(os.path.join(HERE, f)).read()]
    out = _run([sys.executable, "-c", helps, *scripts], timeout=300)
    parts = dict(re.findall(r"=== (\S+)\n(.*?)=== exit", out.stdout, re.S))
    for f in scripts:
        assert f in parts and len(parts[f].splitlines()) > 3, (f, out.stdout[-2000:], out.stderr[-2000:])
    assert out.stdout.count("=== exit 0") == len(scripts), out.stdout[-3000:]
    pictures = [f for folder in ("lib", "tools", "examples") for f in os.listdir(os.path.join(HERE, folder))
                if f.endswith((".png", ".svg", ".jpg"))]
    assert not pictures, f"{pictures}: pictures go with the docs, in docs/"


def test_no_words_about_how_the_project_was_made():
    """No file of the project speaks of how it was built: PROCESS_WORDS lists the patterns (the project's issue
    numbers, a turn or session of its work, a GPU lent, ../shared, this project's machines, the feasibility
    study, measured here, a bare #N). The exceptions keep real meanings: a pytest scope="session" and a process
    session (SESSION_OK); an outside reference written with its project's name (OUTSIDE_REF); a chat turn.
    Scanned: README.md, docs/, every .py, the requirements, run_32b.sh and .ci/run (this test's own lines
    excepted). A measurement names its conditions instead (hardware, versions, the command)."""
    import ast
    import glob
    body = ast.parse(open(__file__).read()).body
    first = next(n.lineno for n in body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") ==
                 "PROCESS_WORDS") - 1
    last = next(n.end_lineno for n in body if getattr(n, "name", "") == "test_no_words_about_how_the_project_was_made")
    files = ["README.md", "run_32b.sh", ".ci/run", *glob.glob("*.py", root_dir=HERE), *glob.glob("*.txt", root_dir=HERE),
             *glob.glob("docs/*.md", root_dir=HERE), *glob.glob("lib/*.py", root_dir=HERE),
             *glob.glob("tools/*.py", root_dir=HERE), *glob.glob("examples/*.py", root_dir=HERE),
             *glob.glob("tests/*.py", root_dir=HERE)]
    found = []
    for f in files:
        for n, line in enumerate(open(os.path.join(HERE, f)).read().splitlines(), 1):
            if f == os.path.join("tests", "test_shape.py") and first <= n <= last:
                continue
            text = re.sub(SESSION_OK, "", re.sub(OUTSIDE_REF, "", line), flags=re.I)
            found += [f"{f}:{n}: {line.strip()[:120]}" for p in PROCESS_WORDS if re.search(p, text, re.I)]
    print(f"{len(files)} files scanned; {len(found)} lines speak of how the project was made")
    assert not found, "state conditions instead (hardware, versions, the command):\n" + "\n".join(found)


# -----------------------------------------------------------------------------------------
# Helpers

def _project_imports(path):
    """The project modules (dapo, reward, lib.*, tools.*, examples.*) that a file imports, inside functions too."""
    import ast
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update([node.module] + [f"{node.module}.{a.name}" for a in node.names])
    found = {"dapo", "reward"} & names
    for folder in ("lib", "tools", "examples"):
        mods = {f[:-3] for f in os.listdir(os.path.join(HERE, folder)) if f.endswith(".py") and f != "__init__.py"}
        found |= {f"{folder}.{m}" for m in mods if f"{folder}.{m}" in names or (folder != "lib" and m in names)}
    return found


def _module_files():
    """{module: path} for dapo.py, reward.py and every module of lib/, tools/ and examples/."""
    files = {"dapo": "dapo.py", "reward": "reward.py"}
    for folder in ("lib", "tools", "examples"):
        for f in sorted(os.listdir(os.path.join(HERE, folder))):
            if f.endswith(".py") and f != "__init__.py":
                files[f"{folder}.{f[:-3]}"] = os.path.join(folder, f)
    return files
