"""bench_prefix.py: the update with a group's prompt forwarded where it pays (dapo.py's default), always
(--shared-prefix) and never (--no-shared-prefix, a copy per response), side by side, on six shapes:

    python tools/bench_prefix.py --repeat 2          # every shape, each way, runs alternated (~2 hours on 2 CPU cores)
    python tools/bench_prefix.py --shapes trl mid --modes default plain --repeat 2 --steps 4

  trl         TRL's side-by-side workload: a random 2-layer Qwen2 (hidden 128, MLP 256, 2 heads of 64, 1 KV head,
              a character-level vocabulary of 128), 256 prompts "a+b=" (10..99), 32 prompts x 8 responses of up
              to 256 tokens, fp32, one mini-batch in micro-batches of 256 sequences
  demo        the built-in demo as `python dapo.py` runs it (its own preset)
  showcase    the laptop showcase as the README runs it: SmolLM2-135M-Instruct (tools/real_model.py), the laptop
              preset, examples/fewshot_addition.py's sums (prompts of ~92 tokens, answers of ~6)
  ladder      the real-model ladder's task: examples/fewshot_chain.py (prompts of 144-150 tokens, responses of
              21-41), tools/ladder.py's REAL settings
  mid         SmolLM2-135M's architecture with random weights, so that every response runs to its limit:
              fewshot_chain's prompts, 4 prompts x 8 responses of 150 tokens, the laptop preset, one mini-batch
  long        the same at 512 tokens a response (the laptop preset: bf16 where the CPU has it, 32 sequences a
              micro-batch, or what this machine's memory holds)

Every run is dapo.py's own command (dynamic sampling off but for the showcase and the demo, no evaluation), the
same seed each way; with --repeat N the ways alternate (default, shared, plain, default, ...), N runs of each.
Printed, for each shape and way: the medians over the steps after each run's first, over all its runs, of the
update (time/update: π_θold and the μ gradient steps) and of the whole step (time/step), the tokens the update
forwards in one pass over the batch (update/tokens), the peak memory of all the run's processes (tools/memwatch.py)
beside the plan dapo.py makes before vLLM starts (lib/plan.py's cpu_plan) and the share of one micro-batch's
activations the allocator kept by that peak (the plan's CPU_KEPT), and each way's update against the faster of
the two forced ways.
"""
import argparse
import contextlib
import io
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
SHAPES = {"trl": ("add", "trl", dict(prompts_per_step=32, group_size=8, gen_batch_size=32, max_prompt_len=16,
                                     max_response_len=256, overlong_cache_len=64, num_mini_batches=1,
                                     micro_batch_size=256, lr=1e-5, warmup_steps=1, dedup=False)),
          "demo": ("", "demo", {}),
          "showcase": ("fewshot_addition.py", "real", {}),
          "ladder": ("fewshot_chain.py", "real", ladder.REAL),
          "mid": ("fewshot_chain.py", "random", dict(prompts_per_step=4, group_size=8, gen_batch_size=4,
                                                     max_response_len=150, overlong_cache_len=32, num_mini_batches=1)),
          "long": ("fewshot_chain.py", "random", dict(prompts_per_step=4, group_size=8, gen_batch_size=4,
                                                      max_response_len=512, overlong_cache_len=128,
                                                      num_mini_batches=1))}
MODES = {"default": [], "shared": ["--shared-prefix"], "plain": ["--no-shared-prefix"]}
KEYS = ("time/update", "time/step", "update/tokens")


def flags(settings):
    return [x for k, v in settings.items() for x in ([f"--{'' if v else 'no-'}{k.replace('_', '-')}"]
                                                      if isinstance(v, bool) else [f"--{k.replace('_', '-')}", str(v)])]


def model_for(kind, root):
    """The model directory of a shape: SmolLM2-135M-Instruct; its architecture with random weights (its config,
    so the laptop preset applies; its tokenizer); TRL's side-by-side model (a random 2-layer Qwen2 and a
    character-level tokenizer, seed 0); or "" (the built-in demo model)."""
    path = os.path.join(root, f"model-{kind}")
    if kind == "demo":
        return ""
    real = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "real_model.py")], check=True,
                          capture_output=True, text=True).stdout.split()[-1] if kind != "trl" else ""
    if kind == "real" or os.path.isdir(path):
        return real if kind == "real" else path
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(0)
    if kind == "random":
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(real), dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(real)
    else:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
        chars = list("0123456789+-*/=()., ?:\nabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ$\\{}^_")
        tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>"] + chars)}, "?"))
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.Split(pattern="", behavior="isolated"), decoders.Fuse()
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                            eos_token="<eos>", unk_token="?")
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                                             tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def add_data(path):
    """TRL's side-by-side prompts: 256 sums "a+b=" of a, b in 10..99 (random.Random(0)), as JSONL."""
    import random
    rng = random.Random(0)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "train.jsonl"), "w") as f:
        for a, b in ((rng.randint(10, 99), rng.randint(10, 99)) for _ in range(256)):
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")


def command(shape, mode, steps, seed, root, out):
    """dapo.py's command for one run of a shape, its data written first where missing."""
    script, kind, settings = SHAPES[shape]
    model = model_for(kind, root)
    cmd = [sys.executable, os.path.join(ROOT, "dapo.py")] + (["--model", model] if model else [])
    if script:
        data = os.path.join(root, script.replace(".py", ""))
        if not os.path.exists(os.path.join(data, "train.jsonl")):
            if script == "add":
                add_data(data)
            else:
                subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), data], check=True)
        cmd += ["--train-data", os.path.join(data, "train.jsonl")]
        if script != "add":
            cmd += ["--eval-data", os.path.join(data, "eval.jsonl")]
    cmd += [*flags(settings), "--steps", str(steps), "--eval-samples", "0", "--seed", str(seed), "--out-dir", out,
            *MODES[mode]]
    if shape not in ("showcase", "demo"):  # those as the README runs them; elsewhere every group trains
        cmd.append("--no-dynamic-sampling")
    return cmd


def planned(cmd):
    """(the peak lib/plan.py's cpu_plan gives this run, GB; one micro-batch's transient memory, GB), as dapo.py's
    fit_host_memory plans it (its config after any rewrite, the rule's layout)."""
    import dapo
    from lib import plan
    cfg = dapo.parse_config(cmd[2:])
    config = dapo.check_model(cfg.model or os.path.join(cfg.out_dir, "base_model"))  # the demo's: built by the run
    if cfg.model:
        with contextlib.redirect_stdout(io.StringIO()):
            dapo.fit_host_memory(cfg, config, 1)
    shape = plan.model_shape(cfg.model)
    layout = dapo.cpu_layout(cfg, dapo.sharing(cfg, config))
    t = plan.trainer_bytes(cfg, shape, 1, "cpu", layout)
    return plan.cpu_plan(cfg, shape, layout)[1] / 1e9, (t["gathered"] + t["activations"] + t["kv_copy"]) / 1e9


def run(shape, mode, steps, seed, root, tag=""):
    """One dapo.py run under memwatch: (its metrics rows, the peak GB of all its processes, the plan's peak and one
    micro-batch's transient memory, GB)."""
    out = os.path.join(root, f"{shape}-{mode}{tag}")
    shutil.rmtree(out, ignore_errors=True)
    cmd = command(shape, mode, steps, seed, root, out)
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
    return rows[1:] or rows, memwatch.gb(memwatch.peaks(samples)["sum_kb"]), *planned(cmd)


def table(results):
    """Markdown: each shape's medians (over the steps after each run's first, all runs of a way) and peak memory
    (the largest run's) beside the plan, each way, and each way's update against the faster of the two forced."""
    lines = ["| shape | way | runs | update (s) | step (s) | tokens forwarded | peak memory (GB) | plan (GB) | kept "
             "| update / the faster forced |", "|---|---|---|---|---|---|---|---|---|---|"]
    for shape, by in results.items():
        med = {how: {k: statistics.median(r[k] for rows, *_ in runs for r in rows) for k in KEYS}
               for how, runs in by.items()}
        forced = [med[h]["time/update"] for h in ("shared", "plain") if h in med]
        for how, runs in by.items():
            m, (_, peak, plan_gb, transient) = med[how], max(runs, key=lambda r: r[1])
            ratio = f"{m['time/update'] / min(forced):.2f}" if forced else "-"
            lines.append(f"| {shape} | {how} | {len(runs)} | {m['time/update']:.2f} | {m['time/step']:.2f} | "
                         f"{m['update/tokens']:,.0f} | {peak:.2f} | {plan_gb:.2f} | {kept(peak, plan_gb, transient):.2f} "
                         f"| {ratio} |")
    return "\n".join(lines)


def kept(peak, plan_gb, transient):
    """The share of one micro-batch's transient memory the allocator kept by the peak, as the plan counts it: the
    CPU_KEPT that would make the plan equal the measured peak."""
    from lib import plan
    return (peak - plan_gb) / transient + plan.CPU_KEPT


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--steps", type=int, default=5, help="rollout steps per run (the first is left out of the medians)")
    p.add_argument("--long-steps", type=int, default=3, help="rollout steps per run of the long shape")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1, help="runs of each way, alternated")
    p.add_argument("--root", default="", help="where the runs go (default: a temporary folder)")
    a = p.parse_args(argv)
    root = a.root or tempfile.mkdtemp(prefix="bench_prefix_")
    results = {}
    for shape in a.shapes:
        steps = a.long_steps if shape == "long" else a.steps
        results[shape] = {how: [] for how in a.modes}
        for k in range(a.repeat):
            for how in a.modes:
                results[shape][how].append(run(shape, how, steps, a.seed, root, f"-{k}"))
        print(table({shape: results[shape]}), flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
