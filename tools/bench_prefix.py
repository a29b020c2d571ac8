"""bench_prefix.py: the update with a group's prompt forwarded where it pays (dapo.py's default), always
(--shared-prefix) and never (--no-shared-prefix, a copy per response), side by side, on four shapes:

    python tools/bench_prefix.py                                  # every shape, each way (~45 minutes on 2 CPU cores)
    python tools/bench_prefix.py --shapes bench_step showcase --steps 3

  bench_step  tools/bench_step.py's workload: a random tiny Qwen2 (the demo's shape, vocabulary 128), 32 prompts of
              ~8 tokens x 8 responses of up to 256 (~117), fp32, one mini-batch in micro-batches of 256 sequences
  showcase    the laptop showcase as the README runs it: SmolLM2-135M-Instruct (tools/real_model.py), the laptop
              preset, examples/fewshot_addition.py's sums (prompts of ~92 tokens, answers of ~6)
  ladder      the real-model ladder's task: examples/fewshot_chain.py (prompts of 144-150 tokens, responses of
              21-41), tools/ladder.py's REAL settings
  long        SmolLM2-135M's architecture with random weights, so that every response runs to its limit:
              fewshot_chain's few-shot prompts, 4 prompts x 8 responses of 512 tokens, the laptop preset (bf16 where
              the CPU has it, 16 sequences a micro-batch, or what this machine's memory holds), one mini-batch

Every run is dapo.py's own command (dynamic sampling off, no evaluation), the same seed each way, one after the
other, under tools/memwatch.py. Printed: the medians over the steps after the first of the update (time/update:
π_θold and the μ gradient steps) and of the whole step (time/step), the tokens the update forwards in one pass over
the batch (update/tokens), the peak memory of all the run's processes, and each way's update against the faster
of the two forced ways.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tools import ladder, memwatch  # noqa: E402  (REAL, the ladder's settings; the memory sampler)

# shape: (the data's example script or "" for the built-in task, the model: "real", "random" or "tiny", flags)
SHAPES = {"bench_step": ("", "tiny", dict(prompts_per_step=32, group_size=8, gen_batch_size=32, max_prompt_len=16,
                                          max_response_len=256, overlong_cache_len=64, num_mini_batches=1,
                                          micro_batch_size=256, lr=1e-6, warmup_steps=1, precision="fp32")),
          "showcase": ("fewshot_addition.py", "real", {}),
          "ladder": ("fewshot_chain.py", "real", ladder.REAL),
          "long": ("fewshot_chain.py", "random", dict(prompts_per_step=4, group_size=8, gen_batch_size=4,
                                                      max_response_len=512, overlong_cache_len=128,
                                                      num_mini_batches=1))}
MODES = {"default": [], "shared": ["--shared-prefix"], "plain": ["--no-shared-prefix"]}
KEYS = ("time/update", "time/step", "update/tokens")


def flags(settings):
    return [x for k, v in settings.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def model_for(kind, root):
    """The model directory of a shape: SmolLM2-135M-Instruct; its architecture with random weights (its config,
    so the laptop preset applies; its tokenizer); or the random tiny Qwen2 of tools/bench_step.py."""
    path = os.path.join(root, f"model-{kind}")
    real = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "real_model.py")], check=True,
                          capture_output=True, text=True).stdout.split()[-1] if kind != "tiny" else ""
    if kind == "real" or os.path.isdir(path):
        return real if kind == "real" else path
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(0)
    if kind == "random":
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(real), dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(real)
    else:
        from lib import demo_model
        model, tokenizer = demo_model.tiny_qwen2(demo_model.DEMO_TOKENS, vocab=128, max_len=16 + 256, fill=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run(shape, mode, steps, seed, root):
    """One dapo.py run under memwatch: (its metrics rows, the peak GB of all its processes)."""
    script, kind, settings = SHAPES[shape]
    cmd = [sys.executable, os.path.join(ROOT, "dapo.py"), "--model", model_for(kind, root)]
    if script:
        data = os.path.join(root, script[:-3])
        if not os.path.exists(os.path.join(data, "train.jsonl")):
            subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), data], check=True)
        cmd += ["--train-data", os.path.join(data, "train.jsonl"), "--eval-data", os.path.join(data, "eval.jsonl")]
    out = os.path.join(root, f"{shape}-{mode}")
    shutil.rmtree(out, ignore_errors=True)
    cmd += [*flags(settings), "--steps", str(steps), "--eval-samples", "0", "--seed", str(seed), "--out-dir", out,
            *MODES[mode]]
    if shape != "showcase":  # the showcase as the README runs it; elsewhere every group trains
        cmd.append("--no-dynamic-sampling")
    print(" ".join(cmd), flush=True)
    samples, stop = [], threading.Event()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    watcher = threading.Thread(target=memwatch.watch, args=(proc.pid, stop, samples), daemon=True)
    watcher.start()
    code = proc.wait()
    stop.set()
    watcher.join()
    if code:
        raise SystemExit(f"bench_prefix: {shape}, {mode} exited with {code}")
    shutil.rmtree(os.path.join(out, "checkpoints"), ignore_errors=True)  # ~0.5-2 GB each: not what is measured
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return rows, memwatch.gb(memwatch.peaks(samples)["sum_kb"])


def table(results):
    """Markdown: each shape's medians (the steps after the first) and peak memory, each way, and each way's update
    against the faster of the two forced ones."""
    lines = ["| shape | way | update (s) | step (s) | tokens forwarded | peak memory (GB) | update / the faster forced |",
             "|---|---|---|---|---|---|---|"]
    for shape, by in results.items():
        med = {how: {k: statistics.median(r[k] for r in rows[1:] or rows) for k in KEYS}
               for how, (rows, _) in by.items()}
        forced = [med[h]["time/update"] for h in ("shared", "plain") if h in med]
        for how, (rows, peak) in by.items():
            m = med[how]
            ratio = f"{m['time/update'] / min(forced):.2f}" if forced else "-"
            lines.append(f"| {shape} | {how} | {m['time/update']:.2f} | {m['time/step']:.2f} | "
                         f"{m['update/tokens']:,.0f} | {peak:.2f} | {ratio} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--steps", type=int, default=5, help="rollout steps per run (the first is left out of the medians)")
    p.add_argument("--long-steps", type=int, default=3, help="rollout steps per run of the long shape")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--root", default="", help="where the runs go (default: a temporary folder)")
    a = p.parse_args(argv)
    root = a.root or tempfile.mkdtemp(prefix="bench_prefix_")
    results = {}
    for shape in a.shapes:
        steps = a.long_steps if shape == "long" else a.steps
        results[shape] = {how: run(shape, how, steps, a.seed, root) for how in a.modes}
        print(table({shape: results[shape]}), flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
