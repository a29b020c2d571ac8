"""
ladder.py: the paper's Table 1 ablation ladder on dapo.py's built-in task.

Each rung adds one DAPO technique to the one before, exactly as in Table 1 of the paper:
naive GRPO -> + overlong filtering -> + Clip-Higher -> + soft overlong punishment
-> + token-level loss -> + dynamic sampling (= full DAPO). Every rung runs the same number of
rollout steps for each seed; the table gives the held-out avg@4 at the end (mean and spread over
seeds) and the gradient steps needed to first reach a fixed held-out accuracy.

    python ladder.py                       # 6 rungs x 3 seeds x 120 steps (~1 hour on 2 CPU cores)
    python ladder.py --report              # only rebuild the table (and ladder.png) from runs/ladder
    python ladder.py --print-commands      # the command lines, to run them elsewhere

matplotlib is optional: with it, --report also draws entropy and response-length curves.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

GRPO = ["--eps-high", "0.2", "--no-overlong-filtering", "--no-soft-overlong-punishment", "--no-token-level-loss",
        "--no-dynamic-sampling"]
RUNGS = [  # (name, paper's AIME24 avg@32 for Qwen2.5-32B, flags): each rung drops one GRPO flag pair
    ("naive GRPO", 30, GRPO),
    ("+ overlong filtering", 36, GRPO[:2] + GRPO[3:]),
    ("+ Clip-Higher", 38, GRPO[3:]),
    ("+ soft overlong punishment", 41, GRPO[4:]),
    ("+ token-level loss", 42, GRPO[5:]),
    ("+ dynamic sampling (DAPO)", 50, []),
]


def run_dir(root, i, seed):
    return os.path.join(root, f"rung{i}", f"seed{seed}")


def commands(args):
    for i, (name, _, flags) in enumerate(RUNGS):
        for seed in args.seeds:
            yield [sys.executable, "dapo.py", "--seed", str(seed), "--steps", str(args.steps), "--eval-every",
                   str(args.eval_every), "--out-dir", run_dir(args.root, i, seed), *flags]


def load(path):
    with open(os.path.join(path, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def report(args):
    key, rows, curves = "eval/avg@4", [], {}
    for i, (name, paper, _) in enumerate(RUNGS):
        finals, reach, before = [], [], []
        for seed in args.seeds:
            path = run_dir(args.root, i, seed)
            if not os.path.exists(os.path.join(path, "stdout.txt")):  # not run (or not finished) yet
                continue
            m = load(path)
            out = open(os.path.join(path, "stdout.txt")).read()
            before.append(float(re.search(r"eval \(before\): eval/avg@4 ([\d.]+)", out).group(1)))
            finals.append(float(re.search(r"eval \(after\): eval/avg@4 ([\d.]+)", out).group(1)))
            evals = [(r["step"], r[key]) for r in m if key in r] + [(m[-1]["step"], finals[-1])]
            hit = next((s for s, v in evals if v >= args.threshold), None)
            reach.append(hit * json.load(open(os.path.join(path, "run.json")))["config"]["num_mini_batches"]
                         if hit else None)
            curves.setdefault(name, []).append(m)
        if not finals:
            continue
        spread = statistics.stdev(finals) if len(finals) > 1 else 0.0
        hits = [r for r in reach if r is not None]
        rows.append(f"| {name} | {paper} | {statistics.mean(before):.3f} | {statistics.mean(finals):.3f} ± {spread:.3f} "
                    f"| {', '.join(f'{x:.2f}' for x in finals)} | "
                    f"{statistics.median(hits) if hits else '-'} ({len(hits)}/{len(reach)} seeds) |")
    table = ["| rung | paper AIME24 avg@32 | held-out avg@4 before | after (mean ± sd) | per seed | "
             f"gradient steps to avg@4 ≥ {args.threshold} (median) |", "|---|---|---|---|---|---|"] + rows
    print("\n".join(table))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(pip install matplotlib for ladder.png)")
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, runs in curves.items():
        for ax, k in zip(axes, ("acc/mean", "entropy", "len/mean")):
            steps = [r["step"] for r in runs[0]]
            mean = [statistics.mean(r[j][k] for r in runs) for j in range(min(len(r) for r in runs))]
            ax.plot(steps[:len(mean)], mean, label=name)
            ax.set_title(f"{k} (mean over seeds)")
            ax.set_xlabel("rollout step")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig("ladder.png", dpi=80)
    print("wrote ladder.png")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--threshold", type=float, default=0.40, help="held-out avg@4 to reach")
    p.add_argument("--root", default="runs/ladder")
    p.add_argument("--report", action="store_true")
    p.add_argument("--print-commands", action="store_true")
    args = p.parse_args()
    if args.print_commands:
        for c in commands(args):
            print(" ".join(["python"] + c[1:]))
        return
    if not args.report:
        for c in commands(args):
            out_dir = c[c.index("--out-dir") + 1]
            if os.path.exists(os.path.join(out_dir, "stdout.txt")):
                continue  # done already: the ladder can be stopped and restarted
            print(" ".join(["python"] + c[1:]), flush=True)
            os.makedirs(out_dir, exist_ok=True)
            r = subprocess.run(c, capture_output=True, text=True)
            if r.returncode:
                sys.exit(f"failed: {' '.join(c)}\n{r.stderr[-2000:]}")
            with open(os.path.join(out_dir, "stdout.txt"), "w") as f:
                f.write(r.stdout)
    report(args)


if __name__ == "__main__":
    main()
