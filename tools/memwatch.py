"""
memwatch.py: the memory of a command and of every process it starts (Linux), sampled from /proc every 0.2 s by a
thread: the peak of their sum, what each process held at that moment, and each one's own peak.

A process's memory here is its PSS: its anonymous pages (tensors, the heap: /proc/PID/status's RssAnon, read at
every sample) plus its share of the file-backed and shared-memory pages it maps (smaps_rollup's Pss_File and
Pss_Shmem: a page that k processes map counts 1/k in each, so a library they all map counts once, where a sum of
RSS would count it k times). smaps_rollup walks the page tables (~60 ms for a 7 GB trainer on 2 CPU cores), so it
is read once per process every 5 s; RssAnon, what moves fast, costs microseconds. Anonymous pages that processes
share (forked without exec; reward.py starts its workers afresh) would count once per process. tools/showcase.py
runs the showcase under it; alone it wraps any command:

    python tools/memwatch.py -- python dapo.py --model ...       # the command, then its memory
    python tools/memwatch.py --json mem.json -- python dapo.py   # and every sample, for a timeline
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

FIELDS = ("Pss", "Anon", "Files", "Shmem", "Rss")  # kB (KiB, as /proc counts): Pss = Anon + Files + Shmem
# Processes named by what they run, before the script's name: reward.py's checker workers run `python -c`.
NAMES = (("reward._worker_main", "reward worker"), ("compile_worker", "torch compile worker"))


def children_of(proc="/proc"):
    """{parent pid: [child pids]} of every process now."""
    out = {}
    for d in os.listdir(proc):
        if d.isdigit():
            try:
                with open(os.path.join(proc, d, "stat")) as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # the name, in (), may hold spaces
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
            out.setdefault(ppid, []).append(int(d))
    return out


def tree(root, proc="/proc"):
    """root and all its descendants, root first."""
    kids, out, todo = children_of(proc), [], [root]
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo += sorted(kids.get(pid, []))
    return out


def name_of(pid, proc="/proc"):
    """A short name: a NAMES entry found in the command line, else the script's file name, else the program's."""
    try:
        with open(os.path.join(proc, str(pid), "cmdline"), "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return "?"
    line = " ".join(argv)
    for mark, name in NAMES:
        if mark in line:
            return name
    scripts = [a for a in argv[1:] if a.endswith(".py")]
    return os.path.basename(scripts[0] if scripts else argv[0] if argv else "?")


def read_kb(path, keys):
    """{key: kB} of the "Key:   123 kB" lines of a /proc file, or None if it is gone or lacks a key."""
    try:
        with open(path) as f:
            rows = dict(line.split(":", 1) for line in f if ":" in line)
        return {k: int(rows[k].split()[0]) for k in keys}
    except (OSError, KeyError, ValueError):  # gone, or a zombie (no memory left to read)
        return None


def memory_of(pid, proc="/proc", shared=None):
    """FIELDS of one process in kB, or None if it is gone. shared: its last (Pss_File, Pss_Shmem) and when they
    were read, a dict the caller keeps; they are read again when older than 5 s (None: always)."""
    status = read_kb(os.path.join(proc, str(pid), "status"), ("RssAnon", "VmRSS"))
    if status is None:
        return None
    last = shared.get(pid) if shared is not None else None
    if last is None or time.monotonic() - last[0] > 5.0:
        rollup = read_kb(os.path.join(proc, str(pid), "smaps_rollup"), ("Pss_File", "Pss_Shmem"))
        if rollup is None:
            return None
        last = (time.monotonic(), rollup["Pss_File"], rollup["Pss_Shmem"])
        if shared is not None:
            shared[pid] = last
    anon, files, shmem = status["RssAnon"], last[1], last[2]
    return {"Pss": anon + files + shmem, "Anon": anon, "Files": files, "Shmem": shmem, "Rss": status["VmRSS"]}


def snapshot(root, proc="/proc", cache=None):
    """{pid: {"name": ..., FIELDS...}} for root's tree now. cache: what the calls keep between samples (each
    pid's name and shared pages)."""
    cache = {"names": {}, "shared": {}} if cache is None else cache
    out = {}
    for pid in tree(root, proc):
        mem = memory_of(pid, proc, cache["shared"])
        if mem is not None:
            out[pid] = {"name": cache["names"].setdefault(pid, name_of(pid, proc)), **mem}
    return out


def watch(root, stop, samples, every=0.2, proc="/proc"):
    """Append (time.monotonic(), snapshot) to samples every `every` s until stop is set or root is gone.
    Run it in a thread."""
    cache = {"names": {}, "shared": {}}
    while not stop.is_set():
        snap = snapshot(root, proc, cache)
        if root not in snap:
            return
        samples.append((time.monotonic(), snap))
        stop.wait(every)


def peaks(samples):
    """The peak of the summed PSS and what each process held then; each name's own peak (of the PSS and of
    the RSS summed over the processes of that name at one moment: two reward workers, or one and its
    replacement, are not counted as more than ever lived at once).
    {"sum_kb", "t", "at_peak": {pid: row}, "own": {name: {"Pss", "Rss"}}}, or None without samples."""
    if not samples:
        return None
    t, snap = max(samples, key=lambda s: sum(p["Pss"] for p in s[1].values()))
    own = {}
    for _, s in samples:
        for name, _, tot in by_name(s):
            o = own.setdefault(name, {"Pss": 0, "Rss": 0})
            o["Pss"], o["Rss"] = max(o["Pss"], tot["Pss"]), max(o["Rss"], tot["Rss"])
    return {"sum_kb": sum(p["Pss"] for p in snap.values()), "t": t, "at_peak": snap, "own": own}


def by_name(rows):
    """Rows of processes with the same name summed, largest first: [(name, count, {field: kB})]."""
    out = {}
    for p in rows.values():
        n, tot = out.get(p["name"], (0, {}))
        out[p["name"]] = (n + 1, {k: tot.get(k, 0) + p.get(k, 0) for k in FIELDS})
    return sorted(((k, n, tot) for k, (n, tot) in out.items()), key=lambda r: -r[2]["Pss"])


def gb(kb):
    """/proc's kB (KiB) in GB (1e9 bytes, as dapo.py's mem/peak_rss_gb)."""
    return kb * 1024 / 1e9


def table(samples, start=0.0, where=""):
    """The report's lines: the peak of the sum (its seconds after start; where: the phase it fell in), then
    per process at that moment."""
    p = peaks(samples)
    if p is None:
        return ["memory: no samples"]
    where = f", in the {where}" if where else ""
    lines = [f"peak of all processes' memory (PSS): {gb(p['sum_kb']):.2f} GB, {p['t'] - start:.0f} s in{where}; "
             f"at that moment:",
             f"  {'process':<22} {'PSS':>8} {'anon':>8} {'files':>8} {'shmem':>8} {'own peak':>9}  (GB)"]
    for name, n, tot in by_name(p["at_peak"]):
        label = f"{name} x{n}" if n > 1 else name
        lines.append(f"  {label:<22} " + " ".join(f"{gb(tot[k]):8.2f}" for k in FIELDS[:4])
                     + f" {gb(p['own'][name]['Pss']):9.2f}")
    return lines


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0],
                                usage="python tools/memwatch.py [--json FILE] -- COMMAND ...")
    p.add_argument("--json", help="write every sample here: [[seconds from the start, {pid: row}], ...]")
    args, cmd = p.parse_args(argv[:cut]), argv[cut + 1:]
    if not cmd:
        p.error("no command after --")
    t0, samples, stop = time.monotonic(), [], threading.Event()
    child = subprocess.Popen(cmd)
    thread = threading.Thread(target=watch, args=(child.pid, stop, samples), daemon=True)
    thread.start()
    code = child.wait()
    stop.set()
    thread.join()
    print("\n".join(table(samples, t0)), file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([(t - t0, snap) for t, snap in samples], f)
    sys.exit(code)


if __name__ == "__main__":
    main()
