"""
ladder.py: the paper's Table 1 ablation ladder, in miniature, on dapo.py's carry task.

Each rung adds one DAPO technique to the one before, as in Table 1 of the paper:
naive GRPO -> + overlong filtering -> + Clip-Higher -> + soft overlong punishment
-> + token-level loss -> + dynamic sampling (= full DAPO). The task is `--task carry`: sums of
1 to 5 columns written out column by column (10 to 52 tokens), so that responses vary in length
and difficulty. One warm-started model (supervised, not DAPO) is the base of every rung and seed,
as one pretrained model is in the paper; the seeds vary the RL sampling (and the held-out set is
the carry task's fixed one), so the spread over seeds is the noise of RL alone.

    python tools/ladder.py                    # 6 rungs x 3 seeds (~1.5 hours on 2 CPU cores)
    python tools/ladder.py --report           # only rebuild the table and docs/ladder.png from runs/ladder
    python tools/ladder.py --print-commands   # the command lines, to run them elsewhere
    python tools/ladder.py --variants         # the objectives and knobs after DAPO; naive GRPO the reference
    python tools/ladder.py --real             # on a real model: SmolLM2-135M-Instruct (~80 minutes on 2 CPU cores)

--variants runs the objectives proposed after DAPO on DAPO's pipeline (every technique on, only
--loss or one knob differs), from the same warm-start, and reports them as the ladder does (docs/variants.png);
naive GRPO and DAPO are the ladder's first and last rungs, and use the same run folders: a --variants run
under the ladder's --root reuses those runs (docs/variants.md's naive GRPO row comes from runs of its own).

--real runs naive GRPO, GRPO + Clip-Higher alone (Figure 2's comparison: ε_high 0.28 against 0.2) and full
DAPO on tools/real_model.py's SmolLM2-135M-Instruct, on examples/fewshot_chain.py's running sums, with the
settings of REAL (fixed, the same for every rung); its report adds the entropy and the responses'
diversity by step (docs/real-model-ladder.png).

The report compares rungs per rollout step AND per generated response (dynamic sampling
generates more per step). matplotlib is optional: with it, --report also draws docs/ladder.png.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import dapo  # noqa: E402  (the carry task's settings and data)
from lib import demo_model  # noqa: E402  (the warm-start)
GRPO = ["--eps-high", "0.2", "--no-overlong-filtering", "--no-soft-overlong-punishment", "--no-token-level-loss",
        "--no-dynamic-sampling"]
RUNGS = [  # (name, paper's AIME24 avg@32 for Qwen2.5-32B, flags, run folder): each rung drops one GRPO flag pair
    ("naive GRPO", 30, GRPO, "rung0"),
    ("+ overlong filtering", 36, GRPO[:2] + GRPO[3:], "rung1"),
    ("+ Clip-Higher", 38, GRPO[3:], "rung2"),
    ("+ soft overlong punishment", 41, GRPO[4:], "rung3"),
    ("+ token-level loss", 42, GRPO[5:], "rung4"),
    ("+ dynamic sampling (DAPO)", 50, [], "rung5"),
]
VARIANTS = [RUNGS[0], ("DAPO", 50, [], "rung5"), ("GSPO", "-", ["--loss", "gspo"], "gspo"),
            ("CISPO", "-", ["--loss", "cispo"], "cispo"), ("Dr. GRPO", "-", ["--loss", "dr_grpo"], "dr_grpo"),
            ("SAPO", "-", ["--loss", "sapo"], "sapo"),
            ("DAPO + KL 0.001", "-", ["--kl-coef", "0.001"], "kl"),
            ("DAPO + top-20% entropy tokens", "-", ["--top-entropy-quantile", "0.2"], "entropy"),
            ("DAPO + sequence IS mask (cap 3)", "-", ["--tis-mode", "sequence_mask", "--tis-cap", "3"], "tis"),
            ("DPPO-Binary-TV", "-", ["--loss", "dppo_tv"], "dppo_tv"), ("DPPO-Binary-KL", "-", ["--loss", "dppo_kl"], "dppo_kl"),
            ("GMPO", "-", ["--loss", "gmpo"], "gmpo"),
            ("DAPO + carried surplus", "-", ["--carry-surplus"], "carry"),
            ("DAPO + carried surplus + skip solved (K 1)", "-", ["--carry-surplus", "--skip-solved", "1"], "carry_skip")]
# --real: Table 1's ends and Figure 2's pair on a real model (the rest of the ladder did not fit the budget).
REAL_RUNGS = [("naive GRPO", 30, GRPO, "grpo"), ("GRPO + Clip-Higher", "-", GRPO[2:], "clip_higher"),
              ("full DAPO", 50, [], "dapo")]
# --real's settings, fixed before any run, the same for every rung; the laptop preset (dapo.LAPTOP) gives
# the rest. Responses of up to 64 tokens (a correct 5-number one takes ~35), prompts of ~150; μ = 4 updates
# per rollout step (the paper's 16 would cost 4x the optimizer steps), so that the clip has ratios to bind;
# 10 steps (the entropy falls from ~0.5 to ~0.15 in 3), the held-out set at steps 0, 5 and 10.
REAL = dict(max_response_len=64, overlong_cache_len=16, num_mini_batches=4,
            steps=10, eval_every=5, eval_samples=4, eval_max_prompts=96)
REAL_MINUTES = 9  # one --real run on 2 CPU cores (an Intel Xeon, bf16: 8.1-10.0 minutes): the cost line says it
# Each variant's own statistic (the last-steps mean, in the report): what its flag does
OWN = ["kl/ref", "entropy/selected_frac", "tis/clipped_frac", "tis/clipped_seq_frac", "mismatch/kl_k1",
       "filter/carried", "filter/set_aside"]
SHORT, LONG = (1, 2, 3), (4, 5)  # the carry task's levels (columns): held-out split by difficulty
KEY = "eval/avg@4"


def base_model(args):
    if args.real:  # tools/real_model.py builds it once, into its cache, and prints its path
        out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "real_model.py")], check=True,
                             capture_output=True, text=True)
        return out.stdout.split()[-1]
    return os.path.join(args.root, "base")


def entries(args):
    return REAL_RUNGS if args.real else VARIANTS if args.variants else RUNGS


def run_dir(args, i, seed):
    return os.path.join(args.root, entries(args)[i][3], f"seed{seed}")


def settings(args):
    """The carry task's demo settings as flags (they apply only without --model), or --real's."""
    skip = {"out_dir", "demo_sft_target"}
    carry = REAL if args.real else {**dapo.CARRY, "steps": args.steps, "eval_every": args.eval_every}
    return [x for k, v in carry.items() if k not in skip for x in (f"--{k.replace('_', '-')}", str(v))]


def data_dir(args):
    return os.path.join(args.root, "data")


def commands(args):
    common, model = settings(args), base_model(args)
    data = ["--train-data", os.path.join(data_dir(args), "train.jsonl"), "--eval-data",
            os.path.join(data_dir(args), "eval.jsonl")] if args.real else ["--task", "carry"]
    for i, (name, _, flags, _) in enumerate(entries(args)):
        if i not in args.rungs:
            continue
        for seed in args.seeds:
            yield seed, [sys.executable, os.path.join(ROOT, "dapo.py"), *data, "--model", model, "--seed",
                         str(seed), *common, "--out-dir", run_dir(args, i, seed), *flags, *args.extra]


def parse_eval(stdout, tag):
    """The metrics of dapo.py's `eval (tag): name value name value ...` line."""
    line = next(x for x in stdout.splitlines() if x.startswith(f"eval ({tag}): "))
    words = line.split(": ", 1)[1].split()
    return {k: float(v) for k, v in zip(words[::2], words[1::2])}


def load(path):
    with open(os.path.join(path, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def split(evals, levels, counts):
    """avg@4 over the held-out problems of these levels, weighted by their number."""
    levels = [k for k in levels if k in counts]
    n = sum(counts[k] for k in levels)
    return sum(evals[f"{KEY}/d{k}"] * counts[k] for k in levels) / n


def mean_sd(xs):
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f} (1 seed)"


def curve(run):
    """[(rollout step, generated responses so far, eval metrics)], the "before" eval at step 0 and the
    "after" eval at the last step (in its metrics row, or apart in an older run's)."""
    out, done = [(0, 0, run["before"])], 0
    for r in run["metrics"]:
        done += r["gen/responses"]
        if KEY in r:
            out.append((r["step"], done, r))
    if KEY not in run["metrics"][-1]:
        out.append((run["metrics"][-1]["step"], done, run["after"]))
    return out


def waste(run, args):
    """Responses generated per trained group over the whole run: G = 8 when nothing is filtered away."""
    n = dapo.LAPTOP["prompts_per_step"] if args.real else dapo.CARRY["prompts_per_step"]
    return sum(m["gen/responses"] for m in run["metrics"]) / (len(run["metrics"]) * n)


def train_acc_at(run, lo, hi):
    """acc/mean (each step's prompts freshly drawn: the policy's accuracy on new problems) over the steps
    whose cumulative responses lie in (lo, hi], weighted by their responses: a comparison at an equal
    number of generated responses, where evaluations every few steps are too far apart."""
    done, acc, n = 0, 0.0, 0
    for m in run["metrics"]:
        done += m["gen/responses"]
        if lo < done <= hi:
            acc, n = acc + m["acc/mean"] * m["gen/responses"], n + m["gen/responses"]
    return acc / n if n else None


def first_reach(c, target):
    return next(((s, g) for s, g, e in c if e[KEY] >= target), (None, None))


def report(args):
    counts = {}
    held = [json.loads(x) for x in open(os.path.join(data_dir(args), "eval.jsonl"))] if args.real else \
        demo_model.demo_task(0, "carry")[1]
    for r in held:
        counts[r["level"]] = counts.get(r["level"], 0) + 1
    runs = {}  # rung index -> [run]
    for i in range(len(entries(args))):
        for seed in args.seeds:
            path = run_dir(args, i, seed)
            if not os.path.exists(os.path.join(path, "evals.json")):
                continue  # not run (or not finished) yet
            with open(os.path.join(path, "evals.json")) as f:
                run = json.load(f)
            run["metrics"] = load(path)
            runs.setdefault(i, []).append(run)
    if not runs:
        sys.exit(f"no finished run under {args.root}: run the ladder first")
    base = min(runs)  # naive GRPO, or the first rung of a subset: the reference to reach
    grpo_final = statistics.mean(r["after"][KEY] for r in runs[base])
    grpo_responses = statistics.mean(sum(m["gen/responses"] for m in r["metrics"]) for r in runs[base])
    last = lambda r, k: statistics.mean(m[k] for m in r["metrics"][-args.tail:])  # late-training mean
    name_of = lambda ls: f"d{min(ls)}" + (f"-d{max(ls)}" if max(ls) > min(ls) else "")  # noqa: E731
    short, long = ([k for k in ls if k in counts] for ls in (SHORT, LONG))
    table = [f"| rung | paper AIME24 | held-out avg@4 (mean ± sd) | short {name_of(short)} | long {name_of(long)} | "
             f"steps to {entries(args)[base][0]}'s final ({grpo_final:.3f}) | responses to it | at its responses | "
             f"entropy | truncated | kept | effective groups | responses/step | responses per trained group | s/step | "
             f"clip lo / hi |" + (" its own statistic |" if args.variants else "") +
             (" distinct responses | pass@4 | train acc at its responses |" if args.real else ""),
             "|" + "---|" * (16 + args.variants + 3 * args.real)]
    for i, rs in sorted(runs.items()):
        name, paper = entries(args)[i][:2]
        reach = [first_reach(curve(r), grpo_final) for r in rs]
        steps = [s for s, _ in reach if s is not None]
        gens = [g for _, g in reach if g is not None]
        # held-out accuracy at the last eval that had generated no more responses than GRPO's whole run
        same_budget = [[e[KEY] for s, g, e in curve(r) if g <= grpo_responses][-1] for r in rs]
        # the training accuracy over the second half of GRPO's responses (--real's evaluations are 5 steps apart)
        at_budget = [a for a in (train_acc_at(r, grpo_responses / 2, grpo_responses) for r in rs) if a is not None] \
            if args.real else []
        table.append(
            f"| {name} | {paper} | {mean_sd([r['after'][KEY] for r in rs])} "
            f"| {mean_sd([split(r['after'], SHORT, counts) for r in rs])} "
            f"| {mean_sd([split(r['after'], LONG, counts) for r in rs])} "
            f"| {f'{statistics.median(steps):g}' if steps else '-'} ({len(steps)}/{len(rs)}) "
            f"| {f'{statistics.median(gens):g}' if gens else '-'} | {statistics.mean(same_budget):.3f} "
            f"| {statistics.mean(last(r, 'entropy/generated') for r in rs):.3f} "
            f"| {100 * statistics.mean(last(r, 'len/truncated_frac') for r in rs):.2f}% "
            f"| {statistics.mean(last(r, 'filter/kept_frac') for r in rs):.2f} "
            f"| {statistics.mean(last(r, 'batch/effective_groups') for r in rs):.1f} "
            f"| {statistics.mean(last(r, 'gen/responses') for r in rs):.0f} "
            f"| {statistics.mean(waste(r, args) for r in rs):.2f} "
            f"| {statistics.mean(statistics.median(m['time/step'] for m in r['metrics']) for r in rs):.2f} "
            f"| {100 * statistics.mean(last(r, 'clip/low_frac') for r in rs):.3f}% / "
            f"{100 * statistics.mean(last(r, 'clip/high_frac') for r in rs):.3f}% |"
            + (" " + ", ".join(f"{k} {statistics.mean(last(r, k) for r in rs):.3g}" for k in OWN
                               if all(k in m for r in rs for m in r["metrics"][-args.tail:])) + " |"
               if args.variants else "")
            + (f" {statistics.mean(last(r, 'gen/distinct_frac') for r in rs):.2f} "
               f"| {mean_sd([r['after']['eval/pass@4'] for r in rs])} "
               f"| {mean_sd(at_budget) if at_budget else '-'} |"
               if args.real else ""))
    seeds = sorted({len(rs) for rs in runs.values()})
    print(f"{' or '.join(map(str, seeds))} seeds (a row with one says so); held-out avg@4 after the last step; per-step metrics are means over the "
          f"last {args.tail} rollout steps and the seeds; steps and responses to reach are medians over the seeds "
          f"that reached it (eval every {args.eval_every} steps).\n")
    print("\n".join(table))
    (plot_real if args.real else plot)(args, runs, counts)


def plot(args, runs, counts):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(pip install matplotlib for ladder.png)")
        return
    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    for i, rs in sorted(runs.items()):
        name = entries(args)[i][0]
        curves = [curve(r) for r in rs]
        n = min(len(c) for c in curves)
        mean = lambda f: [statistics.mean(f(c[j]) for c in curves) for j in range(n)]
        axes[0, 0].plot(mean(lambda p: p[0]), mean(lambda p: p[2][KEY]), marker="o", label=name)
        axes[0, 1].plot(mean(lambda p: p[1]), mean(lambda p: p[2][KEY]), marker="o", label=name)
        axes[0, 2].plot(mean(lambda p: p[0]), mean(lambda p: split(p[2], LONG, counts)), marker="o", label=name)
        steps = min(len(r["metrics"]) for r in rs)
        for ax, k in zip(axes[1], ("entropy/generated", "len/truncated_frac", "batch/effective_groups")):
            ax.plot(range(1, steps + 1), [statistics.mean(r["metrics"][j][k] for r in rs) for j in range(steps)],
                    label=name)
            ax.set_title(f"{k} (mean over seeds)")
            ax.set_xlabel("rollout step")
    for ax, title, x in zip(axes[0], ("held-out avg@4", "held-out avg@4 per generated response",
                                      "held-out avg@4, long problems (d4-d5)"),
                            ("rollout step", "generated responses", "rollout step")):
        ax.set_title(title)
        ax.set_xlabel(x)
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.png, dpi=70)
    print(f"wrote {args.png}")


def plot_real(args, runs, counts):
    """Figure 2 in miniature: per rung, the mean over seeds (a thick line; each seed a thin one) of the
    held-out accuracy by step and by generated response, pass@4, the entropy of the trained tokens and of
    every sampled token, and the share of distinct responses in a group."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(pip install matplotlib for the plot)")
        return
    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    colours = ["tab:red", "tab:orange", "tab:blue"]
    for i, rs in sorted(runs.items()):
        name, colour = entries(args)[i][0], colours[i % 3]
        curves = [curve(r) for r in rs]
        steps = min(len(r["metrics"]) for r in rs)
        mean = lambda f, cs: [statistics.mean(f(c[j]) for c in cs) for j in range(min(map(len, cs)))]  # noqa: E731
        for lw, alpha, group, label in [(2.5, 0.95, curves, name)] + [(0.8, 0.35, [c], None) for c in curves]:
            kw = dict(color=colour, linewidth=lw, alpha=alpha, label=label)
            axes[0, 0].plot(mean(lambda p: p[0], group), mean(lambda p: p[2][KEY], group), marker="o", **kw)
            axes[0, 1].plot(mean(lambda p: p[1], group), mean(lambda p: p[2][KEY], group), marker="o", **kw)
            axes[0, 2].plot(mean(lambda p: p[0], group), mean(lambda p: p[2]["eval/pass@4"], group), marker="s", **kw)
        for ax, k in zip(axes[1], ("entropy", "entropy/generated", "gen/distinct_frac")):
            ax.plot(range(1, steps + 1), [statistics.mean(r["metrics"][j][k] for r in rs) for j in range(steps)],
                    color=colour, linewidth=2.5, label=name)
            for r in rs:
                ax.plot([m["step"] for m in r["metrics"]], [m[k] for m in r["metrics"]], color=colour,
                        linewidth=0.8, alpha=0.35)
    titles = [("held-out avg@4", "rollout step"), ("held-out avg@4", "generated responses"),
              ("held-out pass@4", "rollout step"), ("entropy of the trained tokens (`entropy`)", "rollout step"),
              ("mean -log p of every sampled token (`entropy/generated`)", "rollout step"),
              ("distinct responses in a group (`gen/distinct_frac`)", "rollout step")]
    for ax, (title, x) in zip(axes.flat, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(x)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M-Instruct on running sums, {len(next(iter(runs.values())))} seeds a rung (thick: "
                 f"their mean; thin: each seed)")
    fig.tight_layout()
    fig.savefig(args.png, dpi=70)
    print(f"wrote {args.png}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rungs", type=int, nargs="+", help="a subset, by index (default: all)")
    p.add_argument("--variants", action="store_true", help="the --loss variants instead of the rungs")
    p.add_argument("--real", action="store_true", help="naive GRPO, + Clip-Higher, DAPO on a real model (REAL)")
    p.add_argument("--steps", type=int, default=75)
    p.add_argument("--eval-every", type=int, default=15)
    p.add_argument("--tail", type=int, default=25, help="rollout steps averaged for the per-step metrics")
    p.add_argument("--root", default=os.path.join(ROOT, "runs", "ladder"))
    p.add_argument("--png", help="where --report draws the curves (default: docs/ladder.png, docs/variants.png)")
    p.add_argument("--report", action="store_true")
    p.add_argument("--print-commands", action="store_true")
    p.add_argument("extra", nargs="*", help="more dapo.py flags for every rung (after --)")
    args = p.parse_args()
    if args.real:  # its own folder, and its report's late-training means over the second half of its steps
        args.root = os.path.join(ROOT, "runs", "real-ladder") if args.root == p.get_default("root") else args.root
        args.eval_every, args.tail = REAL["eval_every"], min(args.tail, REAL["steps"] // 2)
    args.rungs = range(len(entries(args))) if args.rungs is None else args.rungs
    args.png = args.png or os.path.join(ROOT, "docs", "real-model-ladder.png" if args.real else
                                        "variants.png" if args.variants else "ladder.png")
    if args.print_commands:
        for _, c in commands(args):
            print(" ".join(["python"] + c[1:]))
        return
    if not args.report:
        if args.real:
            subprocess.run([sys.executable, os.path.join(ROOT, "examples", "fewshot_chain.py"), data_dir(args)],
                           check=True)
            todo = [c for _, c in commands(args) if not os.path.exists(os.path.join(c[c.index("--out-dir") + 1],
                                                                                     "evals.json"))]
            print(f"{len(todo)} runs to go ({len(args.rungs)} rungs x {len(args.seeds)} seeds, finished ones "
                  f"skipped), ~{REAL_MINUTES} minutes each on 2 CPU cores: ~{len(todo) * REAL_MINUTES} minutes",
                  flush=True)
        elif not os.path.exists(os.path.join(base_model(args), "config.json")):
            rows, sft_target = demo_model.demo_task(0, "carry")[0], dapo.CARRY["demo_sft_target"]
            info = demo_model.build(base_model(args), rows, demo_model.DEMO_TOKENS, 0, sft_target, "carry")
            print(f"warm-start (not DAPO): {info}", flush=True)
        for seed, c in commands(args):
            out_dir = c[c.index("--out-dir") + 1]
            if os.path.exists(os.path.join(out_dir, "evals.json")):
                continue  # done already: the ladder can be stopped and restarted
            print(" ".join(["python"] + c[1:]), flush=True)
            os.makedirs(out_dir, exist_ok=True)
            r = subprocess.run(c, capture_output=True, text=True, cwd=ROOT)
            with open(os.path.join(out_dir, "stdout.txt"), "w") as f:
                f.write(r.stdout + r.stderr[-5000:])
            if r.returncode:
                sys.exit(f"failed: {' '.join(c)}\n{r.stderr[-2000:]}")
            with open(os.path.join(out_dir, "evals.json"), "w") as f:
                json.dump({tag: parse_eval(r.stdout, tag) for tag in ("before", "after")}, f)
    report(args)


if __name__ == "__main__":
    main()
