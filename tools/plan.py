"""plan.py: what one GPU and one node's host RAM hold, phase by phase, for a dapo.py config.

    python tools/plan.py --model Qwen/Qwen2.5-32B --plan-nodes 16 --tp-size 4 ...
    bash run_32b.sh --plan                        # the paper's 32B recipe
    python tools/plan.py --plan-cpu --model $(python tools/real_model.py) ...   # a laptop run: this machine's memory

Takes every dapo.py training flag (the plan follows them, with the presets of a CUDA run on any host) plus
its own --plan-* flags below. Needs no GPU, model weights or data: a known model's shape is built in, any
other is read from its config. The arithmetic is lib/plan.py's, which dapo.py also runs before vLLM starts on
CUDA; a GPU fits when every phase's peak stays under 90% of it (lib/plan.py's HEADROOM).
"""

import contextlib
import dataclasses
import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # dapo.py's checkout
import dapo  # noqa: E402
from lib import plan as arithmetic  # noqa: E402  (the arithmetic, which dapo.py's memory check runs too)
from lib.check_data import check_model  # noqa: E402
from lib.plan import (GB, HEADROOM, HOST_GB_PER_RANK, KNOWN_MODELS, activation_bytes, as_flags,  # noqa: E402,F401
                      fixes, host_plan, lora_params, model_shape, weight_file_bytes)


@dataclasses.dataclass
class PlanConfig(dapo.Config):
    plan_nodes: int = 1              # nodes to plan for
    plan_gpus_per_node: int = 8      # GPUs per node
    plan_gpu_gb: float = 85.0        # memory per GPU, GB, as torch reports it (total_memory / 1e9): an "80 GB" H100
    #  or A100 reports ~85.0 (80 GiB), an H200 ~150; vLLM takes --gpu-memory-utilization of this total
    plan_host_ram_gb: float = 1000.0  # host RAM per node, GB (8-GPU A100/H100 servers have 1-2 TB)
    plan_cpu: bool = False           # plan a run on this machine's CPUs (its presets, the laptop's among them;
    #  dapo.py's check before vLLM starts) instead of GPUs


def parse_config(argv=None):
    """dapo.py's flags and the planner's own, with the presets of a CUDA run (the plan is for GPUs, on any host), or
    with --plan-cpu those of a run on this machine's CPUs."""
    argv = sys.argv[1:] if argv is None else argv
    return dapo.parse_config(argv, PlanConfig, cuda="--plan-cpu" not in argv)


def print_cpu_plan(cfg):
    """A run on this machine's CPUs, as dapo.py plans it before vLLM starts (fit_host_memory): the memory of each
    part at the largest micro-batch, and whether it fits; where the laptop preset's micro-batches would not, what
    dapo.py runs instead."""
    import types
    if not cfg.model:
        raise dapo.DapoError("--plan-cpu plans a --model (the built-in demo model fits any machine)")
    config = check_model(cfg.model)
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    limit = arithmetic.CPU_HEADROOM * arithmetic.machine_gb()
    fitted = dapo.dataclasses.replace(cfg)
    fitted.given = cfg.given
    try:
        with contextlib.redirect_stdout(io.StringIO()) as note:
            dapo.fit_host_memory(fitted, config, ranks)
    except dapo.DapoError as e:
        note = types.SimpleNamespace(getvalue=lambda: f"dapo.py would refuse it: {e}")
    share = dapo.sharing(cfg, config)
    for title, c in (("as given", cfg),) + ((("as dapo.py runs it", fitted),) if fitted != cfg else ()):
        layout = dapo.cpu_layout(c, share)
        rows, peak = arithmetic.cpu_plan(c, model_shape(c.model), layout, ranks)
        print(f"memory plan on CPUs, {title}: {c.model}, {ranks} rank(s), max length {c.max_prompt_len}+"
              f"{c.max_response_len}, {c.precision or 'fp32'}, micro-batches of " +
              (f"up to {c.micro_batch_tokens} tokens" if c.micro_batch_tokens else f"{c.micro_batch_size} sequences") +
              f" (the largest: {layout[0]} tokens, rows of {layout[1]}), checkpointing "
              f"{'on' if c.grad_checkpointing else 'off'}")
        for k, x in rows:
            print(f"  {k:64s} {x / 1e9:8.2f} GB")
    print(f"this machine: {arithmetic.machine_gb():.1f} GB; a run plans at most {arithmetic.CPU_HEADROOM:.0%}: "
          f"{limit:.1f} GB")
    print(note.getvalue().strip() or "fits")


def memory_plan(cfg, shape, nodes, gpus_per_node, gpu_gb, device="cuda", weight_file=None):
    """lib/plan.py's memory_plan, with this tool's --plan-host-ram-gb and dapo.py's export dtype."""
    return arithmetic.memory_plan(cfg, shape, nodes, gpus_per_node, gpu_gb, device, weight_file,
                                  host_ram_gb=cfg.plan_host_ram_gb,
                                  export_bytes=4 if dapo.export_dtype(cfg) == "float32" else 2)


def print_plan(cfg):
    sizes = ("plan_nodes", "plan_gpus_per_node", "plan_gpu_gb", "plan_host_ram_gb", "tp_size")
    bad = [f"--{k.replace('_', '-')} {getattr(cfg, k)}" for k in sizes if not getattr(cfg, k) > 0]
    if bad:
        raise dapo.DapoError(f"--plan needs positive sizes (got {', '.join(bad)})")
    name = cfg.model or "built-in demo model"
    shape = model_shape(cfg.model)
    g, file = cfg.plan_gpus_per_node, weight_file_bytes(cfg.model)
    rows, v = memory_plan(cfg, shape, cfg.plan_nodes, g, cfg.plan_gpu_gb, weight_file=file)
    lora = f", LoRA rank {cfg.lora_rank}: {v['adapters'] / 1e6:.1f}M trained" if cfg.lora_rank else ""
    print(f"memory plan per GPU: {name} ({v['params'] / 1e9:.2f}B parameters{lora}) on {cfg.plan_nodes} node(s) x "
          f"{g} GPUs of {cfg.plan_gpu_gb:g} GB, max length {cfg.max_prompt_len}+{cfg.max_response_len}")
    for k, x in rows:
        print(f"  {k:48s} {x / 1e9:8.2f} GB")
    print(f"  KV cache holds {v['kv_seqs']:.1f} max-length sequences per TP group at once")
    phase, top = max(v["peaks"].items(), key=lambda kv: kv[1])
    gpu = cfg.plan_gpu_gb * GB
    print(f"headroom: the largest peak ({phase.replace('peak ', '')}, {top / GB:.2f} GB) is {top / gpu:.0%} of "
          f"{cfg.plan_gpu_gb:g} GB; "
          f"the plan allows {HEADROOM:.0%} ({v['limit'] / GB:.2f} GB): "
          + (f"{(v['limit'] - top) / GB:.2f} GB to spare" if top <= v["limit"] else
             f"{(top - v['limit']) / GB:.2f} GB over"))
    print(f"host RAM per node ({g} ranks; the node of rank 0):")
    for k, x in v["host"]:
        print(f"  {k:48s} {x / 1e9:8.2f} GB")
    print(f"fits: {'yes' if v['fits'] else 'NO'} (GPU: {'yes' if v['gpu_fits'] else 'NO'}; host RAM: peak "
          f"{v['host_peak'] / 1e9:.0f} GB of --plan-host-ram-gb {cfg.plan_host_ram_gb:g})")

    def fits(n):
        plan = memory_plan(cfg, shape, n, g, cfg.plan_gpu_gb, weight_file=file)[1]
        return plan["fits"] and arithmetic.splits(cfg, n * g)  # dapo.py's check_config would refuse the others

    smallest = next((n for n in range(1, 257) if fits(n)), None)
    print(f"smallest cluster that fits this config: {smallest} node(s) x {g} GPUs" if smallest
          else "no cluster up to 256 nodes fits this config")
    if not v["gpu_fits"]:
        alts = [f"{c['nodes']} nodes" if "nodes" in c else as_flags(c)
                for c in fixes(cfg, shape, cfg.plan_nodes, g, cfg.plan_gpu_gb)]
        print("the GPU side fits with: " + (" | ".join(alts) if alts else "nothing tried"))
    return v


def main(argv=None):
    try:
        cfg = parse_config(argv)
        print_cpu_plan(cfg) if cfg.plan_cpu else print_plan(cfg)
    except dapo.DapoError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
