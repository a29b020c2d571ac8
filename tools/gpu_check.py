"""
gpu_check.py: the first thing to run on a GPU machine (and to attach to a bug report).

    python tools/gpu_check.py --model Qwen/Qwen2.5-0.5B-Instruct      # any small model you have

It runs a few rollout steps of dapo.py on one GPU (the built-in addition task, dynamic sampling off,
no checkpoint) and prints one table: peak GPU memory per phase (generate, update, sync), the time
split, the weight sync's log-prob gap at step 0 and after a sleep/wake cycle, whether vLLM captured
CUDA graphs, and PASS or FAIL against the limits it states. Without a GPU it runs the same logic on
the CPU and names each check it skips; more dapo.py flags can follow.
"""

import argparse
import gc
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch  # noqa: E402

import dapo  # noqa: E402

GAP_LIMIT = dapo.Config.max_sync_diff  # nats, mean |vLLM - trainer| log-prob (healthy bf16: ~0.01-0.04)
MEMORY_LIMIT = 0.95  # of the GPU's memory, at the peak of any phase


def instrument(phases, seen):
    """Wrap dapo's generate, update and sync functions: time and (on CUDA) peak memory per phase."""
    def timed(name, fn):
        def wrapper(*a, **k):
            cuda = torch.cuda.is_available()
            if cuda:  # vLLM's sleeping pool still counts as allocated (its pages are unmapped, not
                torch.cuda.synchronize()  # freed), so the phase's own peak is a rise above its start
                torch.cuda.reset_peak_memory_stats()
                start = torch.cuda.memory_allocated()
                free, total = torch.cuda.mem_get_info()
                used_start = total - free
            t = time.perf_counter()
            out = fn(*a, **k)
            if cuda:
                torch.cuda.synchronize()
                free, total = torch.cuda.mem_get_info()
                rise = torch.cuda.max_memory_allocated() - start
                ph = phases[name]
                ph["rise_gb"] = max(ph.get("rise_gb", 0), rise / 1e9)
                ph["peak_gb"] = max(ph.get("peak_gb", 0), max(total - free, used_start + rise) / 1e9)
            phases[name]["seconds"] = phases[name].get("seconds", 0) + time.perf_counter() - t
            return out
        return wrapper

    for name, attr in (("generate", "sample_groups"), ("update", "update_policy"), ("sync", "push_weights")):
        phases[name] = {}
        setattr(dapo, attr, timed(name, getattr(dapo, attr)))
    start_engine = dapo.start_engine
    dapo.start_engine = lambda *a, **k: seen.setdefault("llm", start_engine(*a, **k))
    dapo.save_checkpoint = lambda run, step: None  # a check, not a run to keep


def cuda_graphs(llm):
    """Whether vLLM runs the model through CUDA graphs, from its resolved config."""
    config = llm.llm_engine.vllm_config
    mode = getattr(config.compilation_config, "cudagraph_mode", None)
    return not config.model_config.enforce_eager and mode is not None and str(mode).split(".")[-1] != "NONE"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--model", required=True, help="a small Hugging Face model directory or hub name")
    p.add_argument("--steps", type=int, default=3, help="rollout steps (>= 2: the 2nd follows a sleep/wake)")
    a, rest = p.parse_known_args(argv)
    out_dir = tempfile.mkdtemp(prefix="gpu_check_")
    flags = ["--model", a.model, "--steps", str(max(2, a.steps)), "--prompts-per-step", "8", "--group-size",
             "4", "--gen-batch-size", "8", "--num-mini-batches", "2", "--micro-batch-size", "8",
             "--no-dynamic-sampling", "--max-prompt-len", "512", "--max-response-len", "256",
             "--overlong-cache-len", "64", "--eval-samples", "0", "--warmup-steps", "1",
             "--max-sync-diff", "0", "--out-dir", out_dir]
    cfg = dapo.parse_config(flags + rest)
    phases, seen = {}, {}
    instrument(phases, seen)
    cuda = torch.cuda.is_available()
    error = None
    try:
        dapo.train(cfg)
        dapo._shut_down(exiting=True)  # as dapo.py's own end: the process ends after the report
    except dapo.DapoError as e:
        error = str(e)
    rows = [] if error else [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    checks = []  # (what, value, limit, passed or None = skipped)
    if error:
        checks.append(("the run", error, "finishes", False))
    for name, ph in phases.items():
        if cuda:
            total = torch.cuda.get_device_properties(0).total_memory / 1e9
            checks.append((f"GPU memory, {name} (peak in use / torch's rise)",
                           f"{ph.get('peak_gb', 0):.2f} / {ph.get('rise_gb', 0):.2f} GB",
                           f"< {MEMORY_LIMIT:.0%} of {total:.0f} GB",
                           ph.get("peak_gb", 0) < MEMORY_LIMIT * total))
        else:
            checks.append((f"GPU memory, {name}", "-", "skipped: no GPU (torch.cuda.is_available())", None))
    spent = sum(ph.get("seconds", 0) for ph in phases.values())
    checks.append(("time split, generate / update / sync",
                   " / ".join(f"{phases[n].get('seconds', 0) / max(spent, 1e-9):.0%}" for n in phases),
                   f"of {spent:.1f} s", True if rows else None))
    for i, what in ((0, "step 0 (the first sync)"), (1, "after a sleep/wake cycle" if cuda else
                                                    "after an update and sync (no sleep on CPU)")):
        if i < len(rows):
            gap = rows[i]["sync/logp_diff_mean"]
            worst = rows[i]["sync/logp_diff_max"]
            checks.append((f"log-prob gap, {what}", f"mean {gap:.2e}, max {worst:.2e}", f"mean < {GAP_LIMIT}",
                           gap < GAP_LIMIT))
    if not cuda:
        checks.append(("sleep/wake cycle", "-", "skipped: vLLM's sleep mode exists on CUDA only", None))
    if rows:
        mismatch, skipped = (sum(r[k] for r in rows) for k in ("sync/tp_mismatch", "nonfinite/skipped"))
        checks.append(("TP ranks agree, steps finite", f"tp_mismatch {mismatch}, skipped {skipped}", "0, 0",
                       not mismatch and not skipped))
    if cuda and "llm" in seen:
        graphs = cuda_graphs(seen["llm"])
        checks.append(("CUDA graphs", "on" if graphs else "off", "on", graphs))
    elif not cuda:
        checks.append(("CUDA graphs", "-", "skipped: the CPU backend runs eager", None))
    device = torch.cuda.get_device_name(0) if cuda else "CPU (no GPU)"
    dapo.print0(f"\ngpu_check: {a.model} on {device}, torch {torch.__version__}")
    width = max(len(c[0]) for c in checks)
    for what, value, limit, ok in checks:
        verdict = "skipped" if ok is None else "PASS" if ok else "FAIL"
        dapo.print0(f"  {what:<{width}}  {value:<28} {limit:<40} {verdict}")
    failed = any(ok is False for *_, ok in checks)
    dapo.print0("gpu_check: FAIL" if failed else "gpu_check: PASS (skipped checks named above)")
    return 1 if failed else 0


if __name__ == "__main__":
    gc.disable()  # as dapo.py's own start and end: set_up turns it back on once vLLM is up
    dapo.exit_now(main())
