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
    python tools/ladder.py --real             # Table 1 and Figure 2 on SmolLM2-135M (28 runs, ~4 hours, 2 cores)
    python tools/ladder.py --real --report    # only rebuild its tables and plots from docs/real-model-runs

--variants runs the objectives proposed after DAPO on DAPO's pipeline (every technique on, only
--loss or one knob differs), from the same warm-start, and reports them as the ladder does (docs/variants.png);
naive GRPO and DAPO are the ladder's first and last rungs, and use the same run folders: a --variants run
under the ladder's --root reuses those runs (docs/variants.md's naive GRPO row comes from runs of its own).

--real runs, on tools/real_model.py's SmolLM2-135M-Instruct and examples/fewshot_chain.py's running sums, with
the settings of REAL (fixed, the same for every run): Table 1's six rows (3 seeds, 10 steps); GRPO + Clip-Higher
alone (naive GRPO with ε_high 0.28: Figure 2's pair without dynamic sampling, apart from Table 1); and Figure 2
with a full batch on both sides, DAPO against DAPO with ε_high 0.2 (5 seeds, 20 steps), whose DAPO arm also
gives Table 1's DAPO row at step 10. It prints the cost first, skips finished runs, and copies each finished
run's small records (RECORDS, not its checkpoints) into docs/real-model-runs/<rung>/seed<k>/, from which
--report alone builds the tables and docs/real-model-ladder.png and docs/real-model-figure2.png.

The report compares rungs per rollout step AND per generated response (dynamic sampling
generates more per step). matplotlib is optional: with it, --report also draws docs/ladder.png.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter

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
# --real: Table 1's six rows on a real model (the miniature rungs' flag pairs), and Clip-Higher alone (naive GRPO
# with ε_high 0.28, without overlong filtering): Figure 2's pair without dynamic sampling, kept apart from Table 1.
REAL_RUNGS = [(name, paper, flags, folder) for (name, paper, flags, _), folder in zip(RUNGS, (
    "grpo", "overlong_filtering", "plus_clip_higher", "soft_overlong", "token_level", "dapo"))]
CLIP_ALONE = ("GRPO + Clip-Higher", "-", GRPO[2:], "clip_higher")
# --real's settings, fixed before any run, the same for every rung; the laptop preset (dapo.LAPTOP) gives
# the rest. Responses of up to 64 tokens (a correct 5-number one takes ~35), prompts of ~150; μ = 4 updates
# per rollout step (the paper's 16 would cost 4x the optimizer steps), so that the clip has ratios to bind;
# 10 steps (the entropy falls from ~0.5 to ~0.15 in 3), the held-out set at steps 0, 5 and 10. A KV cache
# of 2 GiB: the preset's is sized for the showcase's shorter prompts and responses, and a smaller one would
# change the generation's schedule, so its samples (the ladder's runs in docs/ had 2 GiB).
REAL = dict(max_response_len=64, overlong_cache_len=16, num_mini_batches=4,
            steps=10, eval_every=5, eval_samples=4, eval_max_prompts=96, cpu_kv_cache_gb=2.0)
REAL_SEEDS = (0, 1, 2)
# Figure 2 with a full batch on both sides: DAPO against DAPO with ε_high 0.2, everything else equal, with REAL's
# settings but twice the steps (the held-out set every 5), 5 seeds. Table 1's DAPO row is its DAPO arm's seeds
# 0-2 read at step 10: a run's first 10 steps do not depend on its length (the lr is constant after the warm-up,
# every draw is keyed by the seed and the step), only the step-10 evaluation's samples differ (keyed by its tag,
# `step 10` instead of `after`).
FIGURE2_ARMS = [("DAPO (ε_high 0.28)", [], "dapo"),  # (name, flags, run folder)
                ("DAPO with ε_high 0.2", ["--eps-high", "0.2"], "dapo_eps_high_0.2")]
FIGURE2 = dict(REAL, steps=20)
FIGURE2_SEEDS = (0, 1, 2, 3, 4)
# dapo.py saves a checkpoint after the last step whatever --save-every says (~1.9 GB for SmolLM2-135M: fp32 weights
# and AdamW state, and the bf16 export): none before it, one kept, deleted once the run's records are copied.
DISK = ["--save-every", "0", "--keep-checkpoints", "1"]
# What a finished run leaves in the tracked folder (--records): its metrics by step (the held-out evaluations in
# them), run.json (config, versions, git commit), the screen's output, the ladder's own record (minutes taken).
RECORDS = ("metrics.jsonl", "run.json", "stdout.txt", "ladder.json")
# Minutes a --real run takes on 2 CPU cores, by (steps, dynamic sampling): the cost line's estimate until runs of
# that kind have finished (then their mean). Before the shared-prefix forward, 10 steps without dynamic sampling
# took 8.1-9.0 minutes and 10 DAPO steps 9.1-10.0 (2 cores of an Intel Xeon, bf16); with it a ladder step is
# ~1.5x faster (docs/throughput.md): ~6 minutes, and ~11.5 for 20 DAPO steps with five evaluations.
REAL_MINUTES = {(10, False): 6.0, (20, True): 11.5}
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
    return VARIANTS if args.variants else RUNGS


def run_dir(args, i, seed):
    return os.path.join(args.root, entries(args)[i][3], f"seed{seed}")


def as_flags(settings):
    """dapo.py's flags for a dict of settings."""
    skip = {"out_dir", "demo_sft_target"}
    return [x for k, v in settings.items() if k not in skip for x in (f"--{k.replace('_', '-')}", str(v))]


def data_dir(args):
    return os.path.join(args.root, "data")


def commands(args):
    """The miniature ladder's (or --variants') runs, as (seed, command): the carry task's demo settings."""
    common, model = as_flags({**dapo.CARRY, "steps": args.steps, "eval_every": args.eval_every}), base_model(args)
    for i, (name, _, flags, _) in enumerate(entries(args)):
        if i not in args.rungs:
            continue
        for seed in args.seeds:
            yield seed, [sys.executable, os.path.join(ROOT, "dapo.py"), "--task", "carry", "--model", model, "--seed",
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


def mean_sd(xs, f=".3f"):
    return f"{statistics.mean(xs):{f}} ± {statistics.stdev(xs):{f}}" if len(xs) > 1 else f"{xs[0]:{f}} (1 seed)"


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


def rung_table(args, rows, counts, tail):
    """The ladder's table, one line per (name, paper's AIME24, runs); the first row is the reference whose
    final held-out accuracy the others are timed to reach. Per-step metrics: means over the last `tail` steps."""
    ref_name, _, ref = rows[0]
    grpo_final = statistics.mean(r["after"][KEY] for r in ref)
    grpo_responses = statistics.mean(sum(m["gen/responses"] for m in r["metrics"]) for r in ref)
    last = lambda r, k: statistics.mean(m[k] for m in r["metrics"][-tail:])  # noqa: E731  (late training)
    name_of = lambda ls: f"d{min(ls)}" + (f"-d{max(ls)}" if max(ls) > min(ls) else "") if ls else "(none)"  # noqa: E731
    short, long = ([k for k in ls if k in counts] for ls in (SHORT, LONG))
    table = [f"| rung | paper AIME24 | held-out avg@4 (mean ± sd) | short {name_of(short)} | long {name_of(long)} | "
             f"steps to {ref_name}'s final ({grpo_final:.3f}) | responses to it | at its responses | "
             f"entropy | truncated | kept | effective groups | responses/step | responses per trained group | s/step | "
             f"clip lo / hi |" + (" its own statistic |" if args.variants else "") +
             (" distinct responses | pass@4 | train acc at its responses |" if args.real else ""),
             "|" + "---|" * (16 + args.variants + 3 * args.real)]
    for name, paper, rs in rows:
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
            f"| {mean_sd([split(r['after'], SHORT, counts) for r in rs]) if short else '-'} "
            f"| {mean_sd([split(r['after'], LONG, counts) for r in rs]) if long else '-'} "
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
                               if all(k in m for r in rs for m in r["metrics"][-tail:])) + " |"
               if args.variants else "")
            + (f" {statistics.mean(last(r, 'gen/distinct_frac') for r in rs):.2f} "
               f"| {mean_sd([r['after']['eval/pass@4'] for r in rs])} "
               f"| {mean_sd(at_budget) if at_budget else '-'} |"
               if args.real else ""))
    return table


def report(args):
    """The miniature ladder's (or --variants') table and plot, from the runs under --root."""
    counts = {}
    for r in demo_model.demo_task(0, "carry")[1]:
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
    seeds = sorted({len(rs) for rs in runs.values()})
    print(f"{' or '.join(map(str, seeds))} seeds (a row with one says so); held-out avg@4 after the last step; per-step metrics are means over the "
          f"last {args.tail} rollout steps and the seeds; steps and responses to reach are medians over the seeds "
          f"that reached it (eval every {args.eval_every} steps).\n")
    print("\n".join(rung_table(args, [(*entries(args)[i][:2], rs) for i, rs in sorted(runs.items())], counts,
                               args.tail)))
    plot(args, runs, counts)


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


# -----------------------------------------------------------------------------------------
# --real: the runs, their cost, their records

def real_plan():
    """Every run of --real, as (folder, seed, settings, flags), in the order they run, so that a budget cut short
    leaves whole seeds of both experiments: Figure 2's two arms at 20 steps for Table 1's seeds (its DAPO arm gives
    Table 1's DAPO row: no 10-step DAPO run), then Table 1's other rows at REAL's 10 steps, seed by seed, then
    Figure 2's other seeds, then Clip-Higher alone."""
    figure2 = [(folder, seed, FIGURE2, flags) for seed in FIGURE2_SEEDS for _, flags, folder in FIGURE2_ARMS]
    table1 = [(folder, seed, REAL, flags) for seed in REAL_SEEDS for _, _, flags, folder in REAL_RUNGS[:-1]]
    first = [job for job in figure2 if job[1] in REAL_SEEDS]
    return (first + table1 + [job for job in figure2 if job not in first] +
            [(CLIP_ALONE[3], seed, REAL, CLIP_ALONE[2]) for seed in REAL_SEEDS])


def real_command(args, model, folder, seed, settings, flags):
    data = data_dir(args)
    return [sys.executable, os.path.join(ROOT, "dapo.py"), "--train-data", os.path.join(data, "train.jsonl"),
            "--eval-data", os.path.join(data, "eval.jsonl"), "--model", model, "--seed", str(seed),
            *as_flags(settings), *DISK, "--out-dir", os.path.join(args.root, folder, f"seed{seed}"), *flags,
            *args.extra]


def shown(command):
    """A command line as the screen shows it: python, paths inside the checkout relative to it."""
    return " ".join(["python"] + command[1:]).replace(ROOT + os.sep, "")


def finished(path, steps):
    """A finished run: its metrics.jsonl holds steps 1 to `steps`, the last with the final held-out evaluation,
    beside its run.json."""
    try:
        rows = load(path)
    except (OSError, ValueError):  # not there, or a line cut short by a kill
        return False
    return ([r.get("step") for r in rows] == list(range(1, steps + 1)) and KEY in rows[-1]
            and os.path.exists(os.path.join(path, "run.json")))


def copy_records(run, records):
    """A finished run's small records (RECORDS: tens of kB) into the tracked folder; then its checkpoints
    (~1.9 GB) are deleted. The run folder keeps the rest (samples.jsonl)."""
    os.makedirs(records, exist_ok=True)
    for name in RECORDS:
        if os.path.exists(os.path.join(run, name)):
            shutil.copy(os.path.join(run, name), os.path.join(records, name))
    shutil.rmtree(os.path.join(run, "checkpoints"), ignore_errors=True)


def kind(job):
    """A run's kind for its cost: (steps, dynamic sampling)."""
    return job[2]["steps"], "--no-dynamic-sampling" not in job[3]


def to_go(args, plan):
    """The runs of the plan not finished yet, and those finished in --root whose records were not copied (the
    ladder was stopped in between)."""
    todo, uncopied = [], []
    for job in plan:
        folder, seed, settings, _ = job
        run, records = (os.path.join(d, folder, f"seed{seed}") for d in (args.root, args.records))
        if not finished(records, settings["steps"]):
            (uncopied if finished(run, settings["steps"]) else todo).append(job)
    return todo, uncopied


def cost_line(args, plan, todo):
    """The runs to go by kind, times the minutes a run of that kind takes: the mean of the finished runs of that
    kind (their ladder.json), else REAL_MINUTES."""
    took = {}
    for job in plan:
        path = os.path.join(args.records, job[0], f"seed{job[1]}", "ladder.json")
        if job not in todo and os.path.exists(path):
            took.setdefault(kind(job), []).append(json.load(open(path))["minutes"])
    parts, total = [], 0.0
    for k in sorted({kind(job) for job in todo}):
        n, minutes = sum(kind(job) == k for job in todo), statistics.mean(took[k]) if k in took else REAL_MINUTES[k]
        total += n * minutes
        parts.append(f"{n} x ~{minutes:.1f} min ({k[0]} steps{', dynamic sampling' if k[1] else ''}; "
                     f"{f'the mean of {len(took[k])} finished' if k in took else 'estimated'})")
    return (f"{len(todo)} of {len(plan)} runs to go (finished ones skipped)" +
            (f": {', '.join(parts)}: ~{total:.0f} minutes (~{total / 60:.1f} hours) on 2 CPU cores" if todo else ""))


def uncommitted():
    """The tracked code files that differ from the git commit run.json will name."""
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "dapo.py", "reward.py", "lib",
                          "tools", "examples"], cwd=ROOT, capture_output=True, text=True)
    return [line[3:] for line in out.stdout.splitlines()]


def run_real(args, model, job):
    """One run: dapo.py, its screen output and the minutes it took beside its metrics; then its records copied."""
    folder, seed, settings, _ = job
    c = real_command(args, model, *job)
    out_dir, records = (os.path.join(d, folder, f"seed{seed}") for d in (args.root, args.records))
    print(shown(c), flush=True)
    os.makedirs(out_dir, exist_ok=True)
    code, start = uncommitted(), time.perf_counter()
    r = subprocess.run(c, capture_output=True, text=True, cwd=ROOT)
    minutes = (time.perf_counter() - start) / 60
    with open(os.path.join(out_dir, "stdout.txt"), "w") as f:
        f.write(r.stdout + r.stderr[-5000:])
    if r.returncode or not finished(out_dir, settings["steps"]):
        sys.exit(f"failed (exit code {r.returncode}{'' if r.returncode else ', its metrics.jsonl unfinished'}): "
                 f"{' '.join(c)}\n{r.stderr[-2000:]}")
    with open(os.path.join(out_dir, "ladder.json"), "w") as f:
        json.dump({"minutes": round(minutes, 2), "uncommitted": code}, f)
    copy_records(out_dir, records)
    print(f"{folder}/seed{seed}: {minutes:.1f} minutes; records in {records}", flush=True)


def experiment(args):
    """--real: the cost first, then every run to go, each run's records copied as it finishes, then the report."""
    plan = real_plan()
    todo, uncopied = to_go(args, plan)
    print(cost_line(args, plan, todo), flush=True)
    if args.print_commands:
        for job in todo:
            print(shown(real_command(args, "$(python tools/real_model.py)", *job)))
        return
    subprocess.run([sys.executable, os.path.join(ROOT, "examples", "fewshot_chain.py"), data_dir(args)], check=True)
    with open(os.path.join(data_dir(args), "eval.jsonl")) as f:  # the held-out levels, for the report
        levels = Counter(json.loads(x)["level"] for x in f.readlines()[:REAL["eval_max_prompts"]])
    os.makedirs(args.records, exist_ok=True)
    with open(os.path.join(args.records, "levels.json"), "w") as f:
        json.dump(dict(sorted(levels.items())), f)
    for folder, seed, _, _ in uncopied:
        copy_records(*(os.path.join(d, folder, f"seed{seed}") for d in (args.root, args.records)))
        print(f"{folder}/seed{seed}: finished before; its records copied to {args.records}")
    model = base_model(args) if todo else None
    for job in todo:
        run_real(args, model, job)
    report_real(args)


# -----------------------------------------------------------------------------------------
# --real: the report, from the records alone

def load_run(path, seed, steps):
    """A run's records, read up to `steps`: its metrics, the held-out evaluation before training (step 1's row
    logs it) and at that step, the git commit it ran on and the minutes it took."""
    rows = load(path)
    metrics = rows[:steps]
    extra = json.load(open(os.path.join(path, "ladder.json"))) if os.path.exists(os.path.join(path, "ladder.json")) \
        else {}
    return {"seed": seed, "metrics": metrics, "steps": len(rows), "minutes": extra.get("minutes"),
            "uncommitted": extra.get("uncommitted", []),
            "commit": json.load(open(os.path.join(path, "run.json"))).get("git_commit") or "unknown",
            "before": {"eval/" + k.split("/", 1)[1]: v for k, v in metrics[0].items() if k.startswith("eval_before/")},
            "after": {k: v for k, v in metrics[-1].items() if k.startswith("eval/")}}


def step_mean(run, k, tail):
    """k's mean over the run's last `tail` steps that log it (prob/old_at_clip_high: those where the upper clip
    bound); None when none does."""
    xs = [m[k] for m in run["metrics"][-tail:] if k in m]
    return statistics.mean(xs) if xs else None


# Figure 2's table: (metric, its column, a factor), each the mean over the last half of the steps, then over seeds
FIGURE2_COLUMNS = [("entropy", "entropy (π_θ, trained tokens)", 1), ("entropy/generated", "entropy/generated", 1),
                   ("gen/distinct_frac", "distinct responses", 1), ("clip/high_frac", "upper clip binds (%)", 100),
                   ("prob/old_at_clip_high", "π_θold where it binds", 1), ("prob/old", "π_θold, every token", 1),
                   ("prob/low_up_ratio", "r of low-p tokens pushed up", 1)]


def figure2_table(arms, tail):
    table = ["| arm | held-out avg@4 | pass@4 | " + " | ".join(c for _, c, _ in FIGURE2_COLUMNS) + " |",
             "|" + "---|" * (3 + len(FIGURE2_COLUMNS))]
    for name, rs in arms:
        cells = [mean_sd([r["after"][KEY] for r in rs]), mean_sd([r["after"]["eval/pass@4"] for r in rs])]
        for k, _, factor in FIGURE2_COLUMNS:
            xs = [factor * x for x in (step_mean(r, k, tail) for r in rs) if x is not None]
            cells.append((mean_sd(xs, ".4f" if factor > 1 else ".3f") if xs else "-") +
                         (f" ({len(xs)}/{len(rs)} seeds)" if xs and len(xs) < len(rs) else ""))
        table.append(f"| {name} | " + " | ".join(cells) + " |")
    return table


def by_seed(rows):
    """Held-out avg@4 at each evaluation, by seed: one line per rung or arm."""
    seeds = sorted({r["seed"] for _, rs in rows for r in rs})
    table = ["| | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|" + "---|" * (1 + len(seeds))]
    for name, rs in rows:
        cell = {r["seed"]: " -> ".join(f"{e[KEY]:.3f}" for _, _, e in curve(r)[:-1]) +
                f" -> **{r['after'][KEY]:.3f}**" for r in rs}
        table.append(f"| {name} | " + " | ".join(cell.get(s, "-") for s in seeds) + " |")
    return table


# What a run executes: a commit that differs from another only outside these (docs, the records, tools/) ran the
# same code.
RUN_CODE = ("dapo.py", "reward.py", "lib", "examples")


def same_code(a, b):
    """Whether git commits a and b hold the same RUN_CODE (False where git does not know one of them)."""
    return a == b or subprocess.run(["git", "diff", "--quiet", a, b, "--", *RUN_CODE], cwd=ROOT,
                                    capture_output=True).returncode == 0


def code_table(runs):
    """Which code each run ran on (run.json's git commit; one whose RUN_CODE differs from most runs' marked), and
    the minutes each took. runs: {folder: [run]}. Returns the table, the usual commit, and the runs whose commit
    differs from it: (in code, only outside it)."""
    commits = Counter(r["commit"] for rs in runs.values() for r in rs)
    usual = commits.most_common(1)[0][0]
    same = {c: same_code(usual, c) for c in commits}
    table = ["| runs | steps | git commit | minutes, by seed |", "|---|---|---|---|"]
    for folder, rs in runs.items():
        mark = lambda r: r["commit"][:10] if same[r["commit"]] else f"**{r['commit'][:10]} (differs)**"  # noqa: E731
        said = ", ".join(dict.fromkeys(mark(r) + (" + uncommitted changes" if r["uncommitted"] else "") for r in rs))
        minutes = " / ".join(f"{r['minutes']:.1f}" if r["minutes"] else "-" for r in rs)
        table.append(f"| {folder} | {rs[0]['steps']} | {said} | {minutes} |")
    return table, usual, (sum(n for c, n in commits.items() if not same[c]),
                          sum(n for c, n in commits.items() if same[c] and c != usual))


def report_real(args):
    """--real's tables and plots, from the records alone (--records): Table 1's six rows, Clip-Higher alone
    against naive GRPO, Figure 2's arms, the held-out accuracy by seed, and the code and minutes of every run."""
    levels = os.path.join(args.records, "levels.json")
    if not os.path.exists(levels):
        print(f"error: no {levels} (the held-out set's levels, which the experiment writes): run the experiment "
              f"first (python tools/ladder.py --real), or name the records with --records", file=sys.stderr)
        sys.exit(2)
    with open(levels) as f:
        counts = {int(k): v for k, v in json.load(f).items()}
    plan = real_plan()
    length = {folder: settings["steps"] for folder, _, settings, _ in plan}
    runs = {}  # folder -> its finished runs, whole
    for folder, seed, settings, _ in plan:
        path = os.path.join(args.records, folder, f"seed{seed}")
        if finished(path, settings["steps"]):
            runs.setdefault(folder, []).append(load_run(path, seed, settings["steps"]))
    if not runs:
        print(f"error: no finished run under {args.records}: run the experiment first (python tools/ladder.py "
              f"--real), or name the records with --records", file=sys.stderr)
        sys.exit(2)
    at = REAL["steps"]  # Table 1 and Clip-Higher alone, read at step 10 (Figure 2's DAPO arm too)

    def cut(folder):  # the folder's finished runs of REAL_SEEDS, read up to step `at`
        return [load_run(os.path.join(args.records, folder, f"seed{r['seed']}"), r["seed"], at)
                for r in runs.get(folder, []) if r["seed"] in REAL_SEEDS]
    table1 = [(name, paper, rs) for name, paper, _, folder in REAL_RUNGS if (rs := cut(folder))]
    tail = min(args.tail, at // 2)
    print(f"Table 1 on the real model: {len(REAL_SEEDS)} seeds a row (one with fewer says so), held-out avg@4 after "
          f"step {at}; per-step metrics are means over the last {tail} steps and the seeds; steps and responses to "
          f"reach are medians over the seeds that reached it (evaluations every {REAL['eval_every']} steps).")
    if length["dapo"] > at and any(n.startswith("+ dynamic") for n, _, _ in table1):
        print(f"+ dynamic sampling (DAPO): Figure 2's DAPO runs (seeds {', '.join(map(str, REAL_SEEDS))}) read at "
              f"step {at}, their first {at} steps a {at}-step run's; their step-{at} evaluation draws its own samples "
              f"(tagged `step {at}`, not `after`).")
    print("\n" + "\n".join(rung_table(args, table1, counts, tail)) if table1 else "(no Table 1 row finished yet)")
    grpo, clip = cut(REAL_RUNGS[0][3]), cut(CLIP_ALONE[3])
    alone = [(*CLIP_ALONE[:2], clip)] if clip else []
    if grpo and clip:
        print("\nClip-Higher alone (ε_high 0.28 against naive GRPO's 0.2, no overlong filtering, no dynamic "
              "sampling): Figure 2's pair without dynamic sampling, not a row of Table 1.\n")
        print("\n".join(rung_table(args, [(*REAL_RUNGS[0][:2], grpo)] + alone, counts, tail)))
    arms = [(name, runs[folder]) for name, _, folder in FIGURE2_ARMS if folder in runs]
    tail2 = min(args.tail, FIGURE2["steps"] // 2)
    if arms:
        print(f"\nFigure 2 with full batches: {', '.join(f'{n} ({len(rs)} seeds)' for n, rs in arms)}, "
              f"{FIGURE2['steps']} steps; held-out avg@4 and pass@4 after the last step, the rest means over the "
              f"last {tail2} steps (π_θold where the upper clip binds: over the steps where it bound), then "
              f"mean ± sd over the seeds.\n")
        print("\n".join(figure2_table(arms, tail2)))
    print("\nHeld-out avg@4 at each evaluation (steps 0, 5, 10, ...), by seed:\n")
    print("\n".join(by_seed([(n, rs) for n, _, rs in table1 + alone] + arms)))
    table, usual, (differ, alike) = code_table(runs)
    print(f"\nThe code: {sum(map(len, runs.values())) - differ - alike} runs on git commit {usual}" +
          (f", {alike} on other commits with the same {', '.join(RUN_CODE)} (git diff)" if alike else "") +
          (f"; {differ} on another (marked)" if differ else "") + ". The minutes each run took:\n")
    print("\n".join(table))
    plt = pyplot()
    if plt:
        plot_real(args, plt, [(n, rs) for n, _, rs in table1 + alone])
        plot_figure2(args, plt, arms)


def pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print("(pip install matplotlib for the plots)")


def plot_lines(ax, rs, xy, colour, label, by_position=False, **kw):
    """Each run thin, their mean thick: at each x, over the runs that have a value there; or by_position, the mean
    x and y of each run's i-th point (x differs between runs: the responses generated by an evaluation's step).
    xy(run): [(x, y)]."""
    points = [xy(r) for r in rs]
    for p in points:
        ax.plot([x for x, _ in p], [y for _, y in p], color=colour, linewidth=0.8, alpha=0.35, **kw)
    if by_position:
        mean = [[statistics.mean(c) for c in zip(*at)] for at in zip(*points)]
    else:
        mean = [(x, statistics.mean(y for p in points for x2, y in p if x2 == x))
                for x in sorted({x for p in points for x, _ in p})]
    ax.plot([x for x, _ in mean], [y for _, y in mean], color=colour, linewidth=2.5, label=label, **kw)


def plot_real(args, plt, rows):
    """Table 1 on the real model: per rung, its mean over seeds (a thick line; each seed a thin one) of the
    held-out accuracy by step and by generated response, pass@4, the entropy of the trained tokens and of
    every sampled token, and the share of distinct responses in a group."""
    if not rows:
        return
    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    colours, names = plt.get_cmap("viridis")([i / 5 for i in range(6)]), [n for n, *_ in REAL_RUNGS]
    for name, rs in rows:  # Table 1's rows, from yellow-green to purple, then Clip-Higher alone, dashed
        colour, style = (colours[names.index(name)], "-") if name in names else ("tab:red", "--")
        evals = lambda x, k: lambda r: [(p[x], p[2][k]) for p in curve(r)]  # noqa: E731
        plot_lines(axes[0, 0], rs, evals(0, KEY), colour, name, linestyle=style, marker="o")
        plot_lines(axes[0, 1], rs, evals(1, KEY), colour, name, by_position=True, linestyle=style, marker="o")
        plot_lines(axes[0, 2], rs, evals(0, "eval/pass@4"), colour, name, linestyle=style, marker="s")
        for ax, k in zip(axes[1], ("entropy", "entropy/generated", "gen/distinct_frac")):
            plot_lines(ax, rs, lambda r: [(m["step"], m[k]) for m in r["metrics"]], colour, name, linestyle=style)
    titles = [("held-out avg@4", "rollout step"), ("held-out avg@4", "generated responses"),
              ("held-out pass@4", "rollout step"), ("entropy of the trained tokens (`entropy`)", "rollout step"),
              ("mean -log p of every sampled token (`entropy/generated`)", "rollout step"),
              ("distinct responses in a group (`gen/distinct_frac`)", "rollout step")]
    finish(fig, axes, titles, f"Table 1 on SmolLM2-135M-Instruct, running sums, {max(len(rs) for _, rs in rows)} "
           f"seeds a rung (thick: their mean; thin: each seed; dashed: Clip-Higher alone)", args.png)


def finish(fig, axes, titles, suptitle, path):
    """Each panel's title (and x-axis: a pair, or the rollout step), a grid, the first panel's legend; the file."""
    for ax, title in zip(axes.flat, titles):
        title, x = title if isinstance(title, tuple) else (title, "rollout step")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(x)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(suptitle)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    print(f"wrote {path}")


def plot_figure2(args, plt, arms):
    """Figure 2 with full batches, by step: the entropy (π_θ's exact one on the trained tokens, and the sampled
    tokens' estimate), the distinct share, the held-out avg@4 and pass@4, the upper clip's binding share, and
    Sec. 3.1's probabilities: π_θold where the upper clip binds (solid) against every token's (dashed), and the
    ratio reached by low-probability tokens pushed up (each arm's cap 1 + ε_high dotted)."""
    if not arms:
        return
    fig, axes = plt.subplots(2, 4, figsize=(20, 8))
    per_step = lambda k: lambda r: [(m["step"], m[k]) for m in r["metrics"] if k in m]  # noqa: E731
    for name, rs in arms:
        flags = next(f for n, f, _ in FIGURE2_ARMS if n == name)
        colour = "tab:red" if flags else "tab:blue"
        eps = float(flags[flags.index("--eps-high") + 1]) if "--eps-high" in flags else dapo.Config().eps_high
        for ax, k in zip(axes[0], ("entropy", "entropy/generated", "gen/distinct_frac", "clip/high_frac")):
            plot_lines(ax, rs, per_step(k), colour, name)
        for ax, k in zip(axes[1], (KEY, "eval/pass@4")):
            plot_lines(ax, rs, lambda r: [(p[0], p[2][k]) for p in curve(r)], colour, name, marker="o")
        plot_lines(axes[1, 2], rs, per_step("prob/old_at_clip_high"), colour, f"{name}: where the upper clip binds",
                   marker=".")
        plot_lines(axes[1, 2], rs, per_step("prob/old"), colour, f"{name}: every token", linestyle="--")
        plot_lines(axes[1, 3], rs, per_step("prob/low_up_ratio"), colour, name)
        axes[1, 3].axhline(1 + eps, color=colour, linestyle=":", linewidth=1)
    titles = ["entropy of the trained tokens (`entropy`)", "mean -log p of every sampled token (`entropy/generated`)",
              "distinct responses in a group (`gen/distinct_frac`)",
              "share of tokens the upper clip binds on (`clip/high_frac`)",
              "held-out avg@4", "held-out pass@4", "mean π_θold of the tokens (`prob/old_at_clip_high`, `prob/old`)",
              "r of the tokens with π_θold < 0.2, A > 0 (`prob/low_up_ratio`)"]
    axes[1, 2].legend(fontsize=7)
    finish(fig, axes, titles, f"Figure 2 with full batches on SmolLM2-135M-Instruct, running sums: DAPO against DAPO "
           f"with ε_high 0.2, {max(len(rs) for _, rs in arms)} seeds an arm (thick: their mean; thin: each seed)",
           args.figure2_png)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rungs", type=int, nargs="+", help="a subset, by index (default: all)")
    p.add_argument("--variants", action="store_true", help="the --loss variants instead of the rungs")
    p.add_argument("--real", action="store_true", help="Table 1 and Figure 2 on a real model (REAL, FIGURE2)")
    p.add_argument("--steps", type=int, default=75)
    p.add_argument("--eval-every", type=int, default=15)
    p.add_argument("--tail", type=int, default=25, help="rollout steps averaged for the per-step metrics")
    p.add_argument("--root", default=os.path.join(ROOT, "runs", "ladder"))
    p.add_argument("--records", default=os.path.join(ROOT, "docs", "real-model-runs"),
                   help="--real: where each finished run's records go, and what --report reads")
    p.add_argument("--png", help="where --report draws the curves (default: docs/ladder.png, docs/variants.png, "
                                 "docs/real-model-ladder.png)")
    p.add_argument("--figure2-png", default=os.path.join(ROOT, "docs", "real-model-figure2.png"))
    p.add_argument("--report", action="store_true")
    p.add_argument("--print-commands", action="store_true")
    p.add_argument("extra", nargs="*", help="more dapo.py flags for every rung (after --)")
    args = p.parse_args()
    if args.real and (args.rungs or args.variants or args.seeds != p.get_default("seeds")):
        p.error("--real runs a fixed plan (REAL_RUNGS, CLIP_ALONE, FIGURE2_ARMS; REAL_SEEDS, FIGURE2_SEEDS): drop "
                "--rungs, --seeds and --variants")
    if args.real:  # runs in its own folder
        args.root = os.path.join(ROOT, "runs", "real-ladder") if args.root == p.get_default("root") else args.root
    args.rungs = range(len(entries(args))) if args.rungs is None else args.rungs
    args.png = args.png or os.path.join(ROOT, "docs", "real-model-ladder.png" if args.real else
                                        "variants.png" if args.variants else "ladder.png")
    if args.real:
        return report_real(args) if args.report else experiment(args)
    if args.print_commands:
        for _, c in commands(args):
            print(" ".join(["python"] + c[1:]))
        return
    if not args.report:
        if not os.path.exists(os.path.join(base_model(args), "config.json")):
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
