"""bench_prefix.py: the update with a group's prompt forwarded once (--shared-prefix) against a copy per response
(--no-shared-prefix), side by side, on the real model's two tasks: the laptop showcase (examples/fewshot_addition.py)
and the real-model ladder's running sums (examples/fewshot_chain.py, tools/ladder.py's REAL settings).

    python tools/bench_prefix.py                        # both tasks, 5 steps each way (~25 minutes on 2 CPU cores)
    python tools/bench_prefix.py --tasks ladder --steps 3

Each run is dapo.py's own command on tools/real_model.py's SmolLM2-135M-Instruct, the same seed both ways, without
evaluation, one after the other. Printed: the medians over the steps after the first of the update (time/update:
π_θold and the μ gradient steps), the whole step (time/step), and the tokens the update forwards in one pass over
the batch (update/tokens), shared against plain, and their ratios.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tools import ladder  # noqa: E402  (REAL, the ladder's settings)

TASKS = {"showcase": ("fewshot_addition.py", {}),   # the laptop preset as it is: the README's command
         "ladder": ("fewshot_chain.py", dict(ladder.REAL, eval_samples=0))}
KEYS = ("time/update", "time/step", "update/tokens")


def flags(settings):
    return [x for k, v in settings.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def run(task, shared, steps, seed, root, model):
    """One dapo.py run; its metrics rows."""
    script, settings = TASKS[task]
    data = os.path.join(root, task)
    if not os.path.exists(os.path.join(data, "train.jsonl")):
        subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), data], check=True)
    out = os.path.join(root, f"{task}-{'shared' if shared else 'plain'}")
    cmd = [sys.executable, os.path.join(ROOT, "dapo.py"), "--model", model, "--train-data",
           os.path.join(data, "train.jsonl"), "--eval-data", os.path.join(data, "eval.jsonl"), *flags(settings),
           "--steps", str(steps), "--eval-samples", "0", "--seed", str(seed), "--out-dir", out,
           "--shared-prefix" if shared else "--no-shared-prefix"]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    shutil.rmtree(os.path.join(out, "checkpoints"), ignore_errors=True)  # ~1.9 GB each: not what is measured
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def table(results):
    """Markdown: each task's medians (the steps after the first), shared and plain, and shared / plain."""
    lines = ["| task | | update (s) | step (s) | tokens forwarded |", "|---|---|---|---|---|"]
    for task, by in results.items():
        med = {how: {k: statistics.median(r[k] for r in rows[1:] or rows) for k in KEYS} for how, rows in by.items()}
        for how in ("plain", "shared"):
            lines.append(f"| {task} | {how} | {med[how]['time/update']:.2f} | {med[how]['time/step']:.2f} | "
                         f"{med[how]['update/tokens']:,.0f} |")
        ratio = {k: med["plain"][k] / med["shared"][k] for k in KEYS}
        lines.append(f"| {task} | plain / shared | {ratio['time/update']:.2f}x | {ratio['time/step']:.2f}x | "
                     f"{ratio['update/tokens']:.2f}x |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--steps", type=int, default=5, help="rollout steps per run (the first is left out of the medians)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--root", default="", help="where the runs go (default: a temporary folder)")
    a = p.parse_args(argv)
    root = a.root or tempfile.mkdtemp(prefix="bench_prefix_")
    model = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "real_model.py")], check=True,
                           capture_output=True, text=True).stdout.split()[-1]
    results = {task: {how: run(task, how == "shared", a.steps, a.seed, root, model) for how in ("plain", "shared")}
               for task in a.tasks}
    print(table(results))


if __name__ == "__main__":
    main()
