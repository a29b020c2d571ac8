"""
interrupt.py: Ctrl-C for dapo.py. The first stops the run and says how to resume it (the last complete
checkpoint and the user's own command plus --resume); the second exits at once. Either way nothing the
run started is left running. dapo.py's main() installs it; STATE is what the message needs.
"""

import contextlib
import os
import sys
import time

from lib.check_data import latest_checkpoint
from lib.dist import remove_own_ipc_dirs, unlink_group_shm

STATE = {}  # set by dapo.py: the resume command, the step in progress, its progress bar; and flags here


def kill_children(root=None):
    """Kill every process this one (or root) started, grandchildren included (reward workers, whatever
    vLLM or torch spawned, in any session): all are found first, since a kill re-parents grandchildren."""
    root = root or os.getpid()
    parent = {}
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{pid}/stat") as f:
                parent[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
    family, new = set(), {root}
    while new:
        family |= new
        new = {p for p, pp in parent.items() if pp in family} - family
    for pid in family - {os.getpid()}:
        with contextlib.suppress(OSError):
            os.kill(pid, 9)  # SIGKILL


def resume_command(argv):
    """The user's own command line, plus --resume."""
    import shlex
    args = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--no-resume"]
    args += [] if "--resume" in args else ["--resume"]
    script = sys.argv[0] if sys.argv[0].endswith(".py") else "dapo.py"
    ws = int(os.environ.get("WORLD_SIZE", "1"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", ws))
    launch = ["python"]
    if ws > 1:
        launch = ["torchrun", f"--nproc_per_node={per_node}"]
        if ws > per_node:
            launch.append(f"--nnodes={ws // per_node}")
    return shlex.join(launch + [script] + args)


def exit_interrupted(cfg):
    """Rank 0 says, once, where the run stopped and how to resume it; then exit 130, leaving nothing
    running. os.write and os._exit: safe from any thread, and never stuck on vLLM's or torch's threads."""
    if os.environ.get("RANK", "0") == "0" and not STATE.get("said"):
        STATE["said"] = True
        step, ckpt = STATE.get("step"), latest_checkpoint(cfg.out_dir)
        msg = f"interrupted at step {step} of {cfg.steps}" if step else "interrupted during start-up"
        if cfg.eval_only:
            msg = "interrupted during evaluation"
        elif ckpt:
            msg += f"; last complete checkpoint: {ckpt} (resume with: {STATE['resume']})"
        else:
            msg += "; no checkpoint saved yet (--save-every N saves one every N steps)"
        bar = STATE.get("bar")
        newline = "\n" if bar is not None and not bar.disable else ""  # end tqdm's half-drawn line
        with contextlib.suppress(OSError):
            os.write(2, f"{newline}{msg}\n".encode())
    kill_children()
    remove_own_ipc_dirs()  # os._exit runs no exit hook, nor vLLM's teardown of its TP group's queue
    unlink_group_shm("")
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    os._exit(130)


def catch_ctrl_c(cfg):
    """First SIGINT: KeyboardInterrupt in the main thread, which dapo.py's main() turns into a clean stop, or exits
    anyway after 15 s. Second SIGINT: exit at once. A thread watches the signal's wakeup fd, so both hold
    while the main thread is stuck in C code (vLLM, a collective); torchrun forwards a terminal's Ctrl-C to
    every rank. Returns the function that undoes this."""
    import select
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    r, w = os.pipe()
    os.set_blocking(w, False)

    def on_sigint(signum, frame):
        STATE["handled"] = STATE.get("handled", 0) + 1
        STATE["stopping"] = True
        if STATE["handled"] == 1:
            raise KeyboardInterrupt
        exit_interrupted(cfg)  # the second; the watcher normally gets here first

    def watch():
        deadline = None
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([r], [], [], wait)[0]:
                exit_interrupted(cfg)  # the clean stop is taking too long
            data = os.read(r, 64)
            if not data:  # the run is done: the write end was closed
                return os.close(r)
            for _ in range(data.count(bytes([signal.SIGINT]))):
                if deadline is not None:
                    exit_interrupted(cfg)
                STATE["stopping"], deadline = True, time.monotonic() + 15

    old_handler, old_fd = signal.signal(signal.SIGINT, on_sigint), signal.set_wakeup_fd(w)
    threading.Thread(target=watch, daemon=True, name="ctrl-c").start()

    def undo():
        signal.set_wakeup_fd(old_fd)
        signal.signal(signal.SIGINT, old_handler)
        os.close(w)
    return undo
