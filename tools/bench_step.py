"""Phase breakdown of dapo.py's rollout step on a fixed synthetic workload.

    python tools/bench_step.py                    # 32 prompts x 8 responses, max 256 tokens, mu = 1
    python tools/bench_step.py --seeds            # generation only: unseeded / per-request seeds / per call
    python tools/bench_step.py --precision fp32 bf16 --tis-cap 2   # both precisions, side by side, one run
    python tools/bench_step.py --no-shared-prefix # a copy of the prompt per response in the update (--shared-prefix:
                                                  # each group's prompt once; neither: where it pays, the default)
    python tools/bench_step.py --ways default plain shared   # the update each way on the same samples, one process
    python tools/bench_step.py --ways default plain --model $(python tools/real_model.py) \
        --train-data data/chain/train.jsonl --prompts 8 --max-response-len 64 --num-mini-batches 4  # the ladder's
    python tools/bench_step.py --profile ...      # and the last step's update and generation under torch.profiler

A random-init tiny Qwen2 (the demo's shape, vocabulary 128, fp32): EOS is one token in 128, so
responses average ~110 tokens at a maximum of 256, ragged as DAPO's are. Dynamic sampling off,
one gradient update per rollout step (--num-mini-batches 1), the demo's micro-batch size (256
sequences) unless --micro-batch-tokens is given. Prints the medians over --steps steps after
--warmup steps: generation, reward, update, sync, the whole step, and the update per real
(prompt + response) token. It calls dapo.py's own functions, so it measures the code that trains.
--ways times the update once per way (--shared-prefix resolved: default, shared, plain) on copies of each
step's samples, step k starting with way k mod (the number of ways), so that no way always runs first, and
prints each way's median and its ratio to plain's. --model and --train-data replace the tiny model and the
built-in task (dapo.py's presets for the model apply: the laptop preset for tools/real_model.py's).
--profile runs the last step's update once more under torch.profiler and adds up every operator's own time by
part (PARTS: matrix products, attention, the head, FSDP2's casts and copies, AdamW, clipping, the rest) and the
largest operators outside the matrix products and attention, then prints the update over those two together; then
the last step's generation batch once more, its operators by their own time.
"""
import argparse
import copy
import dataclasses
import os
import statistics
import sys
import tempfile
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # dapo.py's checkout
import torch  # noqa: E402

import dapo  # noqa: E402
from lib import demo_model  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-response-len", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=256)
    p.add_argument("--micro-batch-tokens", type=int, default=0)
    p.add_argument("--seeds", action="store_true", help="time generation alone under three seeding schemes")
    p.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "bf16"],
                   help="dapo.py's --precision; several: each in a process of its own, one after the other")
    p.add_argument("--tis-cap", type=float, default=0.0, help="dapo.py's --tis-cap (its tis/* shares are printed)")
    p.add_argument("--shared-prefix", action=argparse.BooleanOptionalAction, default=None,
                   help="dapo.py's --shared-prefix (a group's prompt forwarded once in the update); neither flag: "
                        "dapo.py's default, where it pays")
    p.add_argument("--ways", nargs="+", default=[], choices=list(WAYS),
                   help="time the update each way on the same samples, in one process, step k starting with way k mod their number")
    p.add_argument("--model", default="", help="a model directory instead of the random tiny Qwen2")
    p.add_argument("--train-data", default="", help="with --model: its data file instead of the built-in task")
    p.add_argument("--num-mini-batches", type=int, default=1)
    p.add_argument("--profile", action="store_true",
                   help="after the timed steps, the last step's update (by part: PARTS) and generation again under "
                        "torch.profiler")
    a = p.parse_args()
    if len(a.precision) > 1:
        return side_by_side(a)
    from transformers import AutoTokenizer
    path = a.model or os.path.join(tempfile.mkdtemp(prefix="bench_step_"), "model")
    if a.model:  # dapo.py's presets for it apply (the laptop preset for tools/real_model.py's), as dapo.py runs it
        flags = ["--model", a.model, "--prompts-per-step", str(a.prompts), "--group-size", str(a.group_size),
                 "--gen-batch-size", str(a.prompts), "--no-dynamic-sampling", "--max-response-len",
                 str(a.max_response_len), "--overlong-cache-len", str(a.max_response_len // 4), "--num-mini-batches",
                 str(a.num_mini_batches), "--train-data", a.train_data]
        cfg = dapo.parse_config(flags + (["--tis-cap", str(a.tis_cap)] if a.tis_cap else [])
                                + (["--max-sync-diff", "0"] if a.ways else []))  # a way after the first: π_θ moved
    else:
        # the demo's tokenizer, widened to 128 tokens: EOS is one token in 128
        model, tok = demo_model.tiny_qwen2(demo_model.DEMO_TOKENS, vocab=128, max_len=16 + a.max_response_len,
                                           fill=True)
        model.save_pretrained(path)
        tok.save_pretrained(path)
        cfg = dapo.Config(model=path, prompts_per_step=a.prompts, group_size=a.group_size, gen_batch_size=a.prompts,
                          dynamic_sampling=False, max_prompt_len=16, max_response_len=a.max_response_len,
                          overlong_cache_len=a.max_response_len // 4, num_mini_batches=a.num_mini_batches,
                          micro_batch_size=a.micro_batch_size, micro_batch_tokens=a.micro_batch_tokens, lr=1e-6,
                          warmup_steps=1, precision=a.precision[0], tis_cap=a.tis_cap, shared_prefix=a.shared_prefix)
    device = dapo.init_distributed()
    getattr(dapo, "keep_freed_memory", lambda: None)()  # (this tool also profiles older checkouts: --profile)
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = dapo.load_data(cfg.train_data, cfg.dedup, False) if a.train_data else demo_model.demo_task(cfg.seed)[0]
    prompt_ids = dapo.encode_prompts(tokenizer, [r["prompt"] for r in rows])
    llm = dapo.start_engine(cfg, path, device)
    torch.manual_seed(cfg.seed)
    model = dapo.load_policy(cfg, path, device)
    opt = dapo.adamw(model, cfg) if hasattr(dapo, "adamw") else torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)  # older dapo.py: torch's default AdamW
    dapo.sync_weights(model, llm)
    sampler = dapo.Sampler(len(rows), cfg.seed)
    run = bench_run(cfg, llm, tokenizer, model, opt, device)
    if a.seeds:
        return bench_seeds(a, cfg, llm, sampler, prompt_ids)
    rec = []
    for step in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        idx = sampler.take(a.prompts)
        groups, t = dapo.sample_groups(run, rows, prompt_ids, idx, cfg.group_size, cfg.temperature, cfg.top_p,
                                       (cfg.seed, step, 0))
        samples = [s for g in groups for s in g]
        dapo.shape_rewards(samples, cfg)
        dapo.set_advantages(samples, cfg)
        dapo.overlong_filtering(samples, cfg)
        last = copy.deepcopy(samples) if a.profile else None
        ways, turn = {}, step % max(1, len(a.ways))
        t1 = time.perf_counter()
        for way in a.ways[turn:] + a.ways[:turn]:  # each step another way first
            ways[way] = update_one_way(run, cfg, copy.deepcopy(samples), step, way)
        if not a.ways:
            dapo.distribute(samples, cfg, run.share)
            m = dapo.update_policy(run, samples, step + 1)
        t2 = time.perf_counter()
        if a.ways:  # the step's update: the first way's
            update, m = ways[a.ways[0]]
            t1 = t2 - update
        dapo.sync_weights(model, llm)
        t3 = time.perf_counter()
        lens = [s["len"] for s in samples]
        tokens = sum(len(s["prompt_ids"]) for s in samples) + sum(lens)
        r = {"generation": t["time/rollout"], "reward": t["time/reward"], "update": t2 - t1, "sync": t3 - t2,
             "step": t3 - t0, "update_per_token": (t2 - t1) / tokens,
             "mean_len": sum(lens) / len(samples), "tokens": tokens,
             **{k: m[k] for k in m if k.startswith(("sync/logp", "mismatch/", "tis/"))},
             **{f"update ({w})": s for w, (s, _) in ways.items()},
             **{f"tokens forwarded ({w})": mw["update/tokens"] for w, (_, mw) in ways.items()}}
        dapo.print0(f"step {step}{' (warm-up)' if step < a.warmup else ''}: " +
                    "  ".join(f"{k} {v * 1e3:.0f} ms" for k, v in r.items() if k in ("generation", "update", "step")) +
                    f"  mean response {r['mean_len']:.1f}")
        if step >= a.warmup:
            rec.append(r)
    med = {k: statistics.median(x[k] for x in rec) for k in rec[0]}
    dapo.print0(f"median of {a.steps} steps ({a.prompts} prompts x {a.group_size}, max {a.max_response_len} tokens, "
                f"mean response {med['mean_len']:.1f}, {med['tokens']:.0f} real tokens per step):")
    for k in ("generation", "reward", "update", "sync", "step"):
        dapo.print0(f"  {k:<11} {med[k] * 1e3:8.0f} ms")
    for w in a.ways:
        ratio = f" ({med[f'update ({w})'] / med['update (plain)']:.2f}x plain's)" if "plain" in a.ways else ""
        dapo.print0(f"  update ({w}) {med[f'update ({w})'] * 1e3:8.0f} ms{ratio}, "
                    f"{med[f'tokens forwarded ({w})']:,.0f} tokens forwarded")
    dapo.print0(f"  update per real token {med['update_per_token'] * 1e6:8.1f} us")
    for k in sorted(k for k in med if "/" in k):
        dapo.print0(f"  {k:<24} {med[k]:.3g}")
    if a.profile:
        profile_update(run, cfg, last, step + 1)  # update_policy counts steps from 1
        profile_generation(run, rows, prompt_ids, idx, cfg, (cfg.seed, step, 0))


# --profile's parts, in the order printed: every operator's own (self) time goes to the first that claims it
PARTS = ("matrix products, decoder", "matrix products, head", "attention (sdpa)", "head, element-wise",
         "FSDP2's casts and copies", "AdamW's step", "gradient clipping", "decoder element-wise, the rest")


def profile_update(run, cfg, samples, step):
    """update_policy on `samples` under torch.profiler: each operator's own time by PARTS (the head: what runs in
    dapo.py's head functions, forward, recomputed or backward; FSDP2: what its FSDP:: scopes run), the update's wall
    time, and the update over its matrix products and attention together."""
    import functools
    from torch.autograd.profiler import record_function
    from torch.profiler import profile

    def scoped(fn, scope, *args, **kw):
        with record_function(scope):
            return fn(*args, **kw)

    kept = {}  # _chunk_logprobs: the head of dapo.py before _head_pass, for profiles of older checkouts
    for name, scope in (("token_logprobs", "head"), ("_head_pass", "head"), ("_chunk_logprobs", "head"),
                        ("clip_gradients", "clip")):
        if not hasattr(dapo, name):
            continue
        kept[name] = getattr(dapo, name)
        setattr(dapo, name, functools.partial(scoped, kept[name], scope))
    dapo.distribute(samples, cfg, run.share)
    # these samples were trained on once: the sync check would see that step as a gap between vLLM and the trainer
    run.cfg = dataclasses.replace(cfg, max_sync_diff=0.0)
    try:
        with profile() as prof:
            t = time.perf_counter()
            dapo.update_policy(run, samples, step)
            wall = time.perf_counter() - t
    finally:
        run.cfg = cfg
        for name, fn in kept.items():
            setattr(dapo, name, fn)

    def up(e):  # e and the events it runs within
        while e is not None:
            yield e
            e = e.cpu_parent

    events = prof.events()
    # the head's backward: the autograd nodes of operators its forward ran (the same sequence number)
    in_head = {e.sequence_nr for e in events if e.sequence_nr >= 0 and any(p.name == "head" for p in up(e))}
    total, by_op = dict.fromkeys(PARTS, 0.0), {}
    for e in events:
        names = [p.name for p in up(e)]
        head = "head" in names or any(p.name.startswith("autograd::engine") and p.sequence_nr in in_head
                                      for p in up(e))
        if any(n.startswith("Optimizer.step") for n in names):
            part = "AdamW's step"
        elif e.name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"):
            part = "matrix products, head" if head else "matrix products, decoder"
        elif "scaled_dot_product" in e.name:
            part = "attention (sdpa)"
        elif any(n.startswith("FSDP::") for n in names):
            part = "FSDP2's casts and copies"
        elif head:
            part = "head, element-wise"
        elif "clip" in names:
            part = "gradient clipping"
        else:
            part = "decoder element-wise, the rest"
        total[part] += e.self_cpu_time_total / 1e6
        by_op[part, e.name] = by_op.get((part, e.name), 0.0) + e.self_cpu_time_total / 1e6
    ops = sum(total.values())
    dapo.print0("profile of one update (torch.profiler; each operator's own time, by part):")
    for part, t in total.items():
        dapo.print0(f"  {part:<32} {t:7.2f} s  {t / ops:6.1%}")
    dapo.print0("  the largest operators outside the matrix products and attention:")
    rest = [(k, t) for k, t in by_op.items() if k[0] not in PARTS[:3]]
    for (part, name), t in sorted(rest, key=lambda kt: -kt[1])[:10]:
        dapo.print0(f"    {name[:44]:<44} {t:6.2f} s  ({part})")
    arithmetic = sum(total[k] for k in PARTS[:3])
    dapo.print0(f"  update {wall:.2f} s (its operators {ops:.2f} s); matrix products and attention {arithmetic:.2f} s: "
                f"the update is {wall / arithmetic:.2f}x them")


def profile_generation(run, rows, prompt_ids, idx, cfg, key):
    """The last step's generation batch again (sample_groups: vLLM's generate, with the policy's weights after the
    step's sync, and the reward) under torch.profiler: its wall time and the operators over 3% of their total."""
    from torch.profiler import profile
    with profile() as prof:
        t = time.perf_counter()
        dapo.sample_groups(run, rows, prompt_ids, idx, cfg.group_size, cfg.temperature, cfg.top_p, key)
        wall = time.perf_counter() - t
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in ops) / 1e6
    dapo.print0(f"profile of one generation batch: {wall:.2f} s (its operators {total:.2f} s); each operator's own "
                f"time, those over 3%:")
    for e in ops:
        if e.self_cpu_time_total / 1e6 < 0.03 * total:
            break
        dapo.print0(f"  {e.key[:48]:<48} {e.self_cpu_time_total / 1e6:6.2f} s {e.count:7d} calls")


def bench_run(cfg, llm, tokenizer, model, opt, device):
    """The run update_policy and sample_groups read, as dapo.py's set_up and steps_left make it (gpu: each phase's
    GPU memory, which gpu_phase writes on CUDA)."""
    return types.SimpleNamespace(cfg=cfg, llm=llm, tokenizer=tokenizer, model=model, opt=opt, device=device,
                                 share=dapo.sharing(cfg, model.config), pad_id=tokenizer.pad_token_id, state={},
                                 step=0, gpu={}, sleep=False, clock={})


WAYS = {"default": None, "shared": True, "plain": False}  # --shared-prefix: neither flag, given, --no-


def update_one_way(run, cfg, samples, step, way):
    """update_policy on these samples with --shared-prefix as `way` (WAYS): (its seconds, its metrics)."""
    run.cfg = dataclasses.replace(cfg, shared_prefix=WAYS[way])
    run.share = dapo.sharing(run.cfg, run.model.config)
    dapo.distribute(samples, run.cfg, run.share)
    t = time.perf_counter()
    m = dapo.update_policy(run, samples, step + 1)
    seconds = time.perf_counter() - t
    run.cfg, run.share = cfg, dapo.sharing(cfg, run.model.config)
    return seconds, m


def side_by_side(a):
    """Each --precision in a process of its own (one engine per process), then their medians side by side."""
    import re
    import subprocess
    rows = {}
    for precision in a.precision:
        argv = [x for x in sys.argv[1:] if x not in a.precision and x != "--precision"]
        out = subprocess.run([sys.executable, __file__, *argv, "--precision", precision], capture_output=True,
                             text=True, check=True).stdout
        print(out, flush=True)
        rows[precision] = dict(re.findall(r"^  (\S[^ ]*(?: per real token)?)\s+([-\d.e+]+)", out, re.M))
    names = list(rows[a.precision[0]])
    print(f"| | {' | '.join(a.precision)} | {a.precision[1]} / {a.precision[0]} |\n|---|" + "---|" * (len(a.precision) + 1))
    for k in names:
        v = [float(rows[p].get(k, "nan")) for p in a.precision]
        ratio = f"{v[1] / v[0]:.2f}" if "/" not in k and v[0] else "-"   # times: a ratio; statistics: values
        print(f"| {k} | {' | '.join(f'{x:.4g}' for x in v)} | {ratio} |")


def bench_seeds(a, cfg, llm, sampler, prompt_ids):
    """The same generate call, three ways: unseeded, one seed per request (SamplingParams(seed=...)),
    and one seed per call through the engine's global generators (seeded_engine, what dapo.py does).
    Also checks that two per-call runs with one seed give the same tokens."""
    from vllm import SamplingParams
    idx = sampler.take(a.prompts)
    prompts = [{"prompt_token_ids": prompt_ids[i]} for i in idx]
    # ignore_eos: every sequence runs to max_tokens, so the three ways do exactly the same work
    kw = dict(n=cfg.group_size, temperature=1.0, max_tokens=cfg.max_response_len, logprobs=0, ignore_eos=True)

    def unseeded():
        return llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)

    def per_request():
        return llm.generate(prompts, [SamplingParams(**kw, seed=1000 + j) for j in range(len(prompts))], use_tqdm=False)

    def per_call():
        with dapo.seeded_engine(llm, 1234):
            return llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)

    times = {f.__name__: [] for f in (unseeded, per_request, per_call)}
    lens = {}
    for rep in range(a.warmup + a.steps):
        for f in (unseeded, per_request, per_call):  # interleaved: drift hits all three alike
            t = time.perf_counter()
            out = f()
            if rep >= a.warmup:
                times[f.__name__].append(time.perf_counter() - t)
            lens[f.__name__] = sum(len(o.token_ids) for r in out for o in r.outputs) / (len(prompts) * cfg.group_size)
    again = [list(o.token_ids) for r in per_call() for o in r.outputs]
    first = [list(o.token_ids) for r in per_call() for o in r.outputs]
    print(f"generation of {a.prompts} prompts x {cfg.group_size} x {cfg.max_response_len} tokens (EOS ignored) "
          f"(medians of {a.steps}):")
    base = statistics.median(times["unseeded"])
    for k, v in times.items():
        print(f"  {k:<12} {statistics.median(v) * 1e3:7.0f} ms  ({statistics.median(v) / base:.3f}x unseeded)  "
              f"mean response {lens[k]:.1f}")
    print(f"  per_call reproduces: {again == first}")


if __name__ == "__main__":
    main()
