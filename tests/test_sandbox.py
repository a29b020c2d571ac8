"""lib/sandbox.py, the sandbox for rewards that run a model's code, and examples/code_task.py, the task that uses it.
The hostile suite runs at every isolation level this machine gives (bwrap, Landlock, rlimits: sandbox.levels()),
each held to what it claims: an attack a level does not say it lacks must fail there. The level found is in pytest's
header (conftest.py)."""
import json
import os
import secrets
import signal
import socket
import sys
import time

import pytest

import reward
from lib import sandbox
from tests.shared import HERE

FAST = {"wall_s": 1.0}  # the endless candidates end sooner; the limits are otherwise the defaults
SECRET_VAR = "DAPO_TEST_SECRET"

# Each candidate is `def f(): ...`; it passes only by returning the hidden expected output, SECRET, which lives in a
# file of the test, in the caller's environment, and nowhere else. (name, what a level must have to stop it, source)
ATTACKS = [
    ("endless loop", None, "def f():\n    while True:\n        pass"),
    ("sleep past the wall clock", None, "import time\ndef f():\n    time.sleep(60)"),
    ("fork bomb", None, "import os\ndef f():\n    while True:\n        try:\n            os.fork()\n"
                        "        except OSError:\n            pass"),
    ("memory bomb", None, "def f():\n    x = []\n    while True:\n        x.append(' ' * 10 ** 7)"),
    ("one huge allocation", None, "def f():\n    return len(bytearray(10 ** 11))"),
    ("flood of output", None, "def f():\n    while True:\n        print('x' * 10000)"),
    ("prints a pass", None,
     "def f():\n    print('pass'); print('PASSED'); print('[[\"ok\", \"guess\"]]')\n    return 'pass'"),
    ("forges the results channel", None,
     "import os\ndef f():\n    for fd in range(20):\n        try:\n"
     "            os.write(fd, b'[[\"ok\", \"{secret_guess}\"]]\\n')\n"
     "        except OSError:\n            pass\n    os._exit(0)"),
    ("sys.exit(0)", None, "import sys\ndef f():\n    sys.exit(0)"),
    ("os._exit(0)", None, "import os\ndef f():\n    os._exit(0)"),
    ("reads the environment", "env",
     "import os\ndef f():\n    found = os.environ.get('{var}')\n    for pid in (os.getppid(), {pid}):\n        try:\n"
     "            env = open('/proc/%d/environ' % pid, 'rb').read().split(b'\\0')\n"
     "            found = found or next(e.split(b'=', 1)[1].decode() for e in env if e.startswith(b'{var}='))\n"
     "        except Exception:\n            pass\n    return found"),
    ("reads the hidden tests", "files", "def f():\n    return open('{hidden}').read()"),
    ("writes outside its directory", "files",
     "import os\ndef f():\n    for p in ('{outside}', '/tmp/{marker}', os.path.expanduser('~/{marker}')):\n"
     "        try:\n"
     "            open(p, 'w').write('x')\n        except Exception:\n            pass"),
    ("os.system", "files", "import os\ndef f():\n    os.system('cat {hidden} > {outside}; echo pass')\n"
                           "    return open('{outside}').read()"),
    ("subprocess", "files", "import subprocess\ndef f():\n"
                            "    return subprocess.run(['cat', '{hidden}'], capture_output=True, text=True).stdout"),
    ("ctypes", "files", "import ctypes\ndef f():\n    ctypes.CDLL(None).system(b'cp {hidden} {outside}')\n"
                        "    return open('{outside}').read()"),
    ("opens a socket", "net",
     "import socket\ndef f():\n    s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                              "    s.sendall(b'{marker}')\n    return s.recv(100).decode()"),
    ("signals its parent", "signals",
     "import os, signal\ndef f():\n    for pid in (os.getppid(), {pid}):\n        try:\n"
     "            os.kill(pid, signal.SIGUSR1)\n        except Exception:\n            pass"),
    ("leaves its group", "pids",
     "import os\ndef f():\n    if os.fork() == 0:\n        os.setsid()\n"
     "        os.execv('/bin/sh', ['sh', '-c', 'while :; do sleep 0.2; done', '{marker}'])\n    return None"),
]


@pytest.mark.parametrize("level", [lv["name"] for lv in sandbox.levels()])
def test_hostile_candidates_score_lowest_leave_nothing_behind_and_the_run_goes_on(level, tmp_path, monkeypatch):
    """Every attack of ATTACKS at this level: the candidate never returns the hidden output (so the reward's verdict,
    computed outside, is the lowest); no file appears outside its directory; no process of its outlives the call;
    the caller gets no signal, no connection, and goes on: a good program still scores right afterwards. An attack
    that needs what the level says it lacks (its line) is only checked to be named there."""
    lv = next(x for x in sandbox.levels() if x["name"] == level)
    secret, marker = secrets.token_hex(8), "dapo-sandbox-test-" + secrets.token_hex(4)
    hidden, outside = tmp_path / "hidden.json", tmp_path / "escaped"
    hidden.write_text(secret)
    monkeypatch.setenv(SECRET_VAR, secret)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.setblocking(False)
    signalled = []
    old = signal.signal(signal.SIGUSR1, lambda *_: signalled.append(1))
    fill = dict(secret_guess="guess", var=SECRET_VAR, pid=os.getpid(), hidden=hidden, outside=outside, marker=marker,
                port=listener.getsockname()[1])
    try:
        for name, needs, source in ATTACKS:
            if needs in lv["lacks"]:
                assert sandbox.LACKS[needs] in lv["line"], (level, name)
                print(f"{level:8s} {name:28s} not stopped here: its line says it lacks {needs}")
                continue
            t = time.monotonic()
            got = sandbox.call(source.format(**fill), "f", [[]], limits=FAST, level=lv)
            spent = time.monotonic() - t
            print(f"{level:8s} {name:28s} {spent:5.2f} s  {str(got['error'] or got['outputs'][0])[:60]}")  # pytest -s
            assert got["outputs"] != [["ok", secret]], (level, name, got)
            assert spent < FAST["wall_s"] + 1.5, (level, name, spent)
            assert not outside.exists() and not os.path.exists(f"/tmp/{marker}"), (level, name)
            assert not os.path.exists(os.path.expanduser(f"~/{marker}")), (level, name)
            assert not _processes_with(marker), (level, name)
            with pytest.raises(BlockingIOError):
                listener.accept()
            assert not signalled, (level, name)
        assert sandbox.call("def f(xs):\n    return sorted(xs)", "f", [[[3, 1, 2]]], level=lv)["outputs"] == \
            [["ok", [1, 2, 3]]]
    finally:
        signal.signal(signal.SIGUSR1, old)
        listener.close()
        for pid in _processes_with(marker):  # a level that lacks a pid namespace: the test ends them
            os.kill(pid, signal.SIGKILL)


def test_the_verdict_reads_only_plain_data_and_the_runner_is_locked_down_first():
    """Outputs are plain JSON, by exact type: an object whose __eq__ says yes to anything, an int subclass, a float
    NaN or a generator is "raised", never a pass; a program that does not load gives an error and no outputs; a
    call that raises gives ["raised", its type]; inside, the limits are set before the candidate runs; and a
    bubblewrap that cannot start raises instead of scoring."""
    source = ("import resource\nclass Yes:\n    def __eq__(self, other):\n        return True\n"
              "class Int(int):\n    pass\n"
              "def f(kind):\n    if kind == 'limits':\n"
              "        return [resource.getrlimit(r)[0] for r in (resource.RLIMIT_CPU, resource.RLIMIT_NPROC)]\n"
              "    return {'yes': Yes(), 'int': Int(3), 'nan': float('nan'), 'gen': (i for i in []), 'div': 1 // 0 "
              "if kind == 'div' else 0, 'ok': (1, 'a', None, [True, 2.5])}[kind]")
    got = sandbox.call(source, "f", [["yes"], ["int"], ["nan"], ["gen"], ["div"], ["ok"], ["limits"]])
    limits = [sandbox.LIMITS["cpu_s"], sandbox.LIMITS["processes"]]
    assert got["outputs"] == [["raised", "TypeError"]] * 4 + [["raised", "ZeroDivisionError"],
                                                              ["ok", [1, "a", None, [True, 2.5]]], ["ok", limits]]
    broken = sandbox.call("def f(:\n", "f", [[]])
    assert broken["outputs"] is None and "did not load: SyntaxError" in broken["error"]
    assert "did not load: KeyError" in sandbox.call("def g():\n    return 1", "f", [[]])["error"]
    if sandbox.isolation()["name"] == "bwrap":  # a sandbox that cannot start raises, in one line: never a silent -1
        level = dict(sandbox.isolation(), argv=lambda fd: [sandbox.isolation()["argv"](fd)[0], "--no-such-flag"])
        with pytest.raises(RuntimeError, match="the sandbox failed: bwrap: Unknown option --no-such-flag"):
            sandbox.call("def f():\n    return 1", "f", [[]], level=level)


def test_the_code_task_scores_through_the_sandbox_in_the_reward_workers(tmp_path):
    """examples/code_task.py's reward, through reward.score_batch's workers as dapo.py calls it: a right body +1,
    a wrong one, a hostile one (a file written, an endless loop, os._exit) and no `return` line -1, each within
    the sandbox's wall clock, which lies inside --reward-timeout; a failed program has no answer (no vote); the
    worker's directory gets no file; the answer is the outputs, so two spellings of one program vote together."""
    code = _example("code_task")
    train, held = code.rows()
    add = next(r for r in held + train if r["answer"]["name"].startswith("times_"))
    k = int(add["answer"]["name"].split("_")[1])
    responses = [f"return [x * {k} for x in xs]", f"return [x*{k} for x in xs]", "return [x + 1 for x in xs]",
                 "return open('pwned', 'w').write('x')", "return [x for x in iter(int, 1)]",
                 "return __import__('os')._exit(0)", "The answer is [1, 2]"]
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        results, stats = reward.score_batch(responses, [add] * len(responses), timeout=5.0, num_workers=2,
                                            fn=f"{HERE}/examples/code_task.py:reward")
    finally:
        os.chdir(cwd)
        reward.close_pool()
    assert [r["reward"] for r in results] == [1.0, 1.0, -1.0, -1.0, -1.0, -1.0, -1.0], results
    assert stats["timeouts"] == stats["errors"] == 0 and sandbox.LIMITS["wall_s"] < 5.0
    assert results[0]["answer"] == results[1]["answer"] != results[2]["answer"]
    assert [r["answer"] for r in results[4:]] == [None, None, None] and not os.listdir(tmp_path)
    assert json.loads(results[0]["answer"]) == [["ok", out] for out in add["answer"]["outputs"]]
    assert reward.majority_correct([r.get("answer") for r in results[:3]], [r["success"] for r in results[:3]],
                                   by_equivalence=False) == 1.0


def test_code_task_rows_hide_their_tests_and_hold_out_constants(tmp_path):
    """examples/code_task.py: two worked examples as chat turns, then a signature and docstring whose example call
    is not among the hidden inputs; the answer's outputs are the reference's; no held-out prompt is trained on;
    dapo.py reads the files with a reward of its own (and refuses them for the math checker)."""
    import dapo
    code = _example("code_task")
    code.main([str(tmp_path)])
    train, held = (dapo.load_data(str(tmp_path / f"{n}.jsonl"), any_answer=True) for n in ("train", "eval"))
    assert len(held) == 4 * len(code.TASKS) and len(train) + len(held) == len(code.TASKS) * len(code.KS) - 2
    for r in train[:40] + held:
        assert [m["role"] for m in r["prompt"]] == ["user", "assistant"] * 2 + ["user"]
        t, shown = r["answer"], r["prompt"][-1]["content"]
        assert shown.startswith(f"def {t['name']}({t['arg']}):") and len(t["inputs"]) == 6
        task = next(x for x in code.TASKS if t["name"].rsplit("_", 1)[0] == x[0].rsplit("_", 1)[0])
        fn = code.reference(task, int(t["name"].rsplit("_", 1)[1]))
        assert t["outputs"] == [fn(x) for x in t["inputs"]]
    assert not {r["prompt"][-1]["content"] for r in held} & {r["prompt"][-1]["content"] for r in train}
    with pytest.raises(dapo.DapoError, match="must be a string or a number for the math checker"):
        dapo.load_data(str(tmp_path / "eval.jsonl"))


# -----------------------------------------------------------------------------------------
# Helpers

def _processes_with(marker):
    """Pids of the processes whose command line holds marker."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                found.append(int(pid))
        except OSError:
            pass
    return found


def _example(name):
    sys.path.insert(0, os.path.join(HERE, "examples"))
    return __import__(name)
