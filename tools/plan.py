"""plan.py: what one GPU and one node's host RAM hold, phase by phase, for a dapo.py config.

    python tools/plan.py --model Qwen/Qwen2.5-32B --plan-nodes 16 --tp-size 4 ...
    bash run_32b.sh --plan                        # the paper's 32B recipe

Takes every dapo.py training flag (the plan follows them) plus its own --plan-* flags below. Needs
no GPU, model weights or data: a known model's shape is built in, any other is read from its config.
"""

import dataclasses
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # dapo.py's checkout
import dapo  # noqa: E402


@dataclasses.dataclass
class PlanConfig(dapo.Config):
    plan_nodes: int = 1              # nodes to plan for
    plan_gpus_per_node: int = 8      # GPUs per node
    plan_gpu_gb: float = 80.0        # memory per GPU, GB
    plan_host_ram_gb: float = 1000.0  # host RAM per node, GB (8-GPU A100/H100 servers have 1-2 TB)


def parse_config(argv=None):
    """dapo.py's flags and the planner's own."""
    return dapo.parse_config(argv, PlanConfig)


# Shapes for planning when the model's config is not on disk (hidden, layers, heads, kv heads,
# intermediate, vocab, tied embeddings), from the Qwen2.5 base models' config.json files.
KNOWN_MODELS = {"Qwen2.5-0.5B": (896, 24, 14, 2, 4864, 151936, True),
                "Qwen2.5-1.5B": (1536, 28, 12, 2, 8960, 151936, True),
                "Qwen2.5-7B": (3584, 28, 28, 4, 18944, 152064, False),
                "Qwen2.5-14B": (5120, 48, 40, 8, 13824, 152064, False),
                "Qwen2.5-32B": (5120, 64, 40, 8, 27648, 152064, False),
                "Qwen2.5-72B": (8192, 80, 64, 8, 29568, 152064, False)}


def model_shape(name):
    """(hidden, layers, heads, kv_heads, intermediate, vocab, tied, head_dim) of a model."""
    key = os.path.basename(name.rstrip("/"))
    if key in KNOWN_MODELS and not os.path.isdir(name):
        h, L, nh, kv, i, V, tied = KNOWN_MODELS[key]
        return h, L, nh, kv, i, V, tied, h // nh
    c = dapo.check_model(name)
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size, bool(c.tie_word_embeddings), hd)


def activation_bytes(shape, tokens, b, checkpointing, chunk, seq=None, flash=True):
    """Peak activation memory of one micro-batch's forward + backward, in bytes.
    Per decoder layer and token HF's Qwen2 keeps: two RMSNorm inputs in fp32 (2h x 4 B) and their
    outputs (2h x b), q/k/v (h + 2 kv_dim), the attention output twice (2h: sdpa out, o_proj
    input), and four (T, intermediate) MLP tensors: gate, up, silu(gate), their product.
    Checkpointing keeps one (T, h) input per layer instead. On top of that, backward peaks either
    in one layer (recomputed activations and gradient temporaries) or in the fused head: ~5 fp32
    (chunk, V) tensors (logits, softmax and their gradients) and an fp32 copy of the head weight.
    No (T, V) logits tensor exists. Without flash attention (CPU), sdpa's backward materialises
    (heads, S, S) twice per sequence of length S. Measured on CPU in the tests."""
    h, L, nh, kv, i, V, tied, hd = shape
    layer = 2 * h * 4 + (2 * h + h + 2 * kv * hd + 2 * h + 4 * i) * b
    kept = tokens * (L * h * b if checkpointing else L * layer)
    one_layer = tokens * layer * (2 if checkpointing else 1)
    head = 5 * min(chunk, tokens) * V * 4 + V * h * 4
    seq = seq or tokens
    attn = 0 if flash else 2 * nh * seq * seq * b * max(1, tokens // seq)
    return kept + max(one_layer, head) + attn


def memory_plan(cfg, shape, nodes, gpus_per_node, gpu_gb, device="cuda", weight_file=None):
    """Bytes per GPU, by phase, and host RAM per node (host_plan). Returns (rows of (name, bytes),
    verdict dict); "fits" needs both the GPU and the host side (--plan-host-ram-gb) to fit."""
    h, L, nh, kv, i, V, tied, hd = shape
    per_layer = h * h * 2 + 2 * h * kv * hd + h + 2 * kv * hd + 3 * h * i + 2 * h
    P = V * h * (1 if tied else 2) + L * per_layer + h
    W = nodes * gpus_per_node
    b = 2 if device == "cuda" else 4            # bf16 compute on GPU
    GB = 1e9
    on_gpu = 0 if cfg.cpu_offload else 1
    A = lora_params(shape, cfg.lora_rank)       # --lora-rank: only the adapters have gradients and AdamW state
    T = A if cfg.lora_rank else P               # the trained parameters
    states = {"sharded fp32 parameters" + (" (base + adapters)" if A else ""): 4 * (P + A) / W * on_gpu,
              "sharded fp32 gradients": 4 * T / W * on_gpu, "sharded AdamW state (m, v)": 8 * T / W * on_gpu}
    if cfg.kl_coef and not cfg.lora_rank:  # the frozen reference (with LoRA: the policy, adapters off), sharded
        states[f"sharded reference ({'bf16' if b == 2 else 'fp32'}, --kl-coef)"] = b * P / W * on_gpu
    unit = max(h * h * 2 + 2 * h * kv * hd + 3 * h * i, V * h * (1 if tied else 2))  # a layer, or the root
    gathered = 2 * unit * b                     # FSDP all-gathers one unit (and prefetches the next)
    seq = cfg.max_prompt_len + cfg.max_response_len
    tokens = cfg.micro_batch_tokens or cfg.micro_batch_size * seq
    acts = activation_bytes(shape, tokens, b, cfg.grad_checkpointing, cfg.logprob_chunk, seq,
                            flash=device == "cuda")
    vllm_weights = 2 * P / cfg.tp_size
    vllm_total = cfg.gpu_memory_utilization * gpu_gb * GB
    kv_per_token = 2 * L * kv * hd * 2 / cfg.tp_size
    kv_cache = vllm_total - vllm_weights - 2 * GB  # ~2 GB of vLLM's own activations/workspace
    resident = sum(states.values())
    train_peak = resident + gathered + acts + (0 if cfg.vllm_sleep else vllm_total)
    rollout_peak = resident + vllm_total
    # load_hf_weights: vLLM is awake; each tensor arrives whole on every GPU (bf16), then its shard is kept
    biggest = max(V, i) * h                     # elements of the largest tensor: the embedding
    load_peak = 4 * (P + A) / W * on_gpu + vllm_total + biggest * 2
    rows = [(k, v) for k, v in states.items()] + [
        ("FSDP all-gathered layers (bf16)", gathered),
        (f"activations + logits, {tokens} tokens/micro-batch", acts),
        (f"vLLM weights (bf16, TP {cfg.tp_size})", vllm_weights), ("vLLM KV cache", kv_cache),
        ("peak while loading (the largest tensor whole)", load_peak), ("peak while training", train_peak),
        ("peak while generating", rollout_peak),
        # every rank streams the full tensors (a tied lm_head as well: state_dict has it), its vLLM keeps its TP part
        ("weight sync per step, streamed by each rank (bf16" + (", adapters merged" if A else "") + ")",
         2 * (P + (V * h if tied else 0)))]
    gpu_fits = max(load_peak, train_peak, rollout_peak) <= gpu_gb * GB and kv_cache >= kv_per_token * seq
    if weight_file is None:
        weight_file = min(5 * GB, 2 * P)
    host, host_peak = host_plan(cfg, shape, P, W, gpus_per_node, weight_file)
    host_fits = host_peak <= cfg.plan_host_ram_gb * GB
    return rows, {"params": P, "adapters": A, "fits": gpu_fits and host_fits, "gpu_fits": gpu_fits, "host_fits": host_fits,
                  "kv_seqs": kv_cache / (kv_per_token * seq), "world": W, "host": host,
                  "host_peak": host_peak}


def lora_params(shape, rank):
    """Parameters of --lora-rank r's adapters: r (in + out) for each of a layer's q, k, v, o, gate, up, down."""
    h, L, nh, kv, i, V, tied, hd = shape
    q, k = nh * hd, kv * hd
    return L * rank * ((h + q) + 2 * (h + k) + (q + h) + 2 * (h + i) + (i + h))


# Assumed, not measured on a GPU: one rank's torch, CUDA context, vLLM and reward workers.
HOST_GB_PER_RANK = 4


def host_plan(cfg, shape, P, W, gpus_per_node, weight_file):
    """Host RAM of the node that holds rank 0 (the busiest), in bytes: (rows, peak).
    Loading (load_hf_weights): rank 0 holds one safetensors file (weight_file bytes); each tensor
    is scattered alone on the GPUs, so with --cpu-offload host RAM receives only each rank's fp32
    shard. Grads and AdamW state appear only at the first update.
    Saving (save_checkpoint), one after the other:
      dcp.save copies each rank's GPU state to host RAM (fp32 params, AdamW m and v: 12 B/param)
      and holds all of it until the rank's file is written (torch's FileSystemWriter keeps every
      tensor of a file); with --cpu-offload that state is already there;
      save_hf: ranks 0..g-1 each build one file of <= --hf-shard-gb, and with --cpu-offload each
      gathers one full parameter at a time on the CPU (the largest: the embedding).
    Not counted: rollout samples (every rank receives every sample of a generation batch)."""
    h, L, nh, kv, i, V, tied, hd = shape
    g, off, GB = gpus_per_node, cfg.cpu_offload, 1e9
    biggest = max(V, i) * h                     # elements of the largest tensor: the embedding (or the head)
    save_b = 4 if dapo.export_dtype(cfg) == "float32" else 2
    file_b = min(max(cfg.hf_shard_gb * GB, biggest * save_b), P * save_b)  # one file of the export
    writers = min(g, math.ceil(P * save_b / file_b))
    base = g * HOST_GB_PER_RANK * GB
    ref = 2 * P / W * g if off and cfg.kl_coef and not cfg.lora_rank else 0  # the offloaded bf16 reference
    T = lora_params(shape, cfg.lora_rank) if cfg.lora_rank else P  # what trains: every weight, or the adapters
    state = (4 * P + 12 * T) / W * g + ref if off else 0  # fp32 params, grads, AdamW m and v
    loading = base + (4 * P / W * g if off else 0) + weight_file
    training = base + state
    dcp_staging = 0 if off else (4 * P + 8 * T) / W * g
    export = writers * file_b + (g * biggest * save_b if off else 0)
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


def print_plan(cfg):
    sizes = ("plan_nodes", "plan_gpus_per_node", "plan_gpu_gb", "plan_host_ram_gb", "tp_size")
    bad = [f"--{k.replace('_', '-')} {getattr(cfg, k)}" for k in sizes if not getattr(cfg, k) > 0]
    if bad:
        raise dapo.DapoError(f"--plan needs positive sizes (got {', '.join(bad)})")
    name = cfg.model or "built-in demo model"
    shape = model_shape(cfg.model) if cfg.model else (128, 2, 2, 2, 512, 32, True, 64)
    g, file = cfg.plan_gpus_per_node, weight_file_bytes(cfg.model)
    rows, v = memory_plan(cfg, shape, cfg.plan_nodes, g, cfg.plan_gpu_gb, weight_file=file)
    lora = f", LoRA rank {cfg.lora_rank}: {v['adapters'] / 1e6:.1f}M trained" if cfg.lora_rank else ""
    print(f"memory plan per GPU: {name} ({v['params'] / 1e9:.2f}B parameters{lora}) on {cfg.plan_nodes} node(s) x "
          f"{g} GPUs of {cfg.plan_gpu_gb:g} GB, max length {cfg.max_prompt_len}+{cfg.max_response_len}")
    for k, x in rows:
        print(f"  {k:48s} {x / 1e9:8.2f} GB")
    print(f"  KV cache holds {v['kv_seqs']:.1f} max-length sequences per TP group at once")
    print(f"host RAM per node ({g} ranks; the node of rank 0):")
    for k, x in v["host"]:
        print(f"  {k:48s} {x / 1e9:8.2f} GB")
    print(f"fits: {'yes' if v['fits'] else 'NO'} (GPU: {'yes' if v['gpu_fits'] else 'NO'}; host RAM: peak "
          f"{v['host_peak'] / 1e9:.0f} GB of --plan-host-ram-gb {cfg.plan_host_ram_gb:g})")

    def fits(n):
        plan = memory_plan(cfg, shape, n, g, cfg.plan_gpu_gb, weight_file=file)[1]
        return plan["fits"] and (n * g) % cfg.tp_size == 0

    smallest = next((n for n in range(1, 257) if fits(n)), None)
    print(f"smallest cluster that fits this config: {smallest} node(s) x {g} GPUs" if smallest
          else "no cluster up to 256 nodes fits this config")
    return v


def main(argv=None):
    try:
        print_plan(parse_config(argv))
    except dapo.DapoError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
