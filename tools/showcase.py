"""
showcase.py: the laptop showcase on several seeds. tools/real_model.py's SmolLM2-135M-Instruct learns
examples/fewshot_addition.py's 2-digit sums with dapo.py's laptop preset: the README's command, once per
seed. Then the report (held-out avg@4 before -> after, minutes, a step's time split, the memory of all the run's
processes at its peak, the bytes pushed into vLLM per step) and docs/real-model.png (held-out and training accuracy
by step; needs matplotlib). The memory is tools/memwatch.py's, sampled every 0.2 s while each run goes, and
told by phase: start-up, generation and scoring, the update, the weight sync, evaluation, the final checkpoint.

    python tools/showcase.py                           # seeds 0 1 2 (~15 minutes on 2 CPU cores)
    python tools/showcase.py --report                  # the report and the plot only, from runs/showcase
    python tools/showcase.py --seeds 0 --tag bf16 -- --precision bf16   # dapo.py flags after --
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import memwatch  # noqa: E402  (tools/memwatch.py)
KEY = "eval/avg@4"


def run_dir(args, seed):
    return os.path.join(args.root, f"{args.tag}-seed{seed}")


def run(args):
    """The README's command for each seed; its stdout, the wall time and the evaluations go in its folder."""
    data = os.path.join(args.root, "data")
    subprocess.run([sys.executable, os.path.join(ROOT, "examples", "fewshot_addition.py"), data], check=True)
    model = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "real_model.py")], check=True,
                           capture_output=True, text=True).stdout.split()[-1]
    for seed in args.seeds:
        out = run_dir(args, seed)
        cmd = [sys.executable, os.path.join(ROOT, "dapo.py"), "--model", model, "--train-data",
               os.path.join(data, "train.jsonl"), "--eval-data", os.path.join(data, "eval.jsonl"), "--seed",
               str(seed), "--out-dir", out, *args.extra]
        print(" ".join(cmd), flush=True)
        os.makedirs(out, exist_ok=True)
        code, wall, lines, samples = watched(cmd, os.path.join(out, "stderr.txt"))
        stdout, stderr = "".join(line for _, line in lines), open(os.path.join(out, "stderr.txt")).read()
        with open(os.path.join(out, "stdout.txt"), "w") as f:
            f.write(stdout + stderr[-5000:])
        if code:
            sys.exit(f"seed {seed} failed (exit {code}): {stderr[-2000:]}")
        evals = {m.group(1): dict(zip(m.group(2).split()[::2], map(float, m.group(2).split()[1::2])))
                 for m in re.finditer(r"^eval \((.*?)\): (.*)$", stdout, re.M)}
        with open(os.path.join(out, "evals.json"), "w") as f:
            json.dump({"wall_s": wall, "evals": evals}, f)
        with open(os.path.join(out, "memory.json"), "w") as f:  # every sample, and when each line came
            json.dump({"lines": lines, "samples": samples, "end": wall}, f)


def watched(cmd, stderr_path):
    """Run cmd with its process tree's memory sampled (tools/memwatch.py) and the time each stdout line arrived.
    Returns (exit code, wall seconds, [(seconds, line)], [(seconds, memwatch snapshot)]), times from the start."""
    t0, samples, stop = time.monotonic(), [], threading.Event()
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1,  # each line as
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})  # printed: the lines time the phases
        thread = threading.Thread(target=memwatch.watch, args=(proc.pid, stop, samples), daemon=True)
        thread.start()
        lines = [(time.monotonic() - t0, line) for line in proc.stdout]
        code = proc.wait()
    wall = time.monotonic() - t0
    stop.set()
    thread.join()
    return code, wall, lines, [(t - t0, snap) for t, snap in samples]


def phases(lines, metrics, end):
    """[(start, stop, name, step or None)] of a run, in seconds from its start, from when its stdout lines came
    and its metrics: a step starts at the line of the evaluation before training (the first) or of the step before;
    generation and scoring, the update and the weight sync follow for the seconds its metrics give; then
    evaluation (on steps that evaluate) and the logs, up to its own line. After the last: checkpoint and exit."""
    steps = [t for t, line in lines if re.match(r"step +\d+ ", line)]
    before = [t for t, line in lines if line.startswith("eval (before)")]
    if not steps or len(steps) != len(metrics):
        return []
    start = before[0] if before else steps[0] - metrics[0]["time/step"]
    out = [(0.0, start, "start-up" + (", evaluation before" if before else ""), None)]
    for t, m in zip(steps, metrics):
        gen = start + m["time/step"] - m["time/update"] - m["time/sync"]
        out += [(start, gen, "generation + scoring", m["step"]), (gen, gen + m["time/update"], "update", m["step"]),
                (gen + m["time/update"], start + m["time/step"], "weight sync", m["step"]),
                (start + m["time/step"], t, "evaluation, logs", m["step"])]
        start = t
    return out + [(start, end, "checkpoint, exit", None)]


def phase_peaks(samples, spans):
    """{phase name: (peak summed PSS in kB, its time)} over every span of that name."""
    out = {}
    for start, stop, name, _ in spans:
        for t, snap in samples:
            if start <= t < stop:
                total = sum(p["Pss"] for p in snap.values())
                if total > out.get(name, (-1, 0))[0]:
                    out[name] = (total, t)
    return out


def load(args, seed):
    path = run_dir(args, seed)
    if not os.path.exists(os.path.join(path, "evals.json")):
        return None
    with open(os.path.join(path, "evals.json")) as f:
        out = json.load(f)
    with open(os.path.join(path, "metrics.jsonl")) as f:
        out["metrics"] = [json.loads(line) for line in f]
    steps = out["metrics"][-1]["step"]
    out["curve"] = [(0 if tag == "before" else steps if tag == "after" else int(tag.split()[1]), e[KEY])
                    for tag, e in out["evals"].items()]
    if os.path.exists(os.path.join(path, "memory.json")):  # runs of an earlier showcase.py have none
        with open(os.path.join(path, "memory.json")) as f:
            out["memory"] = json.load(f)
    return out


def memory_lines(r):
    """The memory of a run's processes: the peak of the sum, in which phase, who held what then, and each
    phase's own peak."""
    mem = r["memory"]
    spans = phases(mem["lines"], r["metrics"], mem["end"])
    p = memwatch.peaks(mem["samples"])
    where = [name + (f" of step {step}" if step else "") for start, stop, name, step in spans if start <= p["t"] < stop]
    peaks = phase_peaks(mem["samples"], spans)
    return memwatch.table(mem["samples"], 0.0, where[0] if where else "") + [
        "  each phase's peak (GB): " + ", ".join(f"{name} {memwatch.gb(kb):.2f}" for name, (kb, _) in peaks.items())]


def report(args):
    runs = {s: r for s in args.seeds if (r := load(args, s))}
    if not runs:
        sys.exit(f"no finished run under {args.root}: run the showcase first")
    print(f"| seed | held-out avg@4 before -> after | gain | training (sum of steps) | whole command | "
          f"median step: generation + scoring / update / sync | peak memory, all processes (PSS) | "
          f"trainer's peak RSS | synced per step |\n|---|---|---|---|---|---|---|---|---|")
    for seed, r in runs.items():
        m, e = r["metrics"], r["evals"]
        med = lambda k: statistics.median(x[k] for x in m)  # noqa: E731
        peak = memwatch.peaks(r["memory"]["samples"]) if "memory" in r else None
        peak = f"{memwatch.gb(peak['sum_kb']):.2f} GB" if peak else "not sampled"
        print(f"| {seed} | {e['before'][KEY]:.3f} -> {e['after'][KEY]:.3f} | "
              f"{100 * (e['after'][KEY] - e['before'][KEY]):+.1f} pts | {sum(x['time/step'] for x in m) / 60:.1f} min "
              f"({len(m)} steps) | {r['wall_s'] / 60:.1f} min | {med('time/step'):.1f} s: "
              f"{med('time/rollout') + med('time/reward'):.1f} / {med('time/update'):.1f} / {med('time/sync'):.2f} s | "
              f"{peak} | "
              f"{max(x.get('mem/peak_rss_gb', 0) for x in m):.1f} GB | "
              f"{med('sync/bytes') / 1e6 if 'sync/bytes' in m[0] else 0:.0f} MB |")
    for seed, r in runs.items():
        if "memory" in r:
            print(f"\nseed {seed}: " + "\n".join(memory_lines(r)))
    plot(args, runs)


def plot(args, runs):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(pip install matplotlib for the plot)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for seed, r in runs.items():
        axes[0].plot(*zip(*r["curve"]), marker="o", label=f"seed {seed}")
        axes[1].plot([x["step"] for x in r["metrics"]], [x["acc/mean"] for x in r["metrics"]], marker=".",
                     label=f"seed {seed}")
    for ax, title in zip(axes, ("held-out avg@4 (64 prompts x 4)", "training accuracy (acc/mean, all responses)")):
        ax.set_title(title)
        ax.set_xlabel("rollout step")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=70)
    print(f"wrote {args.png}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--root", default=os.path.join(ROOT, "runs", "showcase"), help="where the runs go")
    p.add_argument("--tag", default="laptop", help="the runs' name: <tag>-seed<N> (default: laptop)")
    p.add_argument("--report", action="store_true", help="only the report and the plot, from finished runs")
    p.add_argument("--png", default=os.path.join(ROOT, "docs", "real-model.png"))
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.extra = extra
    if not args.report:
        run(args)
    report(args)


if __name__ == "__main__":
    main()
