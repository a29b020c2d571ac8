"""
showcase.py: the laptop showcase on several seeds. tools/real_model.py's SmolLM2-135M-Instruct learns
examples/fewshot_addition.py's 2-digit sums with dapo.py's laptop preset: the README's command, once per
seed. Then the report (held-out avg@4 before -> after, minutes, a step's time split, peak RSS, the bytes
pushed into vLLM per step) and docs/real-model.png (held-out and training accuracy by step; needs matplotlib).

    python tools/showcase.py                           # seeds 0 1 2 (~45 minutes on 2 CPU cores)
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
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
        t0 = time.monotonic()
        r = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.monotonic() - t0
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "stdout.txt"), "w") as f:
            f.write(r.stdout + r.stderr[-5000:])
        if r.returncode:
            sys.exit(f"seed {seed} failed (exit {r.returncode}): {r.stderr[-2000:]}")
        evals = {m.group(1): dict(zip(m.group(2).split()[::2], map(float, m.group(2).split()[1::2])))
                 for m in re.finditer(r"^eval \((.*?)\): (.*)$", r.stdout, re.M)}
        with open(os.path.join(out, "evals.json"), "w") as f:
            json.dump({"wall_s": wall, "evals": evals}, f)


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
    return out


def report(args):
    runs = {s: r for s in args.seeds if (r := load(args, s))}
    if not runs:
        sys.exit(f"no finished run under {args.root}: run the showcase first")
    print(f"| seed | held-out avg@4 before -> after | gain | training (sum of steps) | whole command | "
          f"median step: generation + scoring / update / sync | peak RSS | synced per step |\n"
          f"|---|---|---|---|---|---|---|---|")
    for seed, r in runs.items():
        m, e = r["metrics"], r["evals"]
        med = lambda k: statistics.median(x[k] for x in m)  # noqa: E731
        print(f"| {seed} | {e['before'][KEY]:.3f} -> {e['after'][KEY]:.3f} | "
              f"{100 * (e['after'][KEY] - e['before'][KEY]):+.1f} pts | {sum(x['time/step'] for x in m) / 60:.1f} min "
              f"({len(m)} steps) | {r['wall_s'] / 60:.1f} min | {med('time/step'):.1f} s: "
              f"{med('time/rollout') + med('time/reward'):.1f} / {med('time/update'):.1f} / {med('time/sync'):.2f} s | "
              f"{max(x.get('mem/peak_rss_gb', 0) for x in m):.1f} GB | {med('sync/bytes') / 1e6 if 'sync/bytes' in m[0] else 0:.0f} MB |")
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
