"""The memory plan on GPUs (lib/plan.py): the README's GPU commands fit it with headroom, dapo.py's CUDA preset,
its memory check on a stand-in CUDA device (refused before vLLM, with flags that fit), and the overheads each
phase counts. No GPU: CUDA is stood in for where dapo.py asks torch about it."""
import dataclasses
import os
import re
import shlex
import sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
import types
import pytest
import torch
import dapo
from tests.shared import HERE
import plan  # tools/plan.py, the user's tool: lib/plan.py's arithmetic, with dapo.py's flags

GB = 1e9


def _readme_gpu_commands():
    """The README's GPU commands (the code block of its "Which set-up" section that runs run_32b.sh), as (GPUs per
    node, the command's arguments): `python dapo.py` runs on one GPU, `torchrun --nproc_per_node=N dapo.py` on N;
    the `...` placeholders of data files stay (the plan reads no data). The run_32b.sh line is returned as its
    command alone."""
    text = open(os.path.join(HERE, "README.md")).read()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "run_32b.sh" in b)
    out = []
    for command in block.replace("\\\n", " ").splitlines():
        words = shlex.split(command, comments=True)
        if words[0] == "torchrun":
            gpus = int(next(w for w in words if w.startswith("--nproc_per_node=")).split("=")[1])
            out.append((gpus, words[words.index("dapo.py") + 1:]))
        elif words[:2] == ["python", "dapo.py"]:
            out.append((1, words[2:]))
        else:
            out.append((None, words))
    return out


def test_readme_gpu_commands_fit_the_plan_with_headroom():
    """Each GPU command of the README's "Which set-up" section, as a user copies it, fits one node of "80 GB" GPUs
    (85.0e9 bytes as torch reports an H100's) by the plan: every phase's peak under 90% of the GPU, vLLM's KV cache
    holding a max-length sequence, and host
    RAM. The plan applies the CUDA preset (gradient checkpointing, one max-length sequence per micro-batch);
    without it the 7B command needs ~840 GB a GPU while training. The block's last command, `bash run_32b.sh`, is
    planned at its node count by tests/test_tools.py::test_run_32b_plan."""
    commands = _readme_gpu_commands()
    assert [g for g, _ in commands] == [1, 8, None] and commands[-1][1] == ["bash", "run_32b.sh"], commands
    for gpus, args in commands[:-1]:
        cfg = plan.parse_config(args + ["--plan-gpus-per-node", str(gpus)])
        rows, v = plan.memory_plan(cfg, plan.model_shape(cfg.model), 1, gpus, 85.0)
        peak = max(x for k, x in rows if k.startswith("peak while"))
        print(f"{cfg.model} on {gpus} GPU(s): largest peak {peak / GB:.1f} GB of 85, KV cache {v['kv_seqs']:.0f} "
              f"max-length sequences, host {v['host_peak'] / GB:.0f} GB")
        assert v["fits"] and peak <= 0.9 * 85 * GB and v["kv_seqs"] >= 1, (args, rows)
        assert cfg.grad_checkpointing and cfg.micro_batch_tokens == cfg.max_prompt_len + cfg.max_response_len
        bare = dataclasses.replace(cfg, grad_checkpointing=False, micro_batch_tokens=0)  # no CUDA preset
        assert cfg.max_response_len < 20480 or not plan.memory_plan(bare, plan.model_shape(cfg.model), 1, gpus,
                                                                    85.0)[1]["gpu_fits"]


def test_the_plan_keeps_headroom():
    """A GPU fits when every peak stays under 90% of it, not under all of it: on an "80 GB" H100 (85.0e9 bytes, of
    which vLLM takes its share) the README's 1-GPU command with vLLM's share at 0.7 peaks at ~80 GB while
    generating (90% of 85 is 76.5) and is refused; at 0.65 it fits."""
    args = ["--model", "Qwen/Qwen2.5-1.5B", "--prompts-per-step", "64", "--group-size", "8", "--gen-batch-size", "96",
            "--max-response-len", "4096", "--overlong-cache-len", "1024", "--plan-gpus-per-node", "1"]
    peaks = {}
    for share in ("0.65", "0.7"):
        cfg = plan.parse_config(args + ["--gpu-memory-utilization", share])
        rows, v = plan.memory_plan(cfg, plan.model_shape(cfg.model), 1, 1, 85.0)
        peaks[share] = (dict(rows)["peak while generating"], v["gpu_fits"])
    print({k: (round(p / GB, 2), f) for k, (p, f) in peaks.items()})
    assert peaks["0.65"][1] and peaks["0.65"][0] <= 76.5 * GB
    assert not peaks["0.7"][1] and 76.5 * GB < peaks["0.7"][0] < 85 * GB


def test_plan_counts_each_overhead_where_it_is_held():
    """The paper's recipe (Qwen2.5-32B, 16 x 8 GPUs, TP 4): each phase's peak is the sum of the rows it holds.
    Loading: the fp32 shards, vLLM awake, the largest tensor whole; training: the shards with gradients and AdamW,
    the gathered layers, activations, flex's copied KV heads, the allocator's fragmentation (a third of those
    three), vLLM asleep (its CUDA-graph pool); generating: no gradients (update_policy ends in
    zero_grad(set_to_none=True)), vLLM awake; all three: the CUDA context and NCCL. Each overhead moves its peak:
    vLLM kept awake (--no-vllm-sleep), sdpa instead of flex, 64 heads (Qwen2.5-72B's, a power of two: no
    copy), TP 1 (no TP communicator), fewer ranks (rank 0 scatters to fewer)."""
    args = ["--model", "Qwen/Qwen2.5-32B", "--max-response-len", "20480", "--tp-size", "4",
            "--gpu-memory-utilization", "0.7"]
    shape = plan.model_shape("Qwen/Qwen2.5-32B")

    def rows_of(*more, nodes=16, shape=shape):
        rows, _ = plan.memory_plan(plan.parse_config(args + list(more)), shape, nodes, 8, 80.0)
        return dict(rows)

    r = rows_of()
    P = 32.76e9
    process = r["CUDA context and kernels"] + r["NCCL: trainer, rank 0 to 127 ranks, vLLM TP"]
    copy = r["KV heads copied for flex attention (40 heads)"]
    transient = r["FSDP all-gathered layers (bf16)"] + r["activations + logits, 22528 tokens/micro-batch"] + copy
    assert r["fragmentation, 1/3 of gathered + acts + KV copy"] == pytest.approx(transient / 3)
    states = r["sharded fp32 parameters"] + r["sharded AdamW state (m, v)"]
    assert r["peak while generating"] == pytest.approx(states + 0.7 * 80 * GB + process)
    other = r["other allocations (cuBLAS workspaces, RoPE tables)"]
    from lib import plan as lib_plan
    assert other == lib_plan.OTHER_GB * GB
    assert r["peak while training"] == pytest.approx(states + r["sharded fp32 gradients"] + transient * 4 / 3
                                                     + other + r["vLLM asleep: CUDA-graph pool, buffers"] + process)
    assert r["peak while loading (the largest tensor whole)"] == pytest.approx(
        r["sharded fp32 parameters"] + 0.7 * 80 * GB + 152064 * 5120 * 2 + process, rel=1e-3)
    assert 0.5 * GB < copy < 2 * GB and r["vLLM asleep: CUDA-graph pool, buffers"] >= 1 * GB
    assert r["peak while stepping AdamW"] == pytest.approx(states + r["sharded fp32 gradients"] + other
                                                           + r["vLLM asleep: CUDA-graph pool, buffers"] + process)
    assert abs(states / (12 * P / 128) - 1) < 0.01 and process > 2 * GB

    awake = rows_of("--no-vllm-sleep")
    assert awake["peak while training"] - r["peak while training"] == pytest.approx(
        0.7 * 80 * GB - r["vLLM asleep: CUDA-graph pool, buffers"])
    sdpa, heads_64 = rows_of("--attn-impl", "sdpa"), rows_of(shape=plan.model_shape("Qwen2.5-72B"))
    assert not any(k.startswith("KV heads copied") for k in list(sdpa) + list(heads_64))
    assert r["peak while training"] - sdpa["peak while training"] == pytest.approx(copy * 4 / 3)
    tp1 = rows_of("--tp-size", "1")
    assert r["peak while generating"] - tp1["peak while generating"] == pytest.approx(0.9 * GB)
    one_node = rows_of(nodes=1)
    nccl = one_node["NCCL: trainer, rank 0 to 7 ranks, vLLM TP"]
    assert 1.6 * GB + 7 * 0.2 * GB < nccl < r["NCCL: trainer, rank 0 to 127 ranks, vLLM TP"]


def test_cuda_preset_and_a_flag_given_wins(monkeypatch, tmp_path):
    """On CUDA with --model, dapo.py's CUDA preset turns gradient checkpointing on and sets one max-length
    sequence per micro-batch (run_32b.sh's, verl's ppo_max_token_len_per_gpu); a flag given wins; the presets
    line and --help name it. On a CPU dapo.py leaves both off, and the built-in model keeps its task's preset on
    CUDA; tools/plan.py applies the CUDA preset on this CPU host."""
    model = _model_dir(tmp_path, "Qwen2.5-1.5B")
    assert not torch.cuda.is_available()
    cpu = dapo.parse_config(["--model", model])
    assert not cpu.grad_checkpointing and cpu.micro_batch_tokens == 0
    tool = plan.parse_config(["--model", model, "--max-response-len", "4096"])
    assert tool.grad_checkpointing and tool.micro_batch_tokens == 2048 + 4096
    _stand_in_cuda(monkeypatch)
    cfg = dapo.parse_config(["--model", model, "--max-response-len", "4096", "--overlong-cache-len", "1024"])
    assert cfg.grad_checkpointing and cfg.micro_batch_tokens == 2048 + 4096
    assert dapo.presets(cfg) == [("cuda", {"grad_checkpointing": True, "micro_batch_tokens": 6144})]
    given = dapo.parse_config(["--model", model, "--no-grad-checkpointing", "--micro-batch-tokens", "9000"])
    assert not given.grad_checkpointing and given.micro_batch_tokens == 9000
    demo = dapo.parse_config([])
    assert [n for n, _ in dapo.presets(demo)] == ["--task add"] and not demo.grad_checkpointing
    assert demo.micro_batch_tokens == 0


def test_cuda_preset_shows_in_help(capsys):
    """--help names the CUDA preset's values beside the flags it sets, and the memory check's flag."""
    with pytest.raises(SystemExit):
        dapo.parse_config(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: False; cuda: True)" in out
    assert "cuda: '--max-prompt-len + --max-response-len'" in out.replace("- len", "-len")
    assert "--memory-check, --no-memory-check refuse, before vLLM starts" in out


REFUSED = {  # a config on a stand-in "80 GB" CUDA device (85e9 bytes), (ranks, per node), what overflows
    "7B, its activations all kept": (["--model", "Qwen2.5-7B", "--tp-size", "2", "--no-grad-checkpointing",
                                      "--micro-batch-tokens", "90112"], (8, 8), ["peak while training"]),
    "32B on one node": (["--model", "Qwen2.5-32B", "--tp-size", "4", "--gpu-memory-utilization", "0.7"], (8, 8),
                        ["peak while loading", "peak while training", "peak while generating"]),
    "1.5B, vLLM's share 0.9": (["--model", "Qwen2.5-1.5B", "--max-response-len", "4096", "--overlong-cache-len", "1024",
                                "--prompts-per-step", "64", "--group-size", "8", "--gen-batch-size", "96",
                                "--gpu-memory-utilization", "0.9"], (1, 1),
                               ["peak while loading", "peak while generating"]),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_memory_check_refuses_before_vllm_and_names_flags_that_fit(case, monkeypatch, tmp_path, capsys):
    """On a stand-in CUDA device of 80 GB under torchrun's environment, dapo.py refuses a config whose plan does
    not fit in one line (exit 2), before it reads the data (the file does not exist) and before vLLM or the process
    group start (either would raise here): naming each phase that overflows and flags that fit. Each suggestion,
    added to the same command, passes the check (the run then stops at the missing data file), as do the nodes
    it names; --no-memory-check skips the check."""
    args, (world, per_node), phases = REFUSED[case]
    args = ["--model", _model_dir(tmp_path, args[1])] + args[2:] + ["--train-data", str(tmp_path / "none.parquet")]
    _stand_in_cuda(monkeypatch, world, per_node)

    def not_reached(*a, **k):
        raise AssertionError("reached past the memory check")
    monkeypatch.setattr(dapo, "start_engine", not_reached)
    monkeypatch.setattr(dapo, "init_distributed", not_reached)
    err = _error(args, capsys)
    print(err)
    assert err.count("\n") == 1 and err.startswith("error: the memory plan does not fit this 85.0 GB GPU")
    for phase in ("peak while loading", "peak while training", "peak while generating"):
        assert (f"{phase} needs " in err) == (phase in phases), phase
    assert "--no-memory-check runs it anyway" in err
    flags = re.findall(r"`([^`]+)`", err)
    nodes = [int(n) for n in re.findall(r"(\d+) nodes of \d+ GPUs", err)]
    assert flags, err
    for alt in flags:
        assert "none.parquet" in _error(args + alt.split(), capsys), alt   # past the memory check: the data's error
    for n in nodes:
        monkeypatch.setenv("WORLD_SIZE", str(n * per_node))
        assert "none.parquet" in _error(args, capsys), n
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert "none.parquet" in _error(args + ["--no-memory-check"], capsys)


# Helpers

def _stand_in_cuda(monkeypatch, world=1, per_node=1, total=85e9):
    """torch finds CUDA, a GPU of `total` bytes (85e9: what torch reports of an "80 GB" H100), under torchrun's
    variables for world ranks, per_node a node."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i=0: types.SimpleNamespace(total_memory=total, name="stand-in"))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
    monkeypatch.setenv("LOCAL_RANK", "0")


def _model_dir(tmp_path, name):
    """A directory with a Qwen2.5 model's config.json, from the plan's shapes (no weights)."""
    from transformers import Qwen2Config
    h, L, nh, kv, i, V, tied = plan.KNOWN_MODELS[name]
    path = tmp_path / name
    Qwen2Config(hidden_size=h, num_hidden_layers=L, num_attention_heads=nh, num_key_value_heads=kv,
                intermediate_size=i, vocab_size=V, tie_word_embeddings=tied,
                max_position_embeddings=131072).save_pretrained(path)
    return str(path)


def _error(argv, capsys):
    """dapo.py's command line: its exit code must be 2; the one error line it printed."""
    with pytest.raises(SystemExit) as e:
        dapo.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


# -----------------------------------------------------------------------------------------
# On CPUs: the laptop's memory

def _laptop_model(tmp_path):
    """A directory with SmolLM2-135M-Instruct's config (no weights), marked for the laptop preset as
    tools/real_model.py marks it."""
    from transformers import LlamaConfig
    path = tmp_path / "smollm2"
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192)
    config.dapo_preset = "laptop"
    config.save_pretrained(path)
    return str(path)


def test_cpu_plan_counts_each_part_and_sdpas_shared_masks(tmp_path):
    """A CPU run's plan (lib/plan.py's cpu_plan, at dapo.py's cpu_layout): its peak is the processes (torch and vLLM,
    the reward workers), vLLM's weights (its head kept in fp32 too) and KV cache, the fp32 states, and one micro-batch's activations plus what the
    allocator keeps of them; a micro-batch whose groups share their prompts under sdpa counts each shared sequence's
    dense mask in every layer, and forwards fewer tokens; more ranks on the machine, each its own."""
    from lib import plan as lib_plan
    model = _laptop_model(tmp_path)
    flags = ["--model", model, "--precision", "bf16", "--max-response-len", "512", "--overlong-cache-len", "128",
             "--max-prompt-len", "256"]
    cfg = dapo.parse_config(flags)
    config = dapo.check_model(model)
    shape = lib_plan.model_shape(model)
    beta = dapo.sharing(cfg, config)
    layouts = {how: dapo.cpu_layout(cfg, share) for how, share in (("plain", False), ("rule", beta), ("shared", True))}
    print(layouts)
    assert layouts["plain"] == layouts["rule"] == (32 * 768, 768, [])   # 32 max-length copies, each a row
    assert layouts["shared"] == (4 * (256 + 8 * 512), 4352, [4352] * 4)
    showcase = dapo.cpu_layout(dapo.parse_config(flags[:4]), beta)   # 256 + 32: the groups share whole
    assert showcase == (4 * (256 + 8 * 32), 512, [512] * 4), showcase
    rows, peak = lib_plan.cpu_plan(cfg, shape, layouts["rule"])
    r = dict(rows)
    t = lib_plan.trainer_bytes(cfg, shape, 1, "cpu", layouts["rule"])
    assert t["masks"] == 0 and lib_plan.trainer_bytes(cfg, shape, 1, "cpu", showcase)["masks"] == 4 * 512 ** 2 * 2 * 30
    process = (lib_plan.CPU_PROCESS_GB + 2 * lib_plan.REWARD_WORKER_GB) * GB
    vllm = 2 * t["params"] + 4 * 49152 * 576 + 0.75 * 2**30
    transient = t["gathered"] + t["activations"]
    assert peak == pytest.approx(process + vllm + t["resident"] + t["gradients"] + transient + lib_plan.CPU_KEPT * transient)
    two = lib_plan.cpu_plan(cfg, shape, layouts["rule"], 2)[1]   # two ranks: each a process, half the states
    t2 = lib_plan.trainer_bytes(cfg, shape, 2, "cpu", layouts["rule"])   # and FSDP's gathered units alone
    assert t["gathered"] == 2 * t["params"] > t2["gathered"]   # one process keeps every layer's bf16 copy
    assert r["peak"] == peak and two == pytest.approx(2 * (process + vllm + t2["resident"] + t2["gradients"] + (
        1 + lib_plan.CPU_KEPT) * (t2["gathered"] + t2["activations"])))
    shared_peak = lib_plan.cpu_plan(cfg, shape, layouts["shared"])[1]
    assert lib_plan.trainer_bytes(cfg, shape, 1, "cpu", layouts["shared"])["masks"] == 4 * 4352 ** 2 * 2 * 30
    assert shared_peak > peak   # four 4,352-position masks in 30 layers outweigh the tokens saved


def test_laptop_preset_cuts_micro_batches_by_tokens_where_32_sequences_would_not_fit(tmp_path, monkeypatch, capsys):
    """On a stand-in machine of 24 GB (the plan allows 75%: 18 GB): the laptop preset's showcase lengths keep 32
    sequences a micro-batch; with responses of 512 tokens they would need more, so micro-batches go by tokens, the
    most that fit (a note says so), and that config fits; a micro-batch size given by the user that does not fit is
    refused in one line naming a token budget that does, which itself passes; --no-memory-check runs it anyway; the
    built-in demo model is not planned."""
    from lib import plan as lib_plan
    monkeypatch.setattr(lib_plan, "machine_gb", lambda: 24.0)
    model = _laptop_model(tmp_path)
    config = dapo.check_model(model)
    showcase = dapo.parse_config(["--model", model, "--precision", "bf16"])
    dapo.fit_host_memory(showcase, config, 1)
    assert (showcase.micro_batch_size, showcase.micro_batch_tokens) == (32, 0) and not capsys.readouterr().out
    long = ["--model", model, "--precision", "bf16", "--max-response-len", "512", "--overlong-cache-len", "128"]
    cfg = dapo.parse_config(long)
    dapo.fit_host_memory(cfg, config, 1)
    note = capsys.readouterr().out
    print(note)
    assert note.startswith("note: micro-batches of 32 sequences of up to 768 tokens would need ") and \
        note.count("\n") == 1 and f"--micro-batch-tokens {cfg.micro_batch_tokens} instead" in note
    assert 0 < cfg.micro_batch_tokens < 32 * 768 and cfg.micro_batch_tokens % 768 == 0 and not cfg.grad_checkpointing
    shape = lib_plan.model_shape(model)
    fits = lambda c: lib_plan.cpu_plan(c, shape, dapo.cpu_layout(c, dapo.sharing(c, config)))[1] <= 0.75 * 24 * GB  # noqa
    assert fits(cfg) and not fits(dataclasses.replace(cfg, micro_batch_tokens=cfg.micro_batch_tokens + 768))
    given = dapo.parse_config(long + ["--micro-batch-size", "16"])
    with pytest.raises(dapo.DapoError) as e:
        dapo.fit_host_memory(given, config, 1)
    print(e.value)
    assert "\n" not in str(e.value) and "--no-memory-check runs it anyway" in str(e.value)
    budget = int(re.search(r"`--micro-batch-tokens (\d+)` fits", str(e.value))[1])
    same = dapo.parse_config(long + ["--micro-batch-size", "32"])   # the preset's value, but given: never rewritten
    with pytest.raises(dapo.DapoError, match="--no-memory-check runs it anyway"):
        dapo.fit_host_memory(same, config, 1)
    assert (same.micro_batch_size, same.micro_batch_tokens) == (32, 0)
    dapo.fit_host_memory(dapo.parse_config(long + ["--micro-batch-size", "32", "--micro-batch-tokens", str(budget)]),
                         config, 1)   # passes
    monkeypatch.setattr(dapo, "fit_host_memory", lambda *a: (_ for _ in ()).throw(AssertionError("planned")))
    for argv in (long + ["--micro-batch-size", "32", "--no-memory-check", "--train-data", str(tmp_path / "none.jsonl")],
                 ["--train-data", str(tmp_path / "none.jsonl")]):
        with pytest.raises(dapo.DapoError, match="none.jsonl"):   # past the plan: the data's own error
            dapo.preflight(dapo.parse_config(argv))


def test_the_host_plan_takes_a_cgroups_limit(tmp_path, monkeypatch):
    """machine_gb: the machine's memory, or a container's limit where a cgroup sets one lower (v2's memory.max, v1's
    memory.limit_in_bytes); "max" or an absent file is no limit."""
    from lib import plan as lib_plan
    whole = lib_plan.machine_gb()
    v2, v1 = tmp_path / "v2{}", tmp_path / "v1{}"
    monkeypatch.setattr(lib_plan, "CGROUP_LIMITS", (str(v2) + "/memory.max", str(v1) + "/memory.limit_in_bytes"))
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "memory.max").write_text("max\n")
    assert lib_plan.machine_gb() == whole
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "memory.limit_in_bytes").write_text(f"{int(whole * 1e9 / 4)}\n")
    assert lib_plan.machine_gb() == pytest.approx(whole / 4, rel=1e-6)
    (tmp_path / "v2" / "memory.max").write_text(f"{int(whole * 1e9 / 8)}\n")
    assert lib_plan.machine_gb() == pytest.approx(whole / 8, rel=1e-6)
