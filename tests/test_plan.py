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
    """The README's "Which set-up" rows for GPUs (those that install requirements.txt), as (GPUs per node, the
    command's arguments): `python dapo.py`
    runs on one GPU, `torchrun --nproc_per_node=N dapo.py` on N; the `...` placeholders of data files stay
    (the plan reads no data). The run_32b.sh row is returned as its command alone."""
    rows = [line.split("|") for line in open(os.path.join(HERE, "README.md")) if line.startswith("|")]
    out = []
    for cells in rows:
        if len(cells) < 4 or "requirements.txt" not in cells[2]:  # the GPU rows install requirements.txt
            continue
        command = re.search(r"`([^`]+)`", cells[3]).group(1)
        words = shlex.split(command)
        if words[0] == "torchrun":
            gpus = int(next(w for w in words if w.startswith("--nproc_per_node=")).split("=")[1])
            out.append((gpus, words[words.index("dapo.py") + 1:]))
        elif words[:2] == ["python", "dapo.py"]:
            out.append((1, words[2:]))
        else:
            out.append((None, words))
    return out


def test_readme_gpu_commands_fit_the_plan_with_headroom():
    """Each GPU command of the README's "Which set-up" table, as a user copies it, fits one node of "80 GB" GPUs
    (85.0e9 bytes as torch reports an H100's) by the plan: every phase's peak under 90% of the GPU, vLLM's KV cache
    holding a max-length sequence, and host
    RAM. The plan applies the CUDA preset (gradient checkpointing, one max-length sequence per micro-batch);
    without it the 7B command needs ~840 GB a GPU while training. The table's last row, `bash run_32b.sh`, is
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
    assert r["peak while training"] == pytest.approx(states + r["sharded fp32 gradients"] + transient * 4 / 3
                                                     + r["vLLM asleep: CUDA-graph pool, buffers"] + process)
    assert r["peak while loading (the largest tensor whole)"] == pytest.approx(
        r["sharded fp32 parameters"] + 0.7 * 80 * GB + 152064 * 5120 * 2 + process, rel=1e-3)
    assert 0.5 * GB < copy < 2 * GB and r["vLLM asleep: CUDA-graph pool, buffers"] >= 1 * GB
    temporary = r["AdamW's step temporary (an fp32 shard)"]   # torch's foreach AdamW: sqrt(v) into new tensors
    assert temporary == pytest.approx(r["sharded fp32 gradients"]) and abs(temporary / (4 * P / 128) - 1) < 0.01
    assert r["peak while stepping AdamW"] == pytest.approx(states + r["sharded fp32 gradients"] + temporary
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
