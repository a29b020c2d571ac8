"""The tools beside dapo.py: the memory planner (tools/plan.py, run_32b.sh --plan), the ladder's report
(tools/ladder.py), the memory sampler and the showcase's phases (tools/memwatch.py, tools/showcase.py), the demo
model's warm-start and tasks (lib/demo_model.py)."""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
import dataclasses
import json
import re
import pytest
from lib import demo_model
import dapo
from tests.shared import HERE, _run
import plan  # tools/plan.py, the memory planner


_PLAN_SCRIPT = r"""
import sys, torch, dapo
sys.path.insert(0, "tools")
import plan as planner
from torch.distributed._tools.mem_tracker import MemTracker
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import Qwen2Config, Qwen2ForCausalLM
B, S = 16, 128            # 2048 tokens as 16 sequences of 128
shape = (256, 4, 4, 2, 1024, 16384, True, 64)
h, L, nh, kv, i, V, tied, hd = shape
for case, (ckpt, chunk) in enumerate(((False, 1024), (True, 1024), (True, 128))):   # each its own model
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=h, num_hidden_layers=L, num_attention_heads=nh,
                                         num_key_value_heads=kv, head_dim=hd, intermediate_size=i, vocab_size=V,
                                         tie_word_embeddings=tied, max_position_embeddings=S,
                                         attn_implementation="sdpa", use_cache=False))
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, V, (B, S))
    tracker = MemTracker()   # counts live tensor bytes: no allocator, page or kernel-workspace effects
    tracker.track_external(model, ids)
    with tracker, sdpa_kernel(SDPBackend.MATH):   # the same attention ops on every CPU
        base = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
        hidden = model.model(input_ids=ids).last_hidden_state
        lp, _ = dapo.token_logprobs(hidden[:, :-1], model.lm_head.weight, ids[:, 1:], chunk=chunk)
        lp.sum().backward()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] - base
    plan = planner.activation_bytes(shape, B * S, 4, ckpt, chunk, seq=S, flash=False)
    print(case, peak / 2**20, plan / 2**20)
    del model, hidden, lp   # before the next model
"""


pytestmark = pytest.mark.timeout(1200, method="thread")  # the subprocess helpers time out first


def test_memory_plan_matches_measured_peak():
    """The plan's activation + logits estimate against the measured peak tensor memory of one
    forward + backward (fp32 on CPU, 16 sequences x 128 tokens, 4 layers, vocab 16k), with and
    without checkpointing, and with the head's chunk (128 tokens) below the hidden size (256), where a chunk's
    (V, h) weight gradient outweighs its logits: within 25%. Tensor bytes (torch's MemTracker), not process RSS, and
    sdpa's math kernel pinned: RSS moved 2x between CPUs with the kernel and allocator picked.
    The negative control: the same plan scaled by 1.5x or 0.6x fails."""
    within = lambda planned, measured: 0.75 < planned / measured < 1.25   # noqa: E731
    cases = _plans_vs_measured()
    assert set(cases) == {0, 1, 2}
    for case, (measured, planned) in cases.items():
        what = ("no checkpointing", "checkpointing", "checkpointing, chunk 128")[case]
        print(f"{what}: measured peak {measured:.0f} MiB, planned {planned:.0f} MiB "
              f"({planned / measured:.2f}x); scaled by 1.5 or 0.6: {1.5 * planned / measured:.2f}x, "
              f"{0.6 * planned / measured:.2f}x")
        assert within(planned, measured)
        assert not within(1.5 * planned, measured) and not within(0.6 * planned, measured)   # each case's control


def test_memory_plan_counts_what_lora_saves(capsys):
    """--lora-rank: the planner keeps the fp32 base and adds the adapters, r (in + out) per linear layer of the
    decoder, and counts gradients and AdamW state for the adapters alone, and no --kl-coef reference; the weight
    sync pushes the merged weights, as many bytes as without LoRA. Qwen2.5-7B on one 80 GB GPU (vLLM's share 0.45): with LoRA 64
    it fits under the plan's headroom, without it not (the full AdamW state alone is 61 GB)."""
    shape = plan.model_shape("Qwen2.5-7B")
    h, L, nh, kv, i, V, tied, hd = shape
    assert plan.lora_params(shape, 8) == L * 8 * ((h + h) + 2 * (h + kv * hd) + 2 * h + 2 * (h + i) + (i + h))
    full = plan.parse_config(["--model", "Qwen2.5-7B", "--max-response-len", "4096", "--overlong-cache-len", "1024",
                              "--micro-batch-size", "1", "--grad-checkpointing", "--plan-gpus-per-node", "1",
                              "--gpu-memory-utilization", "0.45"])
    lora = dataclasses.replace(full, lora_rank=64)
    (rows_full, v_full), (rows_lora, v_lora) = (plan.memory_plan(c, shape, 1, 1, 80.0) for c in (full, lora))
    f, lo = dict(rows_full), dict(rows_lora)
    A, P = v_lora["adapters"], v_full["params"]
    assert lo["sharded AdamW state (m, v)"] == 8 * A and f["sharded AdamW state (m, v)"] == 8 * P
    assert lo["sharded fp32 gradients"] == 4 * A and lo["sharded fp32 parameters (base + adapters)"] == 4 * (P + A)
    sync = [k for k in lo if k.startswith("weight sync")]
    assert lo[sync[0]] == f[[k for k in f if k.startswith("weight sync")][0]] == 2 * P
    # --kl-coef under LoRA: the reference is the policy with its adapters off, no second model to hold
    refs = [[k for k, _ in plan.memory_plan(dataclasses.replace(c, kl_coef=0.001), shape, 1, 1, 80.0)[0]
             if "reference" in k] for c in (full, lora)]
    assert len(refs[0]) == 1 and refs[1] == []
    print(f"Qwen2.5-7B on one 80 GB GPU: full {v_full['fits']} (training peak {f['peak while training'] / 1e9:.1f} GB), "
          f"LoRA 64 ({A / 1e6:.0f}M adapters) {v_lora['fits']} ({lo['peak while training'] / 1e9:.1f} GB)")
    assert v_lora["gpu_fits"] and not v_full["gpu_fits"]


def test_memory_plan_counts_the_kl_reference():
    """--kl-coef adds the frozen reference to what each GPU holds: sharded like the policy, in bf16 (2 bytes per
    parameter over the ranks); with --cpu-offload it is in host RAM instead. Without it, no such row."""
    args = ["--model", "Qwen/Qwen2.5-32B", "--max-response-len", "20480", "--tp-size", "4"]
    shape = plan.model_shape("Qwen/Qwen2.5-32B")
    rows, v = plan.memory_plan(plan.parse_config(args + ["--kl-coef", "0.001"]), shape, 16, 8, 80)
    ref = dict(rows)["sharded reference (bf16, --kl-coef)"]
    assert ref == pytest.approx(2 * v["params"] / 128)
    plain, _ = plan.memory_plan(plan.parse_config(args), shape, 16, 8, 80)
    assert not any("reference" in k for k, _ in plain)
    assert dict(rows)["peak while training"] == pytest.approx(dict(plain)["peak while training"] + ref)
    off = plan.parse_config(args + ["--kl-coef", "0.001", "--cpu-offload"])
    host = dict(plan.memory_plan(off, shape, 1, 8, 80)[1]["host"])
    assert "offloaded state (fp32 params, grads, AdamW, reference)" in host


def test_memory_plan_32b_recipe_fits_16_nodes():
    cfg = plan.parse_config(["--model", "Qwen/Qwen2.5-32B", "--max-response-len", "20480", "--tp-size", "4",
                             "--gpu-memory-utilization", "0.7", "--grad-checkpointing", "--micro-batch-tokens", "22528"])
    shape = plan.model_shape("Qwen/Qwen2.5-32B")
    rows, v = plan.memory_plan(cfg, shape, 16, 8, 80)
    assert 32.5e9 < v["params"] < 33e9 and v["fits"] and v["kv_seqs"] >= 1
    assert not plan.memory_plan(cfg, shape, 1, 8, 80)[1]["fits"]           # one node is too small


def test_memory_plan_host_ram_32b():
    """Host RAM per node at 32B (P = 32.76B): --cpu-offload on 1 node keeps 16 B/param there
    (524 GB); saving adds 8 HF files of 5 GB and 8 gathered embeddings (1.56 GB each); without
    offload on 16 nodes the peak is saving: 8 files of 5 GB (DCP staging, 12 B/param/128 ranks x 8
    = 24.6 GB, is less). A node too small for it fails the plan even when the GPUs fit."""
    cfg, shape = _plan("--cpu-offload")
    rows, v = plan.memory_plan(cfg, shape, 1, 8, 80)
    host = dict(v["host"])
    P, emb = v["params"], 152064 * 5120
    assert host["offloaded state (fp32 params, grads, AdamW)"] == pytest.approx(16 * P)
    assert host["peak while loading (a 5.0 GB weight file)"] == pytest.approx(32e9 + 4 * P + 5e9)  # scattered on GPU
    assert v["host_peak"] == pytest.approx(32e9 + 16 * P + 8 * 5e9 + 8 * emb * 2)
    assert 600e9 < v["host_peak"] < 620e9 and v["fits"] and v["gpu_fits"]
    cfg.plan_host_ram_gb = 512
    v = plan.memory_plan(cfg, shape, 1, 8, 80)[1]
    assert v["gpu_fits"] and not v["host_fits"] and not v["fits"]
    assert plan.memory_plan(cfg, shape, 2, 8, 80)[1]["fits"]           # 2 nodes halve the offloaded state
    cfg, shape = _plan()
    v = plan.memory_plan(cfg, shape, 16, 8, 80)[1]
    assert v["host_peak"] == pytest.approx(32e9 + max(12 * v["params"] / 16, 8 * 5e9))
    with pytest.raises(dapo.DapoError, match=r"^--plan needs positive sizes \(got --plan-nodes 0, --plan-host-ram-gb 0.0\)$"):
        plan.print_plan(_plan("--plan-nodes", "0", "--plan-host-ram-gb", "0")[0])


def test_plan_reads_the_weight_file_size_of_a_local_model(tmp_path, capsys):
    """A local model's largest safetensors file is what rank 0 holds while loading (a sparse
    7 GB file here); a hub name is assumed to have files of 5 GB."""
    from transformers import Qwen2Config
    Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2).save_pretrained(tmp_path)
    with open(tmp_path / "model-00001-of-00002.safetensors", "wb") as f:
        f.truncate(7_000_000_000)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x")
    plan.print_plan(plan.parse_config(["--model", str(tmp_path), "--plan-nodes", "1"]))
    out = capsys.readouterr().out
    print(out)
    assert re.search(r"peak while loading \(a 7\.0 GB weight file\) +39\.00 GB", out), out


def test_run_32b_plan():
    """`bash run_32b.sh --plan` needs no GPU, model or data: the recipe fits 16 nodes of "80 GB" GPUs (85e9 bytes,
    as torch reports an H100's: every peak under 90% of it) and host RAM, and its smallest cluster is 4 nodes (76.2
    GB while generating, 0.3 GB under the limit; 1-3 nodes overflow; 5-7: the mini-batches of 512 samples do not
    split over their ranks)."""
    out = _run(["bash", "run_32b.sh", "--plan"], timeout=300)
    print(out.stdout)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "on 16 node(s) x 8 GPUs of 85 GB" in out.stdout and "host RAM per node (8 ranks" in out.stdout
    assert re.search(r"^fits: yes \(GPU: yes; host RAM: peak \d+ GB of --plan-host-ram-gb 1000\)$", out.stdout, re.M)
    assert re.search(r"^headroom: the largest peak \(while \w+, [\d.]+ GB\) is \d+% of 85 GB; the plan allows 90% "
                     r"\(76\.50 GB\): [\d.]+ GB to spare$", out.stdout, re.M), out.stdout
    assert "smallest cluster that fits this config: 4 node(s) x 8 GPUs" in out.stdout


def test_demo_model_tool_runs_on_its_own(tmp_path):
    """lib/demo_model.py alone builds the demo's tiny model (a zero target: no warm-start steps)."""
    out = _run([sys.executable, "lib/demo_model.py", str(tmp_path / "m"), "--sft-target", "0"], timeout=120)
    assert out.returncode == 0 and "supervised warm-start (not DAPO) for 0 steps" in out.stdout, out
    assert json.load(open(tmp_path / "m" / "config.json"))["num_hidden_layers"] == 2


def test_warm_start_is_cached_by_everything_that_determines_it(tmp_path, monkeypatch):
    """The second build of the same demo model is a copy of the first (the same bytes); another target
    or seed is another entry."""
    monkeypatch.setenv("DAPO_CACHE", str(tmp_path / "cache"))
    info, cache, hit = demo_model.cached_build(str(tmp_path / "a"), "add", 0, 1e-6)
    assert not hit and info["sft_steps"] > 0
    info2, cache2, hit2 = demo_model.cached_build(str(tmp_path / "b"), "add", 0, 1e-6)
    assert hit2 and cache2 == cache and info2 == info
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert demo_model.cached_build(str(tmp_path / "c"), "add", 0, 0.0)[1] != cache
    assert dapo.parse_config(["--task", "carry"]).demo_sft_target == demo_model.WARM_START["carry"]["target"]
    assert dapo.parse_config([]).demo_sft_target == demo_model.WARM_START["add"]["target"]


def test_carry_task_solutions_levels_and_split(tmp_path):
    """The ladder's task: every reference solution is graded correct, lengths grow with the level
    (10-12 tokens at one column, 38-52 at five), the held-out split has every level and shares no problem with training."""
    import reward
    train, held = demo_model.demo_task(0, "carry")
    assert demo_model.carry_solution(347, 589) == "7+9=16\n4+8+1=13\n3+5+1=9\nAnswer: 936"
    assert demo_model.carry_solution(20, 8426) == "0+6=6\n2+2=4\n0+4=4\n0+8=8\nAnswer: 8446"
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    count = {n: sum(r["level"] == n for r in held) for n in range(1, 6)}
    assert count == {1: 20, 2: 250, 3: 250, 4: 250, 5: 250}
    assert sum(r["level"] == 1 for r in train) == 80      # all 100 one-column problems exist once
    assert demo_model.demo_task(1, "carry") == (train, held)  # a fixed dataset: the seed varies the model and sampling
    for r in train[:2000] + held:
        a, b = map(int, r["prompt"].split(demo_model.DAPO_HEAD)[1].split("=")[0].split("+"))
        assert r["answer"] == str(a + b) and r["level"] == max(len(str(a)), len(str(b)))
        assert reward.is_correct(r["solution"], r["answer"])
    path = str(tmp_path)
    demo_model.tiny_qwen2(demo_model.DEMO_TOKENS)[1].save_pretrained(path)  # the demo's tokenizer
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    lengths = {n: [len(tok(r["solution"])["input_ids"]) + 1 for r in held if r["level"] == n] for n in range(1, 6)}
    print({n: (min(v), max(v)) for n, v in lengths.items()})
    assert min(lengths[1]) >= 9 and max(lengths[5]) <= dapo.CARRY["max_response_len"] - dapo.CARRY["overlong_cache_len"]
    assert all(min(lengths[n]) < min(lengths[n + 1]) and max(lengths[n]) < max(lengths[n + 1]) for n in range(1, 5))
    assert max(map(len, dapo.encode_prompts(tok, [r["prompt"] for r in held]))) <= dapo.CARRY["max_prompt_len"]


def test_ladder_report_compares_per_step_and_per_response(tmp_path, capsys):
    """The report on two synthetic rungs: the later rung reaches the first rung's final accuracy
    in fewer steps but, generating 3x per step, not in fewer responses; it reports the responses generated
    per trained group (32 per step) and the median step time."""
    import argparse
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import ladder
    before = {"eval/avg@4": 0.2, **{f"eval/avg@4/d{n}": 0.2 for n in range(1, 6)}}
    for rung, (per_step, gain, secs) in {0: (256, 0.01, 2.0), 5: (768, 0.03, 5.0)}.items():
        for seed in (0, 1):
            d = tmp_path / f"rung{rung}" / f"seed{seed}"
            d.mkdir(parents=True)
            with open(d / "metrics.jsonl", "w") as f:
                for step in range(1, 21):
                    m = {"step": step, "gen/responses": per_step, "entropy/generated": 0.1,
                         "len/truncated_frac": 0.0, "filter/kept_frac": 0.5, "batch/effective_groups": 8,
                         "clip/high_frac": 0.0, "clip/low_frac": 0.0, "time/step": secs + (step % 3 == 0) * 9}
                    if step % 5 == 0:
                        m.update({k: round(0.2 + gain * step, 3) for k in before})
                    f.write(json.dumps(m) + "\n")
            after = {k: round(0.2 + gain * 20, 3) for k in before}
            stdout = "".join(f"eval ({t}): " + "  ".join(f"{k} {v:.3f}" for k, v in e.items()) + "\n"
                             for t, e in (("before", before), ("after", after)))
            (d / "evals.json").write_text(json.dumps({t: ladder.parse_eval(stdout, t) for t in ("before", "after")}))
    args = argparse.Namespace(root=str(tmp_path), seeds=[0, 1], eval_every=5, tail=5, variants=False, real=False,
                              png=str(tmp_path / "ladder.png"))
    ladder.report(args)
    rows = [[c.strip() for c in x.strip("| ").split(" | ")] for x in capsys.readouterr().out.splitlines()
            if x.startswith("| ")]
    grpo, full = ({h.split(" (")[0]: v for h, v in zip(rows[0], row)} for row in rows[1:3])   # by column name
    assert grpo["held-out avg@4"] == "0.400 ± 0.000" and full["held-out avg@4"] == "0.800 ± 0.000"   # after step 20
    assert grpo["steps to naive GRPO's final"] == "20 (2/2)" and full["steps to naive GRPO's final"] == "10 (2/2)"
    assert float(grpo["responses to it"]) == 20 * 256 and float(full["responses to it"]) == 10 * 768
    assert grpo["at its responses"] == "0.400" and full["at its responses"] == "0.350"   # DAPO's step 5: 0.35
    assert grpo["responses per trained group"] == "8.00" and full["responses per trained group"] == "24.00"
    assert grpo["s/step"] == "2.00" and full["s/step"] == "5.00"   # the median: a slow step in 3 does not move it


def test_real_ladder_report_table1_and_clip_higher_alone_from_the_records(tmp_path, capsys):
    """tools/ladder.py --real's report, from the records folder alone: Table 1's six rows in the paper's order,
    full DAPO's read at step 10 of Figure 2's 20-step DAPO runs (and said so); Clip-Higher alone in a table of its
    own beside naive GRPO, not in Table 1; the held-out split by the task's levels (levels.json); the share of
    distinct responses, pass@4 and the training accuracy over the second half of naive GRPO's responses (DAPO,
    generating twice as many a step, spends them by step 3); the held-out accuracy by seed; the git commit of
    every run, the one that differs marked, and the minutes each took."""
    ladder = _ladder()
    args = _real_args(tmp_path)
    _real_records(ladder, args.records)
    ladder.report_real(args)
    out = capsys.readouterr().out
    tables = _tables(out)
    table1, alone = tables[0], tables[1]
    assert list(table1) == ["naive GRPO", "+ overlong filtering", "+ Clip-Higher", "+ soft overlong punishment",
                            "+ token-level loss", "+ dynamic sampling (DAPO)"]
    assert list(alone) == ["naive GRPO", "GRPO + Clip-Higher"] and alone["naive GRPO"] == table1["naive GRPO"]
    grpo = table1["naive GRPO"]
    assert list(grpo)[3:5] == ["short d3", "long d4-d5"]
    assert list(grpo)[-3:] == ["distinct responses", "pass@4", "train acc at its responses"]
    # rung i's final held-out avg@4 is 0.1 (i + 1) + 0.01 seed; DAPO's at step 10 0.6 + 0.01 seed (0.9 + at step 20)
    assert [r["held-out avg@4 (mean ± sd)"] for r in table1.values()] == \
        ["0.110 ± 0.010", "0.210 ± 0.010", "0.310 ± 0.010", "0.410 ± 0.010", "0.510 ± 0.010", "0.610 ± 0.010"]
    assert alone["GRPO + Clip-Higher"]["held-out avg@4 (mean ± sd)"] == "0.060 ± 0.010"
    assert "Figure 2's DAPO runs (seeds 0, 1, 2) read at step 10" in out
    assert [r["distinct responses"] for r in table1.values()] == ["0.50", "0.55", "0.60", "0.65", "0.70", "0.75"]
    assert table1["+ dynamic sampling (DAPO)"]["responses/step"] == "128"
    assert table1["+ dynamic sampling (DAPO)"]["pass@4"] == "0.660 ± 0.010"
    # GRPO's 640 responses: its steps 6-10 (acc 0.6-1.0) against DAPO's steps 3-5 (256 < 384, 512, 640)
    assert grpo["train acc at its responses"] == "0.800 ± 0.000"
    assert table1["+ dynamic sampling (DAPO)"]["train acc at its responses"] == "0.400 ± 0.000"
    by_seed = tables[3]
    assert by_seed["+ dynamic sampling (DAPO)"]["seed 2"] == "0.100 -> 0.050 -> **0.620**"
    assert by_seed["DAPO (ε_high 0.28)"]["seed 4"] == "0.100 -> 0.050 -> 0.640 -> 0.050 -> **0.940**"
    assert "27 runs on git commit " + "a" * 40 + "; 1 on another (marked)" in out
    code = tables[4]
    assert code["dapo_eps_high_0.2"]["git commit"] == "aaaaaaaaaa, **bbbbbbbbbb (differs)**"
    assert code["grpo"]["minutes, by seed"] == "8.0 / 8.1 / 8.2" and code["dapo"]["steps"] == "20"


def test_real_ladder_figure2_table_by_arm(tmp_path, capsys):
    """Figure 2's table: by arm, the mean ± sd over 5 seeds of the final held-out avg@4 and pass@4 and of each seed's
    mean over the last 10 steps of the entropies, the distinct share, the upper clip's binding share and the
    probability metrics. prob/old_at_clip_high is absent from a step where the clip bound nowhere: the mean is over
    the steps that have it (0.12, not the 0.06 of counting the absent as 0), and a seed with none in its last steps
    is left out, said so (4/5 seeds)."""
    ladder = _ladder()
    args = _real_args(tmp_path)
    _real_records(ladder, args.records)
    ladder.report_real(args)
    arms = _tables(capsys.readouterr().out)[2]
    assert list(arms) == ["DAPO (ε_high 0.28)", "DAPO with ε_high 0.2"]
    dapo_arm, low = arms.values()
    assert list(dapo_arm)[1:] == ["held-out avg@4", "pass@4"] + [c for _, c, _ in ladder.FIGURE2_COLUMNS]
    assert dapo_arm["held-out avg@4"] == "0.920 ± 0.016" and low["held-out avg@4"] == "0.720 ± 0.016"
    assert dapo_arm["pass@4"] == "0.970 ± 0.016"
    assert dapo_arm["entropy (π_θ, trained tokens)"] == "0.320 ± 0.016"
    assert low["entropy/generated"] == "0.440 ± 0.016"
    assert dapo_arm["upper clip binds (%)"] == "0.4000 ± 0.1581"
    assert dapo_arm["π_θold where it binds"] == "0.120 ± 0.016"
    assert low["π_θold where it binds"] == "0.065 ± 0.013 (4/5 seeds)"
    assert dapo_arm["π_θold, every token"] == "0.800 ± 0.000"
    assert low["r of low-p tokens pushed up"] == "1.100 ± 0.000"


def test_real_ladder_runs_table1_cumulatively_and_figure2_with_one_difference(tmp_path):
    """--real's plan, as dapo.py parses its command lines (a model marked for the laptop preset, as
    tools/real_model.py's is): 28 runs; REAL's settings on every one, no checkpoint before the last step and one
    kept; Table 1's rows, 3 seeds, each one technique more than the row before, DAPO's row the 20-step runs of
    Figure 2 (its arms 5 seeds, differing in ε_high alone); Clip-Higher alone is naive GRPO with ε_high 0.28."""
    ladder = _ladder()
    args = _real_args(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"dapo_preset": "laptop"}))
    plan = ladder.real_plan()
    cfgs = {(job[0], job[1]): dapo.parse_config(ladder.real_command(args, str(model), *job)[2:]) for job in plan}
    assert len(plan) == len(cfgs) == 28
    order = [(f, s) for f, s, *_ in plan]  # a budget cut short leaves whole seeds of both experiments
    assert order[:6] == [(f, s) for s in (0, 1, 2) for f in ("dapo", "dapo_eps_high_0.2")]
    assert order[6:21] == [(f, s) for s in (0, 1, 2) for f in
                           ("grpo", "overlong_filtering", "plus_clip_higher", "soft_overlong", "token_level")]
    assert order[21:] == [(f, s) for s in (3, 4) for f in ("dapo", "dapo_eps_high_0.2")] + [
        ("clip_higher", s) for s in (0, 1, 2)]
    for (folder, seed), cfg in cfgs.items():
        dapo.check_config(cfg)
        assert (cfg.max_response_len, cfg.overlong_cache_len, cfg.num_mini_batches, cfg.eval_every,
                cfg.eval_samples, cfg.eval_max_prompts) == (64, 16, 4, 5, 4, 96)
        assert cfg.prompts_per_step == dapo.LAPTOP["prompts_per_step"] and cfg.lr == dapo.LAPTOP["lr"]
        assert cfg.save_every == 0 and cfg.keep_checkpoints == 1 and cfg.seed == seed
        assert cfg.out_dir == str(tmp_path / "runs" / folder / f"seed{seed}") and cfg.model == str(model)
    seeds = lambda folder: sorted(s for f, s in cfgs if f == folder)  # noqa: E731
    folders = [f for *_, f in ladder.REAL_RUNGS]
    assert all(seeds(f) == [0, 1, 2] for f in folders[:-1] + ["clip_higher"])
    assert seeds("dapo") == seeds("dapo_eps_high_0.2") == [0, 1, 2, 3, 4]
    differ = lambda a, b: {k for k, v in dataclasses.asdict(a).items() if dataclasses.asdict(b)[k] != v} - {"out_dir"}
    rows = [cfgs[(f, 1)] for f in folders]
    grpo, full = rows[0], rows[-1]
    assert grpo.eps_high == 0.2 and not (grpo.overlong_filtering or grpo.soft_overlong_punishment or
                                         grpo.token_level_loss or grpo.dynamic_sampling)
    assert full.eps_high == 0.28 and full.overlong_filtering and full.soft_overlong_punishment
    assert full.token_level_loss and full.dynamic_sampling and full.steps == 20 and grpo.steps == 10
    assert [differ(a, b) for a, b in zip(rows, rows[1:])] == [
        {"overlong_filtering"}, {"eps_high"}, {"soft_overlong_punishment"}, {"token_level_loss"},
        {"dynamic_sampling", "steps"}]
    assert differ(grpo, cfgs[("clip_higher", 1)]) == {"eps_high"} and cfgs[("clip_higher", 1)].eps_high == 0.28
    for seed in range(5):
        assert differ(cfgs[("dapo", seed)], cfgs[("dapo_eps_high_0.2", seed)]) == {"eps_high"}
        assert cfgs[("dapo_eps_high_0.2", seed)].eps_high == 0.2


def test_real_ladder_cost_skips_finished_runs_and_copies_their_records(tmp_path, monkeypatch, capsys):
    """The experiment's bookkeeping on fake run folders (no dapo.py run): a run is finished when its metrics.jsonl
    holds all its steps, the last with the final evaluation; finished records are skipped, a finished run whose
    records were not copied is copied rather than run again; a cut run, a cut line, or a 10-step run where 20 are
    planned is to go. The cost line counts the runs to go by kind, at the finished runs' own minutes where there
    are some. A run that finishes has its records copied (not samples.jsonl) and its checkpoints deleted; one that
    exits 0 without its last step stops the experiment."""
    import pathlib
    import subprocess
    ladder = _ladder()
    args = _real_args(tmp_path)
    runs, records = tmp_path / "runs", tmp_path / "records"
    _fake_run(records / "grpo" / "seed0", 10, minutes=7.0)          # finished, copied
    _fake_run(runs / "grpo" / "seed1", 10, checkpoint=True)          # finished, not copied
    _fake_run(runs / "grpo" / "seed2", 10, cut=4)                    # stopped at step 6
    _fake_run(runs / "dapo" / "seed0", 10)                           # 10 steps of the 20 planned
    _fake_run(records / "clip_higher" / "seed0", 10)
    with open(records / "clip_higher" / "seed0" / "metrics.jsonl", "a") as f:
        f.write('{"step": 11, "eval')                                 # a line cut by a kill
    _fake_run(records / "token_level" / "seed0", 10)
    rows = [json.loads(x) for x in (records / "token_level" / "seed0" / "metrics.jsonl").read_text().splitlines()]
    del rows[-1]["eval/avg@4"]                                       # every step, not the final evaluation
    (records / "token_level" / "seed0" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plan = ladder.real_plan()
    todo, uncopied = ladder.to_go(args, plan)
    done = [(f, s) for f, s, *_ in plan if all((f, s) != (g, t) for g, t, *_ in todo)]
    assert done == [("grpo", 0), ("grpo", 1)] and [(f, s) for f, s, *_ in uncopied] == [("grpo", 1)]
    assert ladder.cost_line(args, plan, todo) == (
        "26 of 28 runs to go (finished ones skipped): 16 x ~7.0 min (10 steps; the mean of 1 finished), "
        "10 x ~11.5 min (20 steps, dynamic sampling; estimated): ~227 minutes (~3.8 hours) on 2 CPU cores")
    ladder.copy_records(str(runs / "grpo" / "seed1"), str(records / "grpo" / "seed1"))
    assert sorted(os.listdir(records / "grpo" / "seed1")) == ["ladder.json", "metrics.jsonl", "run.json", "stdout.txt"]
    for name in ladder.RECORDS:
        assert (records / "grpo" / "seed1" / name).read_bytes() == (runs / "grpo" / "seed1" / name).read_bytes()
    assert not (runs / "grpo" / "seed1" / "checkpoints").exists()
    assert (runs / "grpo" / "seed1" / "samples.jsonl").exists()
    assert ladder.to_go(args, plan)[1] == [] and len(ladder.to_go(args, plan)[0]) == 26

    real_run = subprocess.run

    def fake_dapo(cmd, **kw):  # writes what dapo.py writes; git and the rest run for real
        if not cmd[1].endswith("dapo.py"):
            return real_run(cmd, **kw)
        cfg = dapo.parse_config(cmd[2:])
        _fake_run(pathlib.Path(cfg.out_dir), cfg.steps, checkpoint=True, cut=cut)
        return subprocess.CompletedProcess(cmd, 0, "eval (after): eval/avg@4 0.500\n", "")
    monkeypatch.setattr(ladder.subprocess, "run", fake_dapo)
    cut = 0
    job = next(j for j in todo if j[:2] == ("grpo", 2))
    ladder.run_real(args, "model", job)
    kept = records / "grpo" / "seed2"
    assert sorted(os.listdir(kept)) == ["ladder.json", "metrics.jsonl", "run.json", "stdout.txt"]
    assert (kept / "stdout.txt").read_text().startswith("eval (after): eval/avg@4 0.500")
    assert set(json.loads((kept / "ladder.json").read_text())) == {"minutes", "uncommitted"}
    assert not (runs / "grpo" / "seed2" / "checkpoints").exists()
    assert ("grpo", 2) not in [j[:2] for j in ladder.to_go(args, plan)[0]]
    cut = 1
    with pytest.raises(SystemExit, match=r"^failed \(exit code 0, its metrics.jsonl unfinished\)"):
        ladder.run_real(args, "model", next(j for j in todo if j[:2] == ("dapo", 0)))
    assert not (records / "dapo" / "seed0").exists()


# -----------------------------------------------------------------------------------------
# Helpers

def _plans_vs_measured():
    """{case (_PLAN_SCRIPT's: 0, 1, 2): (measured, planned) MiB}, from one process."""
    out = _run([sys.executable, "-c", _PLAN_SCRIPT], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.strip().splitlines()]
    return {int(c): (float(m), float(p)) for c, m, p in rows}


def _plan(*args):
    cfg = plan.parse_config(["--model", "Qwen/Qwen2.5-32B", "--max-response-len", "20480", "--tp-size", "4",
                             "--gpu-memory-utilization", "0.7", "--grad-checkpointing", "--micro-batch-tokens",
                             "22528", *args])
    return cfg, plan.model_shape(cfg.model)


def _ladder():
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import ladder
    return ladder


def _real_args(tmp_path):
    """tools/ladder.py --real's arguments, its folders under tmp_path (no plot: matplotlib is optional)."""
    import argparse
    return argparse.Namespace(root=str(tmp_path / "runs"), records=str(tmp_path / "records"), tail=25, real=True,
                              variants=False, extra=[], print_commands=False, png=str(tmp_path / "ladder.png"),
                              figure2_png=str(tmp_path / "figure2.png"))


def _tables(out):
    """The markdown tables of a report, in order, each {first cell: {column: cell}}."""
    tables, rows = [], []
    for line in out.splitlines() + [""]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip()[1:-1].split(" | ")])
        elif rows:
            head = rows[0]
            tables.append({row[0]: dict(zip(head, row)) for row in rows[2:]})
            rows = []
    return tables


def _fake_run(path, steps, cut=0, minutes=8.0, checkpoint=False, commit="a" * 40, row=None):
    """A run folder as dapo.py and tools/ladder.py leave it: `steps` rows of metrics (the last `cut` left out), the
    held-out evaluation before training in step 1's row and every 5 steps, run.json, ladder.json; row(step) adds
    to each row."""
    os.makedirs(path / "checkpoints" / f"step_{steps:06d}" if checkpoint else path, exist_ok=True)
    evals = ["eval/avg@4", "eval/pass@4"] + [f"eval/avg@4/d{n}" for n in (3, 4, 5)]
    rows = []
    for s in range(1, steps + 1):
        m = {"step": s, "gen/responses": 64, "entropy/generated": 0.3, "entropy": 0.2, "len/truncated_frac": 0.0,
             "filter/kept_frac": 0.5, "batch/effective_groups": 3, "clip/high_frac": 0.001, "clip/low_frac": 0.0,
             "time/step": 30.0, "gen/distinct_frac": 0.5, "acc/mean": s / 10, "prob/old": 0.8}
        m.update({k: 0.05 for k in evals} if s % 5 == 0 else {})
        m.update({"eval_before/" + k.split("/", 1)[1]: 0.1 for k in evals} if s == 1 else {})
        m.update(row(s) if row else {})
        rows.append(m)
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rows[:steps - cut]))
    (path / "samples.jsonl").write_text("{}\n")
    (path / "run.json").write_text(json.dumps({"git_commit": commit, "config": {"steps": steps}}))
    (path / "stdout.txt").write_text("eval (after): eval/avg@4 0.050\n")
    (path / "ladder.json").write_text(json.dumps({"minutes": minutes, "uncommitted": []}))


def _real_records(ladder, records):
    """Records of every run of --real's plan: rung i's final held-out avg@4 0.1 (i + 1) + 0.01 seed (Clip-Higher
    alone 0.05 + 0.01 seed), pass@4 0.05 more; Figure 2's DAPO arm 0.6 + 0.01 seed at step 10 and 0.9 + at step 20,
    its ε_high 0.2 arm 0.7 + at step 20; their probabilities by step (prob/old_at_clip_high on even steps alone, and
    never after step 10 for the ε_high 0.2 arm's seed 4); one run on another commit."""
    import pathlib
    records = pathlib.Path(records)
    records.mkdir(parents=True)
    (records / "levels.json").write_text(json.dumps({"3": 32, "4": 32, "5": 32}))
    finals = {f: 0.1 * (i + 1) for i, (*_, f) in enumerate(ladder.REAL_RUNGS)} | {"clip_higher": 0.05}
    distinct = {f: 0.5 + 0.05 * i for i, (*_, f) in enumerate(ladder.REAL_RUNGS)}
    for folder, seed, settings, _ in ladder.real_plan():
        arm = {"dapo": 0, "dapo_eps_high_0.2": 1}.get(folder)

        def row(s, folder=folder, seed=seed, arm=arm):
            m = {"gen/distinct_frac": distinct.get(folder, 0.5)}
            final = finals.get(folder, 0.0) + 0.01 * seed
            if arm is not None:   # Figure 2's arms
                final = (0.6 if s == 10 else 0.9 - 0.2 * arm) + 0.01 * seed
                m.update({"gen/responses": 128, "entropy": 0.3 - 0.1 * arm + 0.01 * seed,
                          "entropy/generated": 0.4 + 0.02 * arm + 0.01 * seed, "clip/high_frac": 0.002 + 0.001 * seed,
                          "gen/distinct_frac": 0.75 if arm == 0 else 0.6, "prob/low_up_ratio": 1.1})
                if s % 2 == 0 and not (arm == 1 and seed == 4 and s > 10):
                    m["prob/old_at_clip_high"] = (0.1 - 0.05 * arm) + 0.01 * seed
            if s in (10, settings["steps"]):
                m.update({k: final for k in ("eval/avg@4", "eval/avg@4/d3", "eval/avg@4/d4", "eval/avg@4/d5")})
                m["eval/pass@4"] = final + 0.05
            return m
        _fake_run(records / folder / f"seed{seed}", settings["steps"], row=row, minutes=8.0 + 0.1 * seed,
                  commit="b" * 40 if (folder, seed) == ("dapo_eps_high_0.2", 3) else "a" * 40)


def test_bench_prefix_table_gives_medians_over_alternated_runs_and_the_plan_beside_the_peak():
    """tools/bench_prefix.py's table, on made-up runs (their rows after the first step, as run keeps them): the
    medians over every run of a way, the largest run's peak memory beside its plan and the share of a
    micro-batch's transient memory the allocator kept by then (the CPU_KEPT that would make the plan exact), and
    each way's update against the faster of the two forced ways."""
    import bench_prefix
    from lib import plan
    rows = lambda u, s, n: [{"time/update": u * k, "time/step": s * k, "update/tokens": n} for k in (1, 2, 3)]  # noqa
    run = lambda u, s, n, peak: (rows(u, s, n), peak, 4.0, 2.0)   # noqa: E731  plan 4 GB, 2 GB transient
    out = bench_prefix.table({"ladder": {"default": [run(2.1, 5.1, 1500, 5.0), run(2.1, 5.1, 1500, 4.0)],
                                         "shared": [run(2.0, 5.0, 1500, 5.5)], "plain": [run(6.0, 9.0, 6000, 6.5)]}})
    print(out)
    k = lambda peak: (peak - 4.0) / 2.0 + plan.CPU_KEPT   # noqa: E731
    assert f"| ladder | plain | 1 | 12.00 | 18.00 | 6,000 | 6.50 | 4.00 | {k(6.5):.2f} | 3.00 |" in out
    assert f"| ladder | shared | 1 | 4.00 | 10.00 | 1,500 | 5.50 | 4.00 | {k(5.5):.2f} | 1.00 |" in out
    assert f"| ladder | default | 2 | 4.20 | 10.20 | 1,500 | 5.00 | 4.00 | {k(5.0):.2f} | 1.05 |" in out
    assert bench_prefix.flags({"dedup": False, "lr": 1e-5}) == ["--no-dedup", "--lr", "1e-05"]


def test_bench_kernels_times_each_alternative_and_checks_it_computes_the_same():
    """tools/bench_kernels.py at a small shape: every row printed; the split attention (each response against its
    prompt and itself) gives the shared-prompt mask's output within bf16's rounding, eager attention too; the fp32
    head's backward is within one bf16 rounding of fp64, with bf16 operands within two (a per-token gradient
    rounded to bf16 twice); flex attention either ran or says why not."""
    out = _run([sys.executable, "tools/bench_kernels.py", "--prompt", "24", "--responses", "3", "--response-len", "8",
                "--vocab", "2048", "--repeat", "1"], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    print(out.stdout)
    rows = {line[:46].strip(): line[46:].split() for line in out.stdout.splitlines() if ":" in line[:46]}
    assert len(rows) == 10, rows
    for name in ("attention: sdpa, split (the pairs it keeps)", "attention: eager, shared-prompt mask",
                 "rms norm: torch's fused rms_norm"):
        assert float(rows[name][2]) < 0.07, (name, rows[name])   # bf16: 1/128 of outputs of up to ~4
    assert rows["attention: flex, shared-prompt block mask"][2] == "refused:" or \
        float(rows["attention: flex, shared-prompt block mask"][2]) < 0.07
    ratio = lambda name: float(rows[name][-3].rstrip("x"))   # noqa: E731
    assert ratio("head backward: fp32 matmuls (dapo.py)") < 1.05   # bf16's own kernels or not, within 2x:
    assert 0.99 < ratio("head backward: bf16 operands") < 2.0     # ~1.4x where oneDNN runs them (AMX)


def _fake_proc(root, procs):
    """A /proc of our own: {pid: (ppid, argv, RssAnon kB, Pss_File kB)}; a process with RssAnon None is a zombie."""
    for pid, (ppid, argv, anon, files) in procs.items():
        d = root / str(pid)
        d.mkdir(exist_ok=True)
        (d / "stat").write_text(f"{pid} ({argv[0][:15]} (x) y) S {ppid} {pid} 0 0 -1\n")  # a name with ( ) and spaces
        (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        (d / "status").write_text(f"Name:\tx\nVmRSS:\t{(anon or 0) + files} kB\n"
                                  + (f"RssAnon:\t{anon} kB\n" if anon is not None else ""))
        (d / "smaps_rollup").write_text(f"00400000-7fff [rollup]\nRss: {(anon or 0) + files} kB\n"
                                        f"Pss_File: {files} kB\nPss_Shmem: 0 kB\n")


def test_memwatch_sums_a_process_tree_and_finds_its_peak(tmp_path, monkeypatch):
    """tools/memwatch.py on a /proc of our own: the tree of a pid (its children's children, not its neighbours or
    parent), each process named (reward.py's workers by what they run), its memory its anonymous pages plus its
    share of files, the latter read from smaps_rollup at most every 5 s; a zombie left out. Over samples: the
    peak of the sum, what each held then, and each name's own peak as the most its processes held at once (a
    worker and its replacement never count twice)."""
    import memwatch
    worker = ["python", "-c", "import reward; reward._worker_main('reward:MATH')"]
    _fake_proc(tmp_path, {1: (0, ["init"], 10, 0), 100: (1, ["python", "dapo.py", "--x"], 5_000_000, 200_000),
                          101: (100, worker, 40_000, 10_000), 102: (101, ["sh"], 1_000, 500),
                          103: (100, worker, None, 0), 200: (1, ["python", "other.py"], 9_000_000, 0)})
    assert memwatch.tree(100, str(tmp_path)) == [100, 101, 103, 102]
    cache = {"names": {}, "shared": {}}
    snap = memwatch.snapshot(100, str(tmp_path), cache)
    assert sorted(snap) == [100, 101, 102]  # 103: a zombie
    assert snap[100] == {"name": "dapo.py", "Pss": 5_200_000, "Anon": 5_000_000, "Files": 200_000, "Shmem": 0,
                         "Rss": 5_200_000}
    assert snap[101]["name"] == "reward worker" and snap[102]["name"] == "sh"
    _fake_proc(tmp_path, {100: (1, ["python", "dapo.py"], 6_000_000, 900_000)})
    assert memwatch.snapshot(100, str(tmp_path), cache)[100]["Pss"] == 6_000_000 + 200_000  # files: 5 s old at most
    now = memwatch.time.monotonic()
    monkeypatch.setattr(memwatch.time, "monotonic", lambda: now + 6)
    assert memwatch.snapshot(100, str(tmp_path), cache)[100]["Pss"] == 6_900_000
    row = lambda name, pss: {"name": name, "Pss": pss, "Anon": pss, "Files": 0, "Shmem": 0, "Rss": pss}  # noqa: E731
    samples = [(0.0, {100: row("dapo.py", 3_000_000)}),
               (1.0, {100: row("dapo.py", 5_000_000), 101: row("reward worker", 50_000)}),
               (2.0, {100: row("dapo.py", 4_000_000), 101: row("reward worker", 60_000),
                      104: row("reward worker", 40_000)}),
               (3.0, {100: row("dapo.py", 4_900_000), 104: row("reward worker", 80_000), 105: row("reward worker", 90_000)})]
    p = memwatch.peaks(samples)
    assert p["sum_kb"] == 5_070_000 and p["t"] == 3.0 and sorted(p["at_peak"]) == [100, 104, 105]
    assert p["own"] == {"dapo.py": {"Pss": 5_000_000, "Rss": 5_000_000},
                        "reward worker": {"Pss": 170_000, "Rss": 170_000}}  # 3 pids' peaks would sum to 200,000
    lines = memwatch.table(samples, 0.0, "update of step 2")  # in GB of 1e9 bytes, from kB of 1024
    assert lines[0] == ("peak of all processes' memory (PSS): 5.19 GB, 3 s in, in the update of step 2; "
                        "at that moment:"), lines
    assert re.match(r" +dapo.py +5.02 +5.02 +0.00 +0.00 +5.12$", lines[2]), lines
    assert re.match(r" +reward worker x2 +0.17 +0.17 +0.00 +0.00 +0.17$", lines[3]), lines


def test_showcase_tells_the_memory_peak_by_phase():
    """tools/showcase.py's phases from when the run's lines came and its metrics: start-up up to the evaluation
    before training, then per step generation + scoring, the update and the sync for the seconds the metrics give,
    evaluation and logs up to the step's own line; after the last, the checkpoint. The peak of each phase, and the
    report's line for the run's peak, name them."""
    import showcase
    lines = [(1.0, "presets: laptop\n"), (30.0, "eval (before): eval/avg@4 0.1\n"),
             (60.0, "step    1  acc 0.1\n"), (100.0, "eval (step 2): eval/avg@4 0.3\n"),
             (101.0, "step    2  acc 0.2\n")]
    metrics = [{"step": 1, "time/step": 29.0, "time/update": 20.0, "time/sync": 1.0},
               {"step": 2, "time/step": 30.0, "time/update": 18.0, "time/sync": 2.0}]
    spans = showcase.phases(lines, metrics, 120.0)
    assert spans == [(0.0, 30.0, "start-up, evaluation before", None),
                     (30.0, 38.0, "generation + scoring", 1), (38.0, 58.0, "update", 1), (58.0, 59.0, "weight sync", 1),
                     (59.0, 60.0, "evaluation, logs", 1),
                     (60.0, 70.0, "generation + scoring", 2), (70.0, 88.0, "update", 2), (88.0, 90.0, "weight sync", 2),
                     (90.0, 101.0, "evaluation, logs", 2), (101.0, 120.0, "checkpoint, exit", None)]
    assert showcase.phases(lines[:3], metrics, 120.0) == []  # a line missing: no phases rather than wrong ones
    row = lambda pss: {100: {"name": "dapo.py", "Pss": pss, "Anon": pss, "Files": 0, "Shmem": 0, "Rss": pss}}  # noqa: E731
    samples = [(t, row(kb)) for t, kb in ((10, 3e6), (35, 4e6), (50, 6e6), (80, 6.5e6), (95, 5e6), (110, 5.5e6))]
    assert showcase.phase_peaks(samples, spans) == {
        "start-up, evaluation before": (3e6, 10), "generation + scoring": (4e6, 35), "update": (6.5e6, 80),
        "evaluation, logs": (5e6, 95), "checkpoint, exit": (5.5e6, 110)}  # no sample fell in a sync
    out = showcase.memory_lines({"memory": {"lines": lines, "samples": samples, "end": 120.0}, "metrics": metrics})
    assert out[0].startswith("peak of all processes' memory (PSS): 6.66 GB, 80 s in, in the update of step 2;"), out
    assert out[-1] == ("  each phase's peak (GB): start-up, evaluation before 3.07, generation + scoring 4.10, "
                       "update 6.66, evaluation, logs 5.12, checkpoint, exit 5.63"), out
