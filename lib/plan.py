"""
plan.py: what one GPU and one node's host RAM hold, phase by phase, for a dapo.py config; the arithmetic
behind tools/plan.py (the user's table) and dapo.py's memory check on CUDA (preflight, before vLLM starts).
The plan is a worst case: every sequence at its maximum length. Its callers pass in what it cannot read from
the config (the GPU, the nodes, the export's bytes per parameter); it needs no GPU, weights or data.
"""

import contextlib
import dataclasses
import math
import os

from lib.check_data import check_model

GB = 1e9
# Every planned peak must stay under this share of the GPU. What it covers: the allowances below are read from
# public reports, not measured for this program (NCCL's and the CUDA-graph pool's could each be off by a GB or
# two); the activation model is checked on CPU only (0.94-1.00x of the measured peak, tests/test_tools.py); and
# kernels take workspaces the plan does not list (cuBLAS, flex attention's compiled kernels). 10% is 8 GB of an
# 80 GB GPU, more than any of these alone.
HEADROOM = 0.90

# What a GPU holds beyond the tensors the plan counts one by one: allowances, each from the source named.
# The CUDA context and the kernels loaded into it, once per process (trainer and vLLM share one): torch alone
# takes 0.29 GB with lazy loading (PyTorch #86509); with NCCL initialised, 1.06 GB of an H100 was outside torch's
# allocator (NVIDIA/nccl#1685).
CUDA_CONTEXT_GB = 1.0
# One NCCL communicator's buffers: 688 MB for a group of more than 2 A100s on NVLink after an all-reduce
# (NVIDIA/nccl#964; its maintainers in NVIDIA/nccl#986: more channels, more memory). The trainer's process group
# has one (FSDP's all-gathers and reduce-scatters), made at its first CUDA collective; at TP > 1 vLLM's TP group
# has another (PyNcclCommunicator, vllm/distributed/device_communicators/cuda_communicator.py; vLLM's other groups,
# pp, dp, dcp, are of size 1 under external_launcher and create none).
NCCL_GROUP_GB = 0.7
# vLLM's TP all-reduce buffers beside its communicator, at TP > 1: the custom all-reduce's IPC buffers (8 MiB
# + 16 MiB + 8 MiB, custom_all_reduce.py CustomAllreduce.__init__) and torch symmetric memory (up to 128 MiB,
# all_reduce_utils.py SYMM_MEM_ALL_REDUCE_MAX_SIZES). Made before vLLM's memory snapshot (gpu_worker.py
# init_device), so outside --gpu-memory-utilization, and kept while vLLM sleeps.
TP_BUFFERS_GB = 0.2
# load_hf_weights scatters each tensor from rank 0 (torch's scatter on NCCL is a send to every rank), and NCCL
# keeps the connections' buffers: an all-to-all among 8 H100s added 3.28 GB per GPU, 0.23 GB per peer and
# direction (NVIDIA/nccl#1685); a peer on another node takes 2 channels (NCCL_NCHANNELS_PER_NET_PEER) of 4 MiB
# (NCCL_BUFFSIZE). Rank 0, which sends to every other rank, holds the most.
PEER_SAME_NODE_GB = 0.23
PEER_OTHER_NODE_GB = 2 * 4 * 2**20 / GB
# What vLLM keeps on the GPU asleep at level 2. Its weights, KV cache and workspace are unmapped and its
# "runtime" pool goes to CPU RAM (vllm/device_allocator/sleep_mode_backend.py CuMemBackend.suspend), and the
# sleep empties torch's cache (CuMemAllocator.sleep ends in torch.cuda.empty_cache()), so its activations leave
# nothing behind. What stays: the CUDA-graph pool, which only ModelConfig.sleep_mode_offload_cudagraph (off by
# default, not set by dapo.py) would move to CPU RAM, and the model runner's input buffers. vLLM prints the
# pool's size at start-up ("Estimated CUDA graph memory"): 0.2-1.6 GiB in public logs (vLLM #39559: 51 piecewise
# and 35 full graphs, 1.62 GiB). The same allowance is taken out of the KV cache while awake: vLLM counts the
# pool inside --gpu-memory-utilization (gpu_worker.py determine_available_memory).
VLLM_ASLEEP_GB = 2.0
# vLLM's own activations while generating, inside --gpu-memory-utilization (profiled at start-up): a forward
# pass of max_num_batched_tokens (16384 on an H100 for the LLM class, engine/arg_utils.py) and the sampler's
# fp32 logits for up to 1024 sequences (0.6 GB at a vocabulary of 152k).
VLLM_ACTIVATIONS_GB = 2.0
# The caching allocator's fragmentation (reserved - allocated) in the trainer, whose micro-batches change shape
# every time (expandable segments stay off: vLLM #42609): 25% of what it reserves for them, that is a third of
# what the trainer allocates and frees per micro-batch (activations, gathered layers). GMLake (ASPLOS 2024)
# found 15% on average and up to 33% of reserved memory lost to fragmentation in fine-tuning eight LLMs with
# recomputation, ZeRO and LoRA on A100s of 80 GB.
FRAGMENTATION = 1 / 3
# What the trainer allocates beyond the tensors counted one by one, on a GPU: cuBLAS's and cuBLASLt's workspaces
# (torch takes them from its caching allocator: 32 MiB each per handle on Hopper, CUDABlas.cpp
# getChosenWorkspaceSize, and forward and backward run on two threads, two handles), RoPE's inv_freq and its
# cos/sin tables, the loss's scalars, AdamW's step counts.
OTHER_GB = 0.5

# Shapes for planning when the model's config is not on disk (hidden, layers, heads, kv heads,
# intermediate, vocab, tied embeddings), from the Qwen2.5 base models' config.json files.
KNOWN_MODELS = {"Qwen2.5-0.5B": (896, 24, 14, 2, 4864, 151936, True),
                "Qwen2.5-1.5B": (1536, 28, 12, 2, 8960, 151936, True),
                "Qwen2.5-7B": (3584, 28, 28, 4, 18944, 152064, False),
                "Qwen2.5-14B": (5120, 48, 40, 8, 13824, 152064, False),
                "Qwen2.5-32B": (5120, 64, 40, 8, 27648, 152064, False),
                "Qwen2.5-72B": (8192, 80, 64, 8, 29568, 152064, False)}
DEMO_SHAPE = (128, 2, 2, 2, 512, 32, True, 64)  # the built-in model (lib/demo_model.py's tiny_qwen2)


def model_shape(name):
    """(hidden, layers, heads, kv_heads, intermediate, vocab, tied, head_dim) of a model; "" is the built-in one."""
    if not name:
        return DEMO_SHAPE
    key = os.path.basename(name.rstrip("/"))
    if key in KNOWN_MODELS and not os.path.isdir(name):
        h, L, nh, kv, i, V, tied = KNOWN_MODELS[key]
        return h, L, nh, kv, i, V, tied, h // nh
    c = check_model(name)
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size, bool(c.tie_word_embeddings), hd)


def activation_bytes(shape, tokens, b, checkpointing, chunk, seq=None, flash=True, kv_copy=False):
    """Peak activation memory of one micro-batch's forward + backward, in bytes.
    Per decoder layer and token HF's Qwen2 keeps: two RMSNorm inputs in fp32 (2h x 4 B) and their
    outputs (2h x b), q/k/v (h + 2 kv_dim), the attention output twice (2h: sdpa out, o_proj
    input), and four (T, intermediate) MLP tensors: gate, up, silu(gate), their product.
    Checkpointing keeps one (T, h) input per layer instead. On top of that, backward peaks either
    in one layer (recomputed activations and gradient temporaries) or in the fused head: 2 fp32
    (chunk, V) tensors (dapo._head_pass's logits and their exponentials, which _Head's backward turns into
    the logits' gradient in place), or one and a chunk's (V, h) weight gradient, whichever is larger, beside
    the fp32 gradient the chunks add into and (in bf16) an fp32 copy of the head weight.
    No (T, V) logits tensor exists. Without flash attention (CPU), sdpa's backward materialises
    (heads, S, S) twice per sequence of length S. Measured on CPU in the tests.
    kv_copy: transformers' flex attention copies the KV heads up to the query heads where their count is
    not a power of two (integrations/flex_attention.py: enable_gqa only for powers of two, else repeat_kv):
    K and V of every query head, per layer and token, which flex keeps for backward."""
    h, L, nh, kv, i, V, tied, hd = shape
    layer = 2 * h * 4 + (2 * h + h + 2 * kv * hd + 2 * h + 4 * i + (2 * nh * hd if kv_copy else 0)) * b
    kept = tokens * (L * h * b if checkpointing else L * layer)
    one_layer = tokens * layer * (2 if checkpointing else 1)
    n = min(chunk, tokens)
    head = max(2 * n * V, n * V + V * h) * 4 + V * h * 4 * (2 if b == 2 else 1)
    seq = seq or tokens
    attn = 0 if flash else 2 * nh * seq * seq * b * max(1, tokens // seq)
    return kept + max(one_layer, head) + attn


def lora_params(shape, rank):
    """Parameters of --lora-rank r's adapters: r (in + out) for each of a layer's q, k, v, o, gate, up, down."""
    h, L, nh, kv, i, V, tied, hd = shape
    q, k = nh * hd, kv * hd
    return L * rank * ((h + q) + 2 * (h + k) + (q + h) + 2 * (h + i) + (i + h))


def micro_batch_tokens(cfg):
    """Tokens of the largest micro-batch: --micro-batch-tokens, but never less than one max-length sequence
    (pack_by_tokens gives a longer one a micro-batch of its own), or --micro-batch-size max-length sequences."""
    seq = cfg.max_prompt_len + cfg.max_response_len
    return max(cfg.micro_batch_tokens, seq) if cfg.micro_batch_tokens else cfg.micro_batch_size * seq


def compute_bytes(cfg, device):
    """Bytes of the compute dtype: bf16 on a GPU by default or under --precision bf16, fp32 otherwise."""
    return 4 if cfg.precision == "fp32" else 2 if device == "cuda" or cfg.precision == "bf16" else 4


def trainer_bytes(cfg, shape, world, device="cuda", layout=None):
    """What the trainer holds on one of `world` ranks, term by term (bytes), as memory_plan counts it and as
    tools/trainer_check.py sets it beside what a GPU measures: the sharded states (fp32 parameters, AdamW's m
    and v; with --kl-coef the reference), the gradients (only between a mini-batch's first backward and its
    optimizer step), FSDP's gathered layers, one micro-batch's activations and logits, flex's copied KV heads,
    the allocator's fragmentation. AdamW's step adds nothing: torch's fused kernel (dapo.adamw;
    torch/optim/adam.py, _fused_adam) updates each parameter and its moments in place. With --cpu-offload the
    states live in CPU RAM. On a CPU (sdpa) layout gives the largest micro-batch as dapo.py cuts it
    (cpu_layout): its tokens, its longest row, and the positions of its shared sequences, whose dense (L, L)
    masks sdpa keeps in every layer."""
    h, L, nh, kv, i, V, tied, hd = shape
    per_layer = h * h * 2 + 2 * h * kv * hd + h + 2 * kv * hd + 3 * h * i + 2 * h
    P = V * h * (1 if tied else 2) + L * per_layer + h
    b = compute_bytes(cfg, device)
    on_gpu = 0 if cfg.cpu_offload else 1
    A = lora_params(shape, cfg.lora_rank)       # --lora-rank: only the adapters have gradients and AdamW state
    T = A if cfg.lora_rank else P               # the trained parameters
    out = {"params": P, "adapters": A, "parameters": 4 * (P + A) / world * on_gpu, "gradients": 4 * T / world * on_gpu,
           "adamw": 8 * T / world * on_gpu,
           "reference": b * P / world * on_gpu if cfg.kl_coef and not cfg.lora_rank else 0}
    cuda = device == "cuda"
    out["other"] = OTHER_GB * GB if cuda else 0
    unit = max(h * h * 2 + 2 * h * kv * hd + 3 * h * i, V * h * (1 if tied else 2))  # a layer, or the root
    # FSDP all-gathers one unit (and prefetches the next); one CPU process keeps every layer's copy from its forward
    # to its backward (dapo.load_policy's reshard_after_forward)
    out["gathered"] = (P if world == 1 and device == "cpu" else 2 * unit) * b
    seq = cfg.max_prompt_len + cfg.max_response_len
    tokens, longest, shared = layout or (micro_batch_tokens(cfg), seq, ())
    out["tokens"] = tokens
    acts = activation_bytes(shape, tokens, b, cfg.grad_checkpointing, cfg.logprob_chunk, longest, flash=cuda)
    flex = cuda and (cfg.attn_impl or "flex_attention") == "flex_attention" and nh & (nh - 1) != 0
    out["kv_copy"] = (activation_bytes(shape, tokens, b, cfg.grad_checkpointing, cfg.logprob_chunk, seq, flash=cuda,
                                       kv_copy=True) - acts) if flex else 0  # 0 where the head's chunks peak higher
    out["masks"] = sum(n * n for n in shared) * b * L  # sdpa's dense masks of shared sequences, saved per layer
    acts = out["activations"] = acts + out["masks"]
    out["fragmentation"] = FRAGMENTATION * (out["gathered"] + acts + out["kv_copy"])
    out["resident"] = out["parameters"] + out["adamw"] + out["reference"]  # held from loading to the end
    out["training"] = out["resident"] + out["gradients"] + out["gathered"] + acts + out["kv_copy"] + out["other"]
    out["stepping"] = out["resident"] + out["gradients"] + out["other"]  # opt.step(), in place
    return out


def memory_plan(cfg, shape, nodes, gpus_per_node, gpu_gb, device="cuda", weight_file=None, host_ram_gb=1000.0,
                export_bytes=2):
    """Bytes per GPU, by phase, and host RAM per node (host_plan). Returns (rows of (name, bytes), verdict
    dict). Each phase's peak adds what it holds: loading (load_hf_weights, vLLM awake), training (vLLM asleep),
    AdamW's step (in place, the activations gone) and generating (no gradients), each with the CUDA
    context and NCCL's buffers. gpu_gb is the GPU's memory as torch reports it (total_memory / 1e9: ~85.0 for
    an "80 GB" H100), of which vLLM takes --gpu-memory-utilization. The GPU fits when every peak stays under
    HEADROOM of gpu_gb and vLLM's KV cache holds one max-length sequence; "fits" needs the host side
    (host_ram_gb) too. export_bytes: 2 or 4 per parameter (dapo.py's export_dtype)."""
    h, L, nh, kv, i, V, tied, hd = shape
    W = nodes * gpus_per_node
    t = trainer_bytes(cfg, shape, W, device)
    P, A, tokens, kv_copy = t["params"], t["adapters"], t["tokens"], t["kv_copy"]
    b = compute_bytes(cfg, device)
    states = {"sharded fp32 parameters" + (" (base + adapters)" if A else ""): t["parameters"],
              "sharded fp32 gradients": t["gradients"], "sharded AdamW state (m, v)": t["adamw"]}
    if t["reference"]:  # the frozen reference (with LoRA: the policy, adapters off), sharded
        states[f"sharded reference ({'bf16' if b == 2 else 'fp32'}, --kl-coef)"] = t["reference"]
    seq = cfg.max_prompt_len + cfg.max_response_len
    vllm_weights = 2 * P / cfg.tp_size
    vllm_total = cfg.gpu_memory_utilization * gpu_gb * GB
    kv_per_token = 2 * L * kv * hd * 2 / cfg.tp_size
    kv_cache = vllm_total - vllm_weights - (VLLM_ACTIVATIONS_GB + VLLM_ASLEEP_GB) * GB
    asleep = VLLM_ASLEEP_GB * GB if cfg.vllm_sleep else vllm_total
    context = CUDA_CONTEXT_GB * GB
    tp = cfg.tp_size > 1
    peers_here, peers_away = min(W, gpus_per_node) - 1, max(W - gpus_per_node, 0)
    nccl = (NCCL_GROUP_GB + tp * (NCCL_GROUP_GB + TP_BUFFERS_GB) + peers_here * PEER_SAME_NODE_GB
            + peers_away * PEER_OTHER_NODE_GB) * GB
    process = context + nccl
    train_peak = t["training"] + t["fragmentation"] + asleep + process
    step_peak = t["stepping"] + asleep + process
    rollout_peak = t["resident"] + vllm_total + process  # update_policy ends in zero_grad(set_to_none=True)
    # load_hf_weights: vLLM is awake; each tensor arrives whole on every GPU (bf16), then its shard is kept
    biggest = max(V, i) * h                     # elements of the largest tensor: the embedding
    load_peak = t["parameters"] + vllm_total + biggest * 2 + process
    rows = [(k, v) for k, v in states.items()] + [
        ("FSDP all-gathered layers (bf16)", t["gathered"]),
        (f"activations + logits, {tokens} tokens/micro-batch", t["activations"])]
    if kv_copy:
        rows.append((f"KV heads copied for flex attention ({nh} heads)", kv_copy))
    rows += [
        ("fragmentation, 1/3 of gathered + " + ("acts + KV copy" if kv_copy else "activations"), t["fragmentation"]),
        ("other allocations (cuBLAS workspaces, RoPE tables)", t["other"]),
        (f"vLLM weights (bf16, TP {cfg.tp_size})", vllm_weights), ("vLLM KV cache", kv_cache),
        ("vLLM asleep: CUDA-graph pool, buffers" if cfg.vllm_sleep else "vLLM awake while training (--no-vllm-sleep)",
         asleep),
        ("CUDA context and kernels", context),
        ("NCCL: trainer" + (f", rank 0 to {W - 1} ranks" if W > 1 else "") + (", vLLM TP" if tp else ""), nccl),
        ("peak while loading (the largest tensor whole)", load_peak), ("peak while training", train_peak),
        ("peak while stepping AdamW", step_peak), ("peak while generating", rollout_peak),
        # every rank streams the full tensors (a tied lm_head as well: state_dict has it), its vLLM keeps its TP part
        ("weight sync per step, streamed by each rank (bf16" + (", adapters merged" if A else "") + ")",
         2 * (P + (V * h if tied else 0)))]
    peaks = {"peak while loading": load_peak, "peak while training": train_peak,
             "peak while stepping AdamW": step_peak, "peak while generating": rollout_peak}
    limit = HEADROOM * gpu_gb * GB
    kv_fits = kv_cache >= kv_per_token * seq
    gpu_fits = max(peaks.values()) <= limit and kv_fits
    if weight_file is None:
        weight_file = min(5 * GB, 2 * P)
    host, host_peak = host_plan(cfg, shape, P, W, gpus_per_node, weight_file, export_bytes)
    host_fits = host_peak <= host_ram_gb * GB
    return rows, {"params": P, "adapters": A, "fits": gpu_fits and host_fits, "gpu_fits": gpu_fits,
                  "host_fits": host_fits, "kv_seqs": kv_cache / (kv_per_token * seq), "kv_fits": kv_fits,
                  "kv_needed": kv_per_token * seq, "kv_cache": kv_cache, "world": W, "host": host,
                  "host_peak": host_peak, "peaks": peaks, "limit": limit, "trainer": t}


# Assumed, not measured on a GPU: one rank's torch, CUDA context, vLLM and reward workers.
HOST_GB_PER_RANK = 4

# A run on a CPU (the laptop preset): one machine's memory for every rank it runs. Besides the tensors the plan
# counts, each rank's process holds torch, transformers and vLLM with its engine, and each reward worker sympy and
# the checker (CPU_PROCESS_GB, REWARD_WORKER_GB: RSS measured on dapo.py's processes, tools/memwatch.py); and what
# glibc's allocator keeps of the memory the update frees (dapo.keep_freed_memory keeps up to 1 GiB free in the
# heap), which the next micro-batch and vLLM's next generation do not reuse in full: CPU_KEPT times one
# micro-batch's transient memory (activations, gathered layers), a bound: the most any of tools/bench_prefix.py's
# shapes implied by the peak of all its processes was 1.31, on long responses (docs/throughput.md). A run plans
# to use at most CPU_HEADROOM of the machine's memory (MemTotal, or a cgroup's limit), leaving the rest to the
# system.
CPU_PROCESS_GB = 1.5
REWARD_WORKER_GB = 0.2
CPU_KEPT = 1.35
CPU_HEADROOM = 0.75


# Where a container's memory limit is set (cgroup v2, then v1), at the hierarchy's root and at this process's own
# cgroup (/proc/self/cgroup): a run over it is killed, not refused
CGROUP_LIMITS = ("/sys/fs/cgroup{}/memory.max", "/sys/fs/cgroup/memory{}/memory.limit_in_bytes")


def machine_gb():
    """The machine's memory, GB (MemTotal), or a cgroup's limit where one is set lower: the same on every run,
    unlike what is free."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    own = {"": "", "memory": ""}  # this process's cgroup: v2's line "0::/path", v1's memory controller's
    with contextlib.suppress(OSError):
        for line in open("/proc/self/cgroup"):
            _, controllers, path = line.strip().split(":", 2)
            if controllers in own:
                own[controllers] = path.rstrip("/")
    for pattern, mine in zip(CGROUP_LIMITS, own.values()):
        for path in {pattern.format(""), pattern.format(mine)}:
            with contextlib.suppress(OSError, ValueError):  # absent, or "max": no limit
                total = min(total, int(open(path).read().strip()))
    return total / GB


def cpu_plan(cfg, shape, layout, world=1):
    """Host memory of a run on CPUs, every rank on one machine: (rows of (name, bytes), peak bytes). layout: the largest
    micro-batch (tokens, longest row, shared sequences' lengths), as dapo.py's cpu_layout cuts it. A rank holds its
    process and reward workers, vLLM's weights (in the compute dtype) and KV cache (--cpu-kv-cache-gb), and the
    trainer: its sharded states, then one micro-batch's activations (and sdpa's masks)."""
    t = trainer_bytes(cfg, shape, world, "cpu", layout)
    b = compute_bytes(cfg, "cpu")
    process = (CPU_PROCESS_GB + cfg.reward_workers * REWARD_WORKER_GB) * GB
    h, V = shape[0], shape[5]
    head = 4 * V * h if b < 4 else 0  # vLLM's fp32 head over bf16 weights keeps an fp32 copy (dapo._keep_fp32_head)
    vllm = b * t["params"] + head + cfg.cpu_kv_cache_gb * 2**30
    transient = t["gathered"] + t["activations"] + t["kv_copy"]
    training = t["training"] + CPU_KEPT * transient
    peak = world * (process + vllm + max(training, t["stepping"]))
    rows = [(f"processes: {world} x (torch, vLLM, {cfg.reward_workers} reward workers)", world * process),
            (f"vLLM: weights{', its fp32 head' if head else ''} and {cfg.cpu_kv_cache_gb:g} GiB of KV cache",
             world * vllm),
            ("fp32 parameters, gradients, AdamW (m, v)", world * (t["resident"] + t["gradients"])),
            (f"activations + logits, {t['tokens']} tokens/micro-batch" + (" (with sdpa's shared masks)" if t["masks"]
                                                                          else ""), world * t["activations"]),
            (f"what the allocator keeps, {CPU_KEPT:g} x the activations and layers", world * CPU_KEPT * transient),
            ("peak", peak)]
    return rows, peak


def host_plan(cfg, shape, P, W, gpus_per_node, weight_file, export_bytes=2):
    """Host RAM of the node that holds rank 0 (the busiest), in bytes: (rows, peak).
    Loading (load_hf_weights): rank 0 holds one safetensors file (weight_file bytes); each tensor
    is scattered alone on the GPUs, so with --cpu-offload host RAM receives only each rank's fp32
    shard. Grads and AdamW state appear only at the first update.
    Saving (save_checkpoint), one after the other:
      dcp.save copies each rank's GPU state to host RAM (fp32 params, AdamW m and v: 12 B/param)
      and holds all of it until the rank's file is written (torch's FileSystemWriter keeps every
      tensor of a file); with --cpu-offload that state is already there;
      save_hf: ranks 0..g-1 each build one file of <= --hf-shard-gb (export_bytes per parameter), and with
      --cpu-offload each gathers one full parameter at a time on the CPU (the largest: the embedding).
    Not counted: rollout samples (every rank receives every sample of a generation batch)."""
    h, L, nh, kv, i, V, tied, hd = shape
    g, off = gpus_per_node, cfg.cpu_offload
    biggest = max(V, i) * h                     # elements of the largest tensor: the embedding (or the head)
    file_b = min(max(cfg.hf_shard_gb * GB, biggest * export_bytes), P * export_bytes)  # one file of the export
    writers = min(g, math.ceil(P * export_bytes / file_b))
    base = g * HOST_GB_PER_RANK * GB
    ref = 2 * P / W * g if off and cfg.kl_coef and not cfg.lora_rank else 0  # the offloaded bf16 reference
    T = lora_params(shape, cfg.lora_rank) if cfg.lora_rank else P  # what trains: every weight, or the adapters
    state = (4 * P + 12 * T) / W * g + ref if off else 0  # fp32 params, grads, AdamW m and v
    loading = base + (4 * P / W * g if off else 0) + weight_file
    training = base + state
    dcp_staging = 0 if off else (4 * P + 8 * T) / W * g
    export = writers * file_b + (g * biggest * export_bytes if off else 0)
    saving = base + state + max(dcp_staging, export)
    rows = [(f"rank processes, {g} x {HOST_GB_PER_RANK} GB (assumed)", base)]
    if off:
        rows.append(("offloaded state (fp32 params, grads, AdamW" + (", reference)" if ref else ")"), state))
    rows += [(f"peak while loading (a {weight_file / GB:.1f} GB weight file)", loading),
             ("peak while training", training), ("peak while saving a checkpoint", saving)]
    return rows, max(loading, training, saving)


def weight_file_bytes(path):
    """The largest safetensors file of a local model, which rank 0 holds while loading; None
    (5 GB, the usual shard size on the hub) when the model is not on disk."""
    d = os.path.expanduser(path) if path else ""
    if not os.path.isdir(d):
        return None
    files = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors")]
    return max(map(os.path.getsize, files), default=None)


def splits(cfg, world):
    """Whether dapo.py can run cfg on `world` ranks (its check_config): TP groups and the mini-batches split evenly."""
    return world % cfg.tp_size == 0 and (cfg.prompts_per_step * cfg.group_size) % (cfg.num_mini_batches * world) == 0


def gpu_fits(cfg, shape, nodes, gpus_per_node, gpu_gb, **changes):
    """Whether the GPU side of the plan fits, under cfg with `changes` (field: value) applied."""
    return memory_plan(dataclasses.replace(cfg, **changes), shape, nodes, gpus_per_node, gpu_gb)[1]["gpu_fits"]


def fixes(cfg, shape, nodes, gpus_per_node, gpu_gb, max_nodes=256):
    """What fits where cfg does not, each found by planning it: a list of changes ({field: value}, each a flag)
    and, last, {"nodes": n}, the fewest nodes of gpus_per_node GPUs that hold cfg as it is. In order: gradient
    checkpointing, a smaller token budget per micro-batch (never below one max-length sequence), both, vLLM's
    share of the GPU (the closest that fits), a larger --tp-size (within a node), --cpu-offload; each on its own,
    else together with the first three. The nodes are those on which the batch splits (splits)."""
    seq = cfg.max_prompt_len + cfg.max_response_len
    budgets = [{"micro_batch_tokens": k * seq} for k in range(micro_batch_tokens(cfg) // seq - 1, 0, -1)]
    shares = sorted({round(u / 20, 2) for u in range(1, 20)} - {cfg.gpu_memory_utilization},
                    key=lambda u: abs(u - cfg.gpu_memory_utilization))
    world = nodes * gpus_per_node
    tps = [t for t in (2, 4, 8) if t > cfg.tp_size and gpus_per_node % t == 0 and world % t == 0]
    lean = {"grad_checkpointing": True, "micro_batch_tokens": seq}
    lean = {k: v for k, v in lean.items() if getattr(cfg, k) != v}
    kinds = [[{"grad_checkpointing": True}] if not cfg.grad_checkpointing else [], budgets, [lean] if lean else [],
             [{"gpu_memory_utilization": u} for u in shares], [{"tp_size": t} for t in tps],
             [{"cpu_offload": True}] if not cfg.cpu_offload else []]
    found, lean_fits = [], lean and gpu_fits(cfg, shape, nodes, gpus_per_node, gpu_gb, **lean)
    for n, kind in enumerate(kinds):
        bases = [{}] if n < 3 or not lean or lean_fits else [{}, lean]
        fit = next((dict(base, **c) for base in bases for c in kind
                    if gpu_fits(cfg, shape, nodes, gpus_per_node, gpu_gb, **dict(base, **c))), None)
        if fit and fit not in found and not (n == 2 and found):  # both of the first two only if neither alone fits
            found.append(fit)
    more = next((m for m in range(nodes + 1, max_nodes + 1) if splits(cfg, m * gpus_per_node) and
                 memory_plan(cfg, shape, m, gpus_per_node, gpu_gb)[1]["gpu_fits"]), None)
    return found + ([{"nodes": more}] if more else [])


def as_flags(change):
    """A change of fixes() as dapo.py's flags."""
    def flag(k, v):
        name = "--" + k.replace("_", "-")
        return (name if v else "--no-" + name[2:]) if isinstance(v, bool) else f"{name} {v:g}"
    return " ".join(flag(k, v) for k, v in change.items())


def refusal(cfg, world, gpus_per_node, gpu_gb):
    """dapo.py's memory check on CUDA: None where the plan fits this GPU (gpu_gb) on world ranks of
    gpus_per_node a node, else one line naming each phase that overflows (GB needed against GB allowed) and
    the flags that fit (fixes)."""
    shape, nodes = model_shape(cfg.model), math.ceil(world / gpus_per_node)
    rows, v = memory_plan(cfg, shape, nodes, gpus_per_node, gpu_gb)
    if v["gpu_fits"]:
        return None
    over = [f"{k} needs {x / GB:.1f} GB" for k, x in v["peaks"].items() if x > v["limit"]]
    if not v["kv_fits"]:
        over.append(f"vLLM's share leaves {v['kv_cache'] / GB:.1f} GB of KV cache, less than one max-length "
                    f"sequence ({v['kv_needed'] / GB:.2f} GB)")
    alts = [f"{c['nodes']} nodes of {gpus_per_node} GPUs" if "nodes" in c else f"`{as_flags(c)}`"
            for c in fixes(cfg, shape, nodes, gpus_per_node, gpu_gb)]
    return (f"the memory plan does not fit this {gpu_gb:.1f} GB GPU ({world} rank(s), {gpus_per_node} a node; every "
            f"sequence at its maximum length; at most {HEADROOM:.0%} of the GPU, {v['limit'] / GB:.1f} GB): "
            f"{'; '.join(over)}; " + (f"these fit: {' or '.join(alts)}" if alts else "nothing tried fits")
            + f" (the plan: python tools/plan.py with the same flags and --plan-nodes {nodes} --plan-gpus-per-node "
              f"{gpus_per_node} --plan-gpu-gb {gpu_gb:.1f}); --no-memory-check runs it anyway")
