"""
gpu_check.py: the first thing to run on a GPU machine, on one GPU and on the layout the run will use (and
the output to attach to a bug report).

    python tools/gpu_check.py --model Qwen/Qwen2.5-0.5B-Instruct                 # any small model you have
    python tools/gpu_check.py --trainer-only     # no vLLM needed: the trainer's half (tools/trainer_check.py)
    torchrun --nproc_per_node=8 tools/gpu_check.py --model <a model> --tp-size 2  # the README's 8-GPU layout
    torchrun --nproc_per_node=8 tools/gpu_check.py --model <the run's model> --tp-size 2 \\
        --max-prompt-len 2048 --max-response-len 4096 <the run's memory flags>    # the run's lengths

It runs dapo.py's own train() twice in this process, on the built-in addition task (dynamic sampling and
overlong filtering off, so every step trains): STEPS - 1 rollout steps and their checkpoint; then vLLM's
engine is torn down and one more step runs, resumed from that checkpoint by dapo.py's --resume. By default
prompts and responses are short enough for any model (its max_position_embeddings). With --max-prompt-len or
--max-response-len the run takes those lengths, where memory is the question: each prompt is led by worked
sums up to the prompt length, and every response runs to the response length (vLLM's ignore_eos), the plan's
worst case. Rank 0 prints two tables: every rank's peak memory in each phase (generate, update, sync, save,
resume), gathered before the shutdown; and the checks with PASS or FAIL against the limits they state: the
weight sync's log-prob gap at step 0, after a sleep/wake cycle and after the resume, the TP ranks' agreement,
finite steps, CUDA graphs, the memory limit, the checkpoint's files, and the resume (its step count goes on,
its weights and optimizer state equal the saved ones bit for bit). Without a GPU it runs the same logic on
the CPU and names each check it skips. Any other dapo.py flag follows (--tp-size, --precision,
--grad-checkpointing, --micro-batch-tokens, ...).
"""

import argparse
import gc
import itertools
import json
import math
import os
import resource
import shutil
import socket
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch  # noqa: E402

import dapo  # noqa: E402
from lib import check_data, demo_model, dist, interrupt, plan  # noqa: E402

GAP_LIMIT = dapo.Config.max_sync_diff  # nats, mean |vLLM - trainer| log-prob (healthy bf16: ~0.01-0.04)
MEMORY_LIMIT = 0.95  # of each GPU's memory, at the peak of any phase
PHASES = {"generate": "sample_groups", "update": "update_policy", "sync": "push_weights",
          "save": "save_checkpoint", "resume": "load_checkpoint"}  # phase: the dapo.py function it times
# dapo.py's own phases (gpu_phase, which resets torch's peaks at each boundary) -> this tool's: on CUDA their memory
# is read where dapo.py records it, never by resetting the peaks inside a step (that would cut dapo.py's phases)
DAPO_PHASES = {"generation": "generate", "old_logp": "update", "update": "update", "sync": "sync"}


# -----------------------------------------------------------------------------------------
# Measuring dapo.py from outside: its functions wrapped, as they run in train()

def memory_at_start():
    """On CUDA: the device's memory in use (every process on it, as mem_get_info counts) and torch's
    reserved bytes, with torch's peaks reset. None on a CPU."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    free, total = torch.cuda.mem_get_info()
    return total - free, torch.cuda.memory_reserved()


def memory_peaks(start):
    """The phase's peaks, GB. CUDA: in use on the device (its start plus torch's rise in reserved memory, or
    its end if higher: vLLM's wake-up maps memory that torch had kept reserved), torch's max reserved and max
    allocated (vLLM's sleep-mode pool among them, also while asleep). CPU: the process's peak RSS so far."""
    if start is None:
        return {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    used, reserved = start
    peak_reserved = torch.cuda.max_memory_reserved()
    return {"in_use": max(total - free, used + peak_reserved - reserved) / 1e9, "reserved": peak_reserved / 1e9,
            "allocated": torch.cuda.max_memory_allocated() / 1e9}


def memory_now():
    """What this rank holds now, GB: on CUDA in use on its device (mem_get_info), on a CPU its RSS."""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return (total - free) / 1e9
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def fingerprint(model, opt):
    """A hash of this rank's shards of the weights and of the optimizer's state: equal iff every bit is."""
    import hashlib
    h = hashlib.sha1()
    for p in model.parameters():
        for t in [p, *(v for _, v in sorted(opt.state.get(p, {}).items()))]:
            t = t.to_local() if hasattr(t, "to_local") else t  # an FSDP2 shard (DTensor)
            h.update(t.detach().cpu().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def instrument(phases, seen):
    """Wrap dapo's functions: each phase's time and peak memory (PHASES); each engine's CUDA graphs; a hash
    of the state each checkpoint saves and resume loads. (init_distributed, which set_up calls, keeps the
    process group this tool started: both runs and the report share it.)"""
    cuda = torch.cuda.is_available()

    def timed(name, fn):
        own = not (cuda and name in DAPO_PHASES.values())  # this wrapper reads the memory (else recorded does, below)

        def wrapper(*a, **k):
            seen["phase"], t = name, time.perf_counter()
            start = memory_at_start() if own else None
            out = fn(*a, **k)
            ph = phases.setdefault(name, {})
            ph["seconds"] = ph.get("seconds", 0) + time.perf_counter() - t
            for key, value in (memory_peaks(start) if own else {}).items():
                ph[key] = max(ph.get(key, 0), value)
            seen["phase"] = None
            return out
        return wrapper

    for name, attr in PHASES.items():
        setattr(dapo, attr, timed(name, getattr(dapo, attr)))
    phase_end = dapo.gpu_phase

    def recorded(run, phase):  # each rank's memory of a dapo.py phase, as gpu_phase records it
        phase_end(run, phase)
        if phase and run.device.type == "cuda":
            ph, g = phases.setdefault(DAPO_PHASES[phase], {}), run.gpu
            total = torch.cuda.get_device_properties(run.device).total_memory / 1e9
            read = {"allocated": g[f"mem/{phase}_allocated_gb"], "reserved": g[f"mem/{phase}_reserved_gb"],
                    "in_use": total - g[f"mem/{phase}_free_gb"], "pool": g[f"mem/{phase}_vllm_pool_gb"]}
            for key, value in read.items():
                ph[key] = max(ph.get(key, 0), value)
    dapo.gpu_phase = recorded
    save, load, start_engine = dapo.save_checkpoint, dapo.load_checkpoint, dapo.start_engine

    def saved(run, step):
        save(run, step)
        if run.state["step"] == step:  # a checkpoint was written (save_checkpoint sets the step it holds)
            seen.setdefault("saved", {})[step] = fingerprint(run.model, run.opt)

    def loaded(ckpt, model, opt):
        load(ckpt, model, opt)
        seen["loaded"] = (os.path.basename(ckpt), fingerprint(model, opt))

    def engine(*a, **k):
        llm = start_engine(*a, **k)
        seen.setdefault("graphs", []).append(cuda_graphs(llm))
        return llm

    dapo.save_checkpoint, dapo.load_checkpoint, dapo.start_engine = saved, loaded, engine


def cuda_graphs(llm):
    """Whether vLLM runs the model through CUDA graphs, from its resolved config."""
    config = llm.llm_engine.vllm_config
    mode = getattr(config.compilation_config, "cudagraph_mode", None)
    return not config.model_config.enforce_eager and mode is not None and str(mode).split(".")[-1] != "NONE"


def full_length_responses():
    """Every response runs to --max-response-len: vLLM's ignore_eos, on the SamplingParams dapo.generate makes
    (it takes the class from vllm at each call; vllm's own modules keep theirs)."""
    import vllm
    generate, params = dapo.generate, vllm.SamplingParams

    def wrapper(*a, **k):
        vllm.SamplingParams = lambda **kw: params(**kw, ignore_eos=True)
        try:
            return generate(*a, **k)
        finally:
            vllm.SamplingParams = params
    dapo.generate = wrapper


def close_engine():
    """vLLM's own shutdown of the engine (its executor, scheduler, process groups and cached memory: what
    dapo.py's _shut_down runs when a library calls main), but with torch's default process group kept: the
    resumed run and the report run in it. vLLM's shutdown ends by destroying that group too."""
    torch.distributed.barrier()
    llm = interrupt.STATE.pop("llm")
    destroy = torch.distributed.destroy_process_group
    torch.distributed.destroy_process_group = lambda group=None: group is not None and destroy(group)
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        torch.distributed.destroy_process_group = destroy
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    torch.distributed.barrier()


# -----------------------------------------------------------------------------------------
# The run's set-up: lengths, a directory every rank sees, prompts at the run's length

def lengths(model, max_prompt_len, max_response_len):
    """(prompt, response) lengths: the given ones, or short ones that fit the model's positions."""
    config = check_data.check_model(model)  # one line on a model that cannot load
    positions = getattr(config, "max_position_embeddings", None) or 4096
    return max_prompt_len or min(256, positions // 4), max_response_len or min(128, positions // 4)


def shared_out_dir(path):
    """The run's directory, the same on every rank: a new temporary one (rank 0 makes it and sends its name)
    unless --out-dir names one, which must be new or empty (a checkpoint left there would be resumed)."""
    if dist.rank() == 0:
        if path and os.path.isdir(path) and os.listdir(path):
            path = f"error: --out-dir {path} is not empty: give a new directory (gpu_check resumes the newest " \
                   f"checkpoint there)"
        else:
            path = os.path.abspath(path) if path else tempfile.mkdtemp(prefix="gpu_check_")
            os.makedirs(path, exist_ok=True)
    box = [path]
    torch.distributed.broadcast_object_list(box, src=0)
    if box[0].startswith("error: "):
        raise dapo.DapoError(box[0][len("error: "):])
    blind = [host for host, sees in dist.all_gather_objects((socket.gethostname(), os.path.isdir(box[0])))[0]
             if not sees]
    if blind:
        raise dapo.DapoError(f"the run's directory {box[0]} is not visible on {', '.join(sorted(set(blind)))}: "
                             f"on several nodes give --out-dir on a file system every node mounts")
    return box[0]


def long_prompts(model, length, path):
    """The built-in task's prompts, each led by worked sums ("12+34=46"), as many as keep them within `length`
    tokens (the chat template included). Written to path as JSONL; returns their length in tokens."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = demo_model.demo_task(0)[0][:64]
    lines = [f"{a}+{b}={a + b}\n" for a, b in zip(range(length), itertools.cycle(range(10, 100)))]  # >= 1 token each
    head = demo_model.DAPO_HEAD
    led = lambda row, n: row["prompt"].replace(head, head + "".join(lines[:n]))  # noqa: E731
    size = lambda n: len(dapo.encode_prompts(tokenizer, [led(rows[0], n)])[0])  # noqa: E731
    lo, hi = 0, len(lines)
    while lo < hi:  # the most worked sums that fit
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if size(mid) <= length else (lo, mid - 1)
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt": led(r, lo), "answer": r["answer"]}) + "\n" for r in rows)
    return size(lo)


def checkpoint_files(out_dir, step, world):
    """The files of step's checkpoint that are missing (save_checkpoint's layout), and a summary of it."""
    import glob
    d = os.path.join(out_dir, "checkpoints", f"step_{step:06d}")
    want = ["state.json", "dcp/.metadata", "model/config.json", *(f"rng_rank{r}.pt" for r in range(world))]
    missing = [w for w in want if not os.path.isfile(os.path.join(d, w))]
    shards, weights = (len(glob.glob(os.path.join(d, *p))) for p in (("dcp", "*.distcp"), ("model", "*.safetensors")))
    missing += [] if shards >= world else [f"dcp/ shards ({shards} of {world} ranks)"]
    missing += [] if weights else ["model/*.safetensors"]
    return missing, f"dcp/ {shards} shards, model/ {weights} files, {world} rng, state.json"


# -----------------------------------------------------------------------------------------
# The report: every rank's memory, then the checks

def memory_table(reports, cuda):
    """One row per rank: its peak memory in each phase, and what it held once the first engine was gone."""
    phases = [n for n in PHASES if any(n in r["phases"] for r in reports)]
    if cuda:
        head = ("peak memory per rank and phase, GB: in use on the GPU (mem_get_info, every process on it) / torch's "
                "max reserved / max allocated; after teardown: in use once the first engine was gone")
        cell = lambda ph: f"{ph['in_use']:.1f}/{ph['reserved']:.1f}/{ph['allocated']:.1f}"  # noqa: E731
    else:
        head = ("peak memory per rank, GB: the process's peak RSS at the end of each phase (no GPU); after "
                "teardown: its RSS once the first engine was gone")
        cell = lambda ph: f"{ph['rss']:.2f}"  # noqa: E731
    table = [["rank", "host", "device", *phases, "after teardown"]]
    for r in reports:
        table.append([str(r["rank"]), r["host"], r["device"], *(cell(r["phases"][n]) if n in r["phases"] else "-"
                                                                 for n in phases),
                      "-" if r["left"] is None else f"{r['left']:.2f}"])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return [head] + [("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths))).rstrip() for row in table]


# Each phase dapo.py records in metrics.jsonl (gpu_phase): what the plan gives the trainer in it (lib/plan.py's
# trainer_bytes) and the plan's peaks of the whole GPU that bound it
PLAN_PHASES = {"generation": (("resident",), ("peak while generating",)),
               "old_logp": (("training",), ("peak while training",)),
               "update": (("training", "stepping"), ("peak while training", "peak while stepping AdamW")),
               "sync": (("resident",), ("peak while generating",))}


def phases_beside_plan(rows, cfg, model, world, total_gb, cuda):
    """Rank 0's GPU memory in each phase of a step as dapo.py logs it (metrics.jsonl's mem/*, gpu_phase: the largest
    over the steps): torch's peak allocated and reserved count vLLM's pool (its weights and KV cache, asleep too:
    vllm_pool_bytes), so the trainer's own is allocated less the pool, set beside the plan's trainer figure for the
    phase; and the device's memory in use at the phase's end beside the plan's peak of the whole GPU."""
    if not cuda:
        return ["GPU memory per phase beside the plan (metrics.jsonl's mem/*): skipped, no GPU"]
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    _, v = plan.memory_plan(cfg, plan.model_shape(model), -(-world // per_node), per_node, total_gb)
    lines = [f"GPU memory per phase, rank 0, GB (metrics.jsonl): torch's peak allocated / reserved, of which vLLM's "
             f"pool; the trainer's (allocated - pool) beside the plan's trainer; the device's in use at the phase's "
             f"end beside the plan's GPU peak ({world} rank(s), {total_gb:.1f} GB GPUs):"]
    for phase, (trainer, peaks) in PLAN_PHASES.items():
        got = [r for r in rows if f"mem/{phase}_allocated_gb" in r]
        if not got:
            lines.append(f"  {phase:<10} not logged")
            continue
        alloc = max(r[f"mem/{phase}_allocated_gb"] for r in got)
        reserved = max(r[f"mem/{phase}_reserved_gb"] for r in got)
        pool = max(r.get(f"mem/{phase}_vllm_pool_gb", 0.0) for r in got)
        own = max(r[f"mem/{phase}_allocated_gb"] - r.get(f"mem/{phase}_vllm_pool_gb", 0.0) for r in got)
        in_use = total_gb - min(r[f"mem/{phase}_free_gb"] for r in got)
        mine = max(v["trainer"][k] for k in trainer) / 1e9
        planned = max(v["peaks"][k] for k in peaks) / 1e9
        lines.append(f"  {phase:<10} {alloc:6.1f} / {reserved:6.1f}, pool {pool:5.1f}   trainer {own:6.1f}  plan "
                     f"{mine:6.1f} ({' or '.join(trainer)})   in use {in_use:6.1f}  plan {planned:6.1f} "
                     f"({' or '.join(k.replace('peak ', '') for k in peaks)})")
    return lines


def all_checks(reports, rows, files, steps, cuda, error):
    """(what, value, limit, passed or None = skipped), from every rank's report and rank 0's metrics.jsonl."""
    checks = [("the run", error, "finishes", False)] if error else []
    peaks = [(r["phases"][n]["in_use"] / r["total"], r["rank"], n, r["total"]) for r in reports
             for n in r["phases"] if cuda]
    if cuda and peaks:
        share, rank, name, total = max(peaks)
        checks.append(("GPU memory, every rank's peak in use", f"{share * total:.1f} GB (rank {rank}, {name})",
                       f"< {MEMORY_LIMIT:.0%} of {total:.0f} GB", share < MEMORY_LIMIT))
    elif not cuda:
        checks.append(("GPU memory", "-", "skipped: no GPU (torch.cuda.is_available()); RSS above", None))
    seconds = {n: sum(r["phases"].get(n, {}).get("seconds", 0) for r in reports) for n in PHASES}
    spent = sum(seconds.values())
    split = " / ".join(f"{s / max(spent, 1e-9):.0%}" for s in seconds.values())
    checks.append((f"time split, {' / '.join(PHASES)}", split, f"of {spent / len(reports):.1f} s per rank",
                   True if rows else None))
    for i, what in ((0, "step 0 (the first sync)"),
                    (1, "after a sleep/wake cycle" if cuda else "after an update and sync (no sleep on CPU)"),
                    (steps - 1, "after the resume (a new engine)")):
        if i < len(rows):
            gap, worst = rows[i]["sync/logp_diff_mean"], rows[i]["sync/logp_diff_max"]
            checks.append((f"log-prob gap, {what}", f"mean {gap:.2e}, max {worst:.2e}", f"mean < {GAP_LIMIT}",
                           gap < GAP_LIMIT))
    if not cuda:
        checks.append(("sleep/wake cycle", "-", "skipped: vLLM's sleep mode exists on CUDA only", None))
    if rows:
        mismatch, skipped = (sum(r[k] for r in rows) for k in ("sync/tp_mismatch", "nonfinite/skipped"))
        finite = all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
        checks.append(("TP ranks agree, steps finite", f"tp_mismatch {mismatch}, skipped {skipped}", "0, 0",
                       not mismatch and not skipped and finite))
    graphs = [g for r in reports for g in r["graphs"]]
    if cuda and graphs:
        checks.append(("CUDA graphs, every engine of every rank", f"on in {sum(graphs)} of {len(graphs)}", "all",
                       all(graphs)))
    elif not cuda:
        checks.append(("CUDA graphs", "-", "skipped: CUDA graphs exist on CUDA only", None))
    if files:
        missing, summary = files
        checks.append((f"checkpoint of step {steps - 1}, its files", "missing: " + ", ".join(missing) if missing
                       else summary, "all there", not missing))
    if not error:
        want = f"step_{steps - 1:06d}"
        resumed = [r["loaded"][0] if r["loaded"] else None for r in reports]
        logged = [r["step"] for r in rows]
        checks.append(("resume continues the run", f"from {sorted(set(map(str, resumed)))}, steps logged {logged}",
                       f"from {want}, steps 1-{steps}",
                       all(c == want for c in resumed) and logged == list(range(1, steps + 1))))
        same = sum(bool(r["loaded"]) and r["loaded"][1] == r["saved"].get(steps - 1) for r in reports)
        checks.append(("weights and optimizer state after resume", f"equal the saved on {same} of {len(reports)} ranks",
                       "bit for bit, every rank", same == len(reports)))
    return checks


def device_name():
    if not torch.cuda.is_available():
        return "CPU"
    i = torch.cuda.current_device()
    return f"{torch.cuda.get_device_name(i)} ({torch.cuda.get_device_properties(i).total_memory / 1e9:.0f} GB)"


def parse_args(argv=None):
    """gpu_check's own flags, and the rest: dapo.py's."""
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--trainer-only", action="store_true",
                   help="the trainer's half alone, without vLLM: tools/trainer_check.py, which takes the other flags")
    p.add_argument("--model", help="a Hugging Face model directory or hub name (required without --trainer-only)")
    p.add_argument("--steps", type=int, default=3,
                   help="rollout steps (>= 3): the first STEPS - 1 saved (the 2nd follows a sleep/wake cycle on "
                        "CUDA), then one resumed")
    p.add_argument("--max-prompt-len", type=int, default=0,
                   help="the run's prompt length: prompts led by worked sums up to it (default: short, within the "
                        "model's positions)")
    p.add_argument("--max-response-len", type=int, default=0,
                   help="the run's response length: every response runs to it (default: short, within the model's "
                        "positions)")
    p.add_argument("--out-dir", default="", help="the run's directory, new or empty; on several nodes on a file "
                                                 "system all mount (default: a temporary one, removed on PASS)")
    return p.parse_known_args(argv)


def main(argv=None):
    a, rest = parse_args(argv)
    if a.trainer_only:  # no vLLM imported on this path; trainer_check's own flags are the rest
        if a.model:
            raise dapo.DapoError("gpu_check --trainer-only builds the README's models itself: drop --model "
                                 "(--models 1.5b,7b,tiny chooses them)")
        import trainer_check
        gc.enable()  # no vLLM start-up to spare a collection (see the end of this file)
        return trainer_check.main(rest)
    if not a.model:
        raise dapo.DapoError("gpu_check: --model is required (a model directory), or --trainer-only")
    steps, full = max(3, a.steps), bool(a.max_prompt_len or a.max_response_len)
    prompt_len, response_len = lengths(a.model, a.max_prompt_len, a.max_response_len)
    ws = int(os.environ.get("WORLD_SIZE", "1"))
    n = ws * math.ceil(8 / ws)  # prompts per step: 4n responses split into 2 mini-batches x ws ranks
    flags = ["--model", a.model, "--prompts-per-step", str(n), "--group-size", "4", "--gen-batch-size", str(n),
             "--num-mini-batches", "2", "--max-prompt-len", str(prompt_len), "--max-response-len", str(response_len),
             "--overlong-cache-len", str(max(1, response_len // 4)), "--warmup-steps", "1", "--eval-samples", "0",
             "--no-dynamic-sampling",  # every group trains: a random model's rewards are often all equal
             "--no-overlong-filtering",  # truncated responses train too, as on a model that stops early
             "--max-sync-diff", "0"]  # the gap is a check here, not a stop
    cfg = dapo.parse_config(flags + rest)
    # vLLM keeps an exception raised while it imports (vllm/multimodal/media/audio.py: torchcodec missing, or
    # its ffmpeg), and its traceback keeps every frame of the stack that imported vLLM. Imported inside
    # train() (start_engine), that would keep the first run's finished frame, and with it the first run's
    # policy, optimizer and engine, alive: imported here, the stack is this function's.
    from vllm import LLM  # noqa: F401
    phases, seen = {}, {}
    instrument(phases, seen)
    dapo.init_distributed(cfg.collective_timeout_min)
    me, world, cuda = dist.rank(), dist.world(), torch.cuda.is_available()
    error, files, out_dir = None, None, a.out_dir
    try:
        out_dir = shared_out_dir(a.out_dir)
        flags += ["--out-dir", out_dir]
        if full:
            full_length_responses()
            if not any(f.split("=")[0] == "--train-data" for f in rest):  # else the user's prompts
                flags += ["--train-data", os.path.join(out_dir, "long_prompts.jsonl")]
                if me == 0:
                    print(f"gpu_check: prompts of {long_prompts(a.model, prompt_len, flags[-1])} tokens, responses "
                          f"of {response_len} (ignore_eos)", flush=True)
                torch.distributed.barrier()
        dapo.train(dapo.parse_config(flags + rest + ["--steps", str(steps - 1)]))  # saves at its last step
        files = checkpoint_files(out_dir, steps - 1, world) if me == 0 else None
        close_engine()
        seen["left"] = memory_now()
        dapo.train(dapo.parse_config(flags + rest + ["--steps", str(steps), "--resume"]))
    except dapo.DapoError as e:
        if not phases:  # refused before anything ran (a flag, the out-dir): one line, as dapo.py says it
            raise
        error = str(e)
    except torch.OutOfMemoryError:
        print(f"gpu_check: rank {me} ({socket.gethostname()}) ran out of GPU memory in phase {seen.get('phase')}; "
              f"its peaks so far: {json.dumps(phases)}", file=sys.stderr, flush=True)
        raise
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 1e9 if cuda else 0
    report = {"rank": me, "host": socket.gethostname(), "device": device_name(), "total": total, "phases": phases,
              "graphs": seen.get("graphs", []), "saved": seen.get("saved", {}), "loaded": seen.get("loaded"),
              "left": seen.get("left"), "error": error}
    reports = dist.all_gather_objects(report)[0]  # before the shutdown: after it every rank is "rank 0"
    failed = True
    if me == 0:
        error = error or next((f"rank {r['rank']}: {r['error']}" for r in reports if r["error"]), None)
        metrics = os.path.join(out_dir, "metrics.jsonl")
        rows = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
        checks = all_checks(reports, rows, files, steps, cuda, error)
        print(f"\ngpu_check: {a.model} on {world} rank(s), {reports[0]['device']}, torch {torch.__version__}, "
              f"prompts up to {prompt_len} tokens, responses {response_len}" + (" (ignore_eos)" if full else ""))
        print("\n".join(memory_table(reports, cuda)))
        print("\n".join(phases_beside_plan(rows, cfg, a.model, world, reports[0]["total"], cuda)) + "\n")
        widths = [max((len(str(c[i])) for c in checks if len(str(c[i])) <= 64), default=0)  # longer ones stick out
                  for i in range(3)]
        for *cells, ok in checks:
            verdict = "skipped" if ok is None else "PASS" if ok else "FAIL"
            print("  " + "  ".join(f"{c:<{w}}" for c, w in zip(cells, widths)) + "  " + verdict)
        failed = any(ok is False for *_, ok in checks)
        if not failed and not a.out_dir:
            shutil.rmtree(out_dir, ignore_errors=True)
        print("gpu_check: FAIL" + ("" if a.out_dir else f" (the run's files: {out_dir})") if failed
              else "gpu_check: PASS (skipped checks named above)", flush=True)
    box = [failed]
    torch.distributed.broadcast_object_list(box, src=0)
    dapo._shut_down(exiting=True)  # as dapo.py's own end: the process ends next
    return 1 if box[0] else 0


if __name__ == "__main__":
    gc.disable()  # as dapo.py's own start and end: set_up turns it back on once vLLM is up
    try:
        code = main()
    except dapo.DapoError as e:  # bad input, before anything ran
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    dapo.exit_now(code)
