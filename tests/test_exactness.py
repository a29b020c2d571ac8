"""Exactness across ranks and layouts: 2 ranks = 1 process for every objective, packed rows = padded rows, the
fp32 head, the weight sync against vLLM's own log-probs, what each rank receives, loads and exports."""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
import json
import re
import shutil
import pytest
import torch
from lib import interrupt
import dapo
from tests.shared import (
    GRAD_RTOL, KNOBS, _grads, _padded_collate, _padded_forward_logprobs, _relative_gap, _run, _toy_samples,
    _torchrun)


_MEM_SCRIPT = r"""
import json, torch, dapo
from torch.distributed._tools.mem_tracker import MemTracker
T, h, V = 2048, 256, 32768


def peak(mode):   # its own tensors and tracker, all freed on return
    hidden = torch.randn(1, T, h).requires_grad_()   # fp32: CPUs without bf16 units take minutes in bf16
    weight = (torch.randn(V, h) / 16).requires_grad_()
    targets = torch.randint(0, V, (1, T))
    tracker = MemTracker()   # live tensor bytes, the same on every CPU (RSS depends on the allocator)
    tracker.track_external(hidden, weight, targets)
    with tracker:
        base = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
        if mode == "fused":
            lp, _ = dapo.token_logprobs(hidden, weight, targets, chunk=256)
        else:   # the plain head: the whole (T, V) logits, then log_softmax
            logits = hidden @ weight.T
            lp = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]
        lp.sum().backward()
    return (tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] - base) / 2**20


print(json.dumps({mode: peak(mode) for mode in ("naive", "fused")}))
"""


pytestmark = pytest.mark.timeout(1200, method="thread")  # the subprocess helpers time out first


def test_gradient_2_ranks_x_2_micro_batches_equals_1_process(tiny_model, tmp_path):
    """For every --loss variant (with its preset) and every knob of KNOBS: the exact global normaliser
    makes 2 ranks x 2 micro-batches give the gradient of 1 process and 1 micro-batch, within GRAD_RTOL of each
    gradient's largest entry. The choices made over the whole mini-batch are made alike: the entropy threshold
    over both ranks' tokens, and Clip-Cov's and KL-Cov's tokens (select_tokens), which verl picks per
    micro-batch."""
    (v1, _), (v2, _) = _grads(tiny_model, tmp_path, 8, 0, 0, 0, 1), _grads(tiny_model, tmp_path, 2, 0, 0, 0, 1, nproc=2)
    assert list(v1) == list(v2) == list(dapo.OBJECTIVES) + list(KNOBS) and "sapo" in v1
    assert [k for k, e in dapo.OBJECTIVES.items() if e.get("picks")] == ["clip_cov", "kl_cov"]
    for loss in v1:
        assert v1[loss].keys() == v2[loss].keys()
        worst, scale = _relative_gap(v1[loss], v2[loss])
        print(f"{loss}: max |grad(2 ranks x 2 micro) - grad(1 x 1)| = {worst * scale:.2e}, {worst:.1e} of the "
              f"largest grad entry {scale:.2e}")
        assert scale > 1e-4 and worst < GRAD_RTOL
        if loss == "dapo":
            assert scale > 1e-3


def test_token_budget_and_checkpointing_give_the_same_gradient(tiny_model, tmp_path):
    plain, _ = _grads(tiny_model, tmp_path, 8)
    # a budget of 24 padded tokens: sequences of 4..12 tokens pack 1-4 to a micro-batch, and the
    # two ranks end up with different counts, so one of them runs a zero-weight extra micro-batch
    budget, out = _grads(tiny_model, tmp_path, 8, 24, 0, nproc=2)
    counts = json.loads(re.search(r"micro-batches per rank (\{.*\})", out).group(1))
    assert len(counts["0"]) == len(counts["1"]) and 0 in counts["1"]   # rank 1 runs zero-weight extras (0)
    ckpt, _ = _grads(tiny_model, tmp_path, 4, 0, 1)
    for name, g in (("token budget, 2 ranks", budget), ("activation checkpointing", ckpt)):
        worst, scale = _relative_gap(plain, g)
        print(f"{name}: max |grad - plain grad| = {worst:.1e} of the largest entry; micro-batches {counts}")
        assert worst < GRAD_RTOL


def test_packed_gradient_equals_the_padded_path(tiny_model, tmp_path):
    """The gradient of one mini-batch through FSDP2 with packed rows equals the padded layout's
    (the reference above, run through the same policy_gradient), in one process and on 2 ranks
    with a budget of real tokens, also with every sequence of a micro-batch in one row (the layout
    flex and flash attention get on GPU; sdpa computes it here); the policy has the KV cache off."""
    padded, out = _grads(tiny_model, tmp_path, 8, 0, 0, 1)
    assert "use_cache False" in out and 'layouts ["padded"]' in out    # the reference's layout really ran
    packed, out_packed = _grads(tiny_model, tmp_path, 8)
    ranks, out_ranks = _grads(tiny_model, tmp_path, 8, 24, 0, nproc=2)
    one_row, out_one = _grads(tiny_model, tmp_path, 8, 24, 0, 0, 0, 1, nproc=2)
    assert 'layouts ["packed rows"]' in out_packed and 'layouts ["packed rows"]' in out_ranks
    assert '"one row"' in out_one and "padded" not in out_one and "packed rows" not in out_one
    for name, g in (("packed, 1 process", packed), ("packed, 2 ranks, 24-token budget", ranks),
                    ("one row per micro-batch (the GPU layout), 2 ranks, 24-token budget", one_row)):
        worst, scale = _relative_gap(padded, g)
        print(f"{name}: max |grad - padded grad| = {worst:.1e} of the largest entry {scale:.2e}")
        assert worst < GRAD_RTOL and scale > 1e-3


def test_packed_rows_never_attend_across_sequences():
    """Each sequence's log-probs in packed rows equal those of the sequence alone (the padded
    reference, and a row of its own), whatever shares its row: in rows (sdpa, the CPU layout), and all
    in one row under flex attention (the GPU layout). The model here keeps config.use_cache=True, as a
    fresh HF model does: with a KV cache transformers skips packed-row detection and attention leaks
    across sequences (0.78 nats here), so forward_logprobs must turn the cache off itself."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                                         attn_implementation="sdpa")).eval()
    assert model.config.use_cache
    samples = _ragged_samples()
    b = dapo.collate(samples, 0, "cpu")
    longest = max(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    real = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    assert b["input_ids"].shape[1] == longest and b["input_ids"].shape[0] < len(samples)   # rows are shared
    assert "attention_mask" not in b and b["position_ids"][0, 0] == 0
    with torch.no_grad():
        lp, ent = dapo.forward_logprobs(model, b, 0.7, 5)
        ref, ref_ent = _padded_forward_logprobs(model, _padded_collate(samples, 0, "cpu"), 0.7, 5)
        alone = [dapo.forward_logprobs(model, dapo.collate([s], 0, "cpu"), 0.7, 5)[0][0] for s in samples]
    mask = b["mask"].bool()
    worst_ref = (lp - ref)[mask].abs().max().item()
    worst_alone = max((lp[i, :len(a)] - a).abs().max().item() for i, a in enumerate(alone))
    print(f"{len(samples)} sequences ({real} tokens) in {b['input_ids'].shape[0]} rows of {longest} "
          f"(padded layout: {_padded_collate(samples, 0, 'cpu')['input_ids'].numel()} tokens); "
          f"max |packed - padded| {worst_ref:.1e}, |packed - alone| {worst_alone:.1e}")
    assert worst_ref < 1e-5 and worst_alone < 1e-5
    assert (ent - ref_ent)[mask].abs().max() < 1e-5 and lp[~mask].abs().sum() == 0
    # the one-row layout under transformers' flex_attention (what a GPU runs), forward only: torch 2.13 has no
    # flex attention backward on CPU; test_packed_gradient_equals_the_padded_path checks its gradient via sdpa
    model.config._attn_implementation = "flex_attention"
    with torch.no_grad():
        lp, _ = dapo.forward_logprobs(model, dapo.collate(samples, 0, "cpu", one_row=True), 0.7, 5)
    worst_flex = max((lp[i, :len(a)] - a).abs().max().item() for i, a in enumerate(alone))
    print(f"flex attention, one row of {len(samples)} sequences: max |packed - alone (sdpa)| {worst_flex:.1e}")
    assert worst_flex < 1e-5


def test_collate_packs_rows_and_masks_padding_but_not_eos():
    """collate's packed rows: sequences first-fit into rows as long as the longest, pad ids at each row's end,
    positions restarting per sequence (the row's tail a sequence of its own), and a mask of every response
    token, EOS included, even where the pad id is EOS's."""
    b = dapo.collate(_toy_samples(), pad_id=1, device="cpu")  # pad == EOS on purpose
    assert b["mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    targets = torch.nn.utils.rnn.pad_sequence(b["targets"].split(b["lengths"]), batch_first=True)  # (B, R)
    assert targets[0, 2].item() == 1 and targets[1, 1].item() == 1           # EOS is trained on
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9, 1], [5, 6, 8, 9, 9, 9], [5, 8, 1, 1, 1, 1]]   # packed rows, pad at the end
    assert b["position_ids"][2].tolist() == [0, 1, 2, 0, 1, 2]              # positions as vLLM counts them; the tail apart


def test_one_row_layout_packs_every_sequence_without_padding():
    """The flex/flash layout: every sequence of the micro-batch in one row, no padding at all, position_ids
    restarting per sequence, and each target predicted from the position before it."""
    samples = _ragged_samples(12, seed=2)
    b = dapo.collate(samples, 0, "cpu", one_row=True)
    real = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    assert b["input_ids"].shape == (1, real)
    assert (b["position_ids"][0] == 0).sum() == len(samples)
    assert torch.equal(b["input_ids"].flatten()[b["index"] + 1], b["targets"])
    assert dapo.packs_one_row(dapo.Config(attn_impl="flex_attention")) and not dapo.packs_one_row(
        dapo.Config(attn_impl="sdpa"))


def test_collate_index_points_at_the_token_before_each_target():
    samples = _ragged_samples(40, seed=1)
    b = dapo.collate(samples, 0, "cpu")
    pos, L = b["position_ids"], b["input_ids"].shape[1]
    assert L == max(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    # every response token is predicted from the position just before it, in its own sequence
    flat, fpos = b["input_ids"].flatten(), pos.flatten()
    assert torch.equal(flat[b["index"] + 1], b["targets"])
    assert sorted(b["index"].tolist()) == b["index"].unique().tolist() and (fpos[b["index"] + 1] > 0).all()


def test_padding_micro_batches_are_one_prompt_and_one_response_token(monkeypatch):
    """A rank with fewer micro-batches pads with the smallest sequence (1 + 1 tokens, zero
    weight), not a copy of a real sample that may be 22k tokens long."""
    monkeypatch.setattr(dapo, "world", lambda: 2)
    monkeypatch.setattr(dapo, "rank", lambda: 1)
    samples = [{"prompt_ids": [5] * 3, "response_ids": [7] * n, "len": n, "truncated": False, "adv": 1.0}
               for n in (20, 1, 20, 1, 20, 1, 20, 1)]                        # rank 1 trains the short ones
    _, plan = dapo.micro_batches(samples, dapo.Config(num_mini_batches=1, micro_batch_tokens=24))
    pads = [mb for mb in plan[0] if mb[0].get("dummy")]
    assert len(plan[0]) == 4 and len(pads) == 3                              # rank 0 needs 4 micro-batches
    for mb in pads:
        assert len(mb) == 1 and len(mb[0]["prompt_ids"]) == 1 and len(mb[0]["response_ids"]) == 1
        assert dapo.collate(mb, 0, "cpu")["input_ids"].numel() == 2


def test_pack_by_tokens_respects_the_budget_of_real_tokens():
    import random
    rng = random.Random(0)
    samples = [{"prompt_ids": [0] * rng.randint(1, 9), "response_ids": [0] * rng.randint(1, 30)} for _ in range(50)]
    for smp in samples:
        smp["len"] = len(smp["response_ids"])
    packs = dapo.pack_by_tokens(samples, 64)
    assert sorted(map(id, (s for p in packs for s in p))) == sorted(map(id, samples))   # each sample once
    for p in packs:
        real = sum(len(s["prompt_ids"]) + s["len"] for s in p)   # packed rows compute nothing else
        assert real <= 64 or len(p) == 1
    assert len(packs) <= sum(len(s["prompt_ids"]) + s["len"] for s in samples) // 64 + 2   # first-fit decreasing is tight


def test_token_logprobs_matches_log_softmax():
    torch.manual_seed(0)
    hidden = torch.randn(2, 37, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (2, 37))
    for T in (1.0, 0.6):
        ref = torch.log_softmax(hidden @ weight.T / T, -1)
        ref_lp = ref.gather(-1, targets[..., None])[..., 0]
        ref_ent = -(ref.exp() * ref).sum(-1)
        lp, ent = dapo.token_logprobs(hidden, weight, targets, temperature=T, chunk=8)
        torch.testing.assert_close(lp, ref_lp.float(), atol=1e-5, rtol=0)
        torch.testing.assert_close(ent, ref_ent.float(), atol=1e-5, rtol=0)
        for g, g_ref in zip(torch.autograd.grad(lp.sum(), (hidden, weight)),
                            torch.autograd.grad(ref_lp.sum(), (hidden, weight))):
            torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=0)


def test_fp32_head_under_bf16_mixed_precision():
    """Under FSDP2's bf16 MixedPrecisionPolicy the log-probs come from an fp32 head: within 1e-3 of
    an fp64 reference, a tolerance that the bf16 logits of HF's own lm_head fail by far. The head's gradient,
    over 24 checkpointed chunks, adds up in fp32 and is rounded to bf16 (FSDP2's unsharded weight) once: within
    1.25x the error of one bf16 rounding of the fp64 gradient (added up in bf16, chunk by chunk: 1.7x)."""
    out = _run([sys.executable, "tests/test_exactness.py", "mixed_precision"], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"bf16 compute, max |logit| {r['max_logit']:.0f}: fp32-head log-prob error {r['fused_err']:.1e}, "
          f"bf16-logits error {r['bf16_err']:.1e}")
    assert r["hidden"] == "torch.bfloat16" and r["logits"] == "torch.bfloat16"   # bf16 compute really ran
    assert r["fused_err"] < 1e-3 < 1e-2 < r["bf16_err"]
    print(f"head gradient over 24 chunks: relative error {r['head_grad_err']:.2e} against fp64; one bf16 rounding "
          f"{r['one_rounding']:.2e}")
    assert r["head_grad_err"] < 1.25 * r["one_rounding"]


def test_token_logprobs_peak_memory():
    """Peak extra tensor memory of forward+backward from (2048, 256) hidden states through a
    32768-token head: logits then log_softmax, against the fused chunked fp32 path."""
    out = _run([sys.executable, "-c", _MEM_SCRIPT], timeout=300)
    assert out.returncode == 0, out.stderr
    peaks = json.loads(out.stdout)
    print(f"log-prob peak extra memory, T=2048 V=32768: logits + fp32 log_softmax {peaks['naive']:.0f} MiB, "
          f"fused fp32 head {peaks['fused']:.0f} MiB ({peaks['naive'] / max(peaks['fused'], 1):.1f}x less)")
    assert peaks["fused"] < peaks["naive"] / 3


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_weight_sync_refuses_a_missing_tensor_and_is_exact_at_step_0_and_after_an_update(tiny_model, precision):
    """In fp32 and (where the CPU has bf16 instructions) bf16. The stream carries every state_dict tensor, the
    tied head twice (lm_head.weight, the embedding again): from vLLM's dummy start (every run's first sync, and
    on CUDA every sync after a level-2 sleep), its fp32 engine on CPU reads the head from that name alone, and a
    stream without it leaves the head at its dummy values (the reason it is streamed every time)."""
    if precision == "bf16" and dapo.check_data.cpu_lacks_bf16():
        pytest.skip("this CPU has no bf16 instructions: --precision bf16 is refused on it (tested end to end)")
    out = _run([sys.executable, "tests/test_exactness.py", "sync", tiny_model, precision], timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    err = re.search(r"sync error: (.*)", out.stdout).group(1)
    diff = float(re.search(r"step-0 logp diff (\S+)", out.stdout).group(1))
    after, moved = map(float, re.search(r"after-update logp diff (\S+) moved (\S+)", out.stdout).groups())
    stale = float(re.search(r"without the tied head's second copy: logp diff (\S+)", out.stdout).group(1))
    pushed, total, tied = map(int, re.search(r"pushed (\d+) state_dict (\d+) tied (\d)", out.stdout).groups())
    print(f"{precision}: {err}\nstep-0 |vLLM log-prob - trainer log-prob| max {diff:.1e}; after an optimizer step "
          f"and a sync {after:.1e}, while the step moved the log-probs by {moved:.1e}; without the tied head's "
          f"second copy {stale:.1e}; {pushed} bytes pushed")
    assert "model.layers.1.mlp.down_proj.weight" in err and "unwritten" in err
    assert tied and pushed == total                                  # every state_dict tensor, the tied head too
    bound = 1e-4 if precision == "fp32" else 1e-2                    # bf16: its rounding, ~1e-4 to 1e-3 here
    assert diff < bound and after < bound and moved > 1e-2
    if precision == "fp32":
        assert stale > 0.1                                           # the head left at its dummy values


def test_each_rank_receives_only_its_training_share(tmp_path):
    out = _torchrun(2, "tests/test_exactness.py", "traffic", str(tmp_path / "traffic.json"))
    assert out.returncode == 0, out.stderr[-4000:]
    for r, report in enumerate(json.load(open(tmp_path / "traffic.json"))):
        for key, x in report.items():
            after = x["meta"] + x["tokens"]
            print(f"rank {r} {key}: before {x['before']:,} B, after {after:,} B (metadata {x['meta']:,} B for "
                  f"{x['generated']} samples + tokens {x['tokens']:,} B); own training share {x['share']:,} B "
                  f"({x['trained']} samples)")
            assert x["meta"] < 64 * x["generated"]                  # small metadata
            assert x["tokens"] <= 1.5 * x["share"]                  # token data: its own share at most (1.5x: the framing)
            assert after < x["before"] / 2


def test_collective_timeout_reaches_the_process_group():
    """--collective-timeout-min becomes the default group's timeout (torch's own is 30 min);
    0 is a one-line error from the command line, before anything slow starts."""
    code = ("import torch, dapo; cfg = dapo.parse_config(['--collective-timeout-min', '7.5']); "
            "dapo.init_distributed(cfg.collective_timeout_min); "
            "pg = torch.distributed.distributed_c10d._get_default_group(); "
            "print(pg._get_backend(torch.device('cpu')).options._timeout)")
    out = _run([sys.executable, "-c", code], timeout=300,
               env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    print("process group timeout:", out.stdout.strip())
    assert out.returncode == 0 and out.stdout.strip() == "0:07:30", out.stderr[-2000:]
    assert dapo.Config().collective_timeout_min == 180
    bad = _run([sys.executable, "dapo.py", "--collective-timeout-min", "0"], timeout=300)
    assert bad.returncode == 2 and bad.stderr == "error: --collective-timeout-min must be positive (got 0.0)\n", bad.stderr


def test_policy_loads_from_one_reader_without_a_full_copy_per_rank(tiny_model, tmp_path):
    """A 66M-parameter Qwen2 saved in bf16 as 4 safetensors files: load_policy on 2 ranks gives
    exactly a plain fp32 from_pretrained (weights, RoPE inv_freq, logits; the tied demo model
    stays tied), and rank 1 grows by its own fp32 shard (half the model on 2 ranks) plus less
    than 25% of the fp32 model, where a plain from_pretrained(fp32) grows by all of it; rank 0,
    which reads the files, by at most one file more."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    big = str(tmp_path / "big")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=256,
                         tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    assert n >= 50e6
    model.save_pretrained(big, max_shard_size="40MB")
    del model
    assert len([f for f in os.listdir(big) if f.endswith(".safetensors")]) >= 3
    out = _torchrun(2, "tests/test_exactness.py", "load", big, tiny_model)
    assert out.returncode == 0, out.stderr[-3000:]
    print(out.stdout)
    figures = {r: list(map(float, m)) for r, *m in re.findall(
        r"rank (\d): load_policy peak RSS growth (\d+) MiB .*?\((\d+) MiB\), of which its own fp32 shard (\d+) MiB; "
        r"beyond it .*?plain from_pretrained\(fp32\): (\d+) MiB", out.stdout)}
    grew, fp32, shard, old = figures["1"]
    assert grew - shard < 0.25 * fp32 and old > 0.9 * fp32
    # rank 0 reads the files: its own shard, one file at a time (bf16 here), and the same margin
    largest = max(os.path.getsize(os.path.join(big, f)) for f in os.listdir(big) if f.endswith(".safetensors"))
    grew0, _, shard0, _ = figures["0"]
    print(f"rank 0 beyond its shard: {grew0 - shard0:.0f} MiB; largest file {largest / 2**20:.0f} MiB")
    assert grew0 - shard0 < largest / 2**20 + 0.25 * fp32
    for name in ("big", "model"):
        assert re.search(rf"{name}: max \|loaded - plain\| = 0\.0e\+00 over \d+ tensors, inv_freq equal True, "
                         rf"logits max diff 0\.0e\+00, tied {name == 'model'}", out.stdout), out.stdout


def test_hf_export_is_sharded_and_loads_in_transformers(tiny_model, tmp_path):
    """The export: several files of at most --hf-shard-gb (here 200 kB) written by both ranks,
    an index naming every tensor once (a tied lm_head is left out), bf16 by default; transformers
    loads it, and its weights are the trainer's cast to the export dtype, exactly."""
    from transformers import AutoModelForCausalLM
    src = tmp_path / "src"   # a generation config of its own, as instruct models have (two EOS ids)
    shutil.copytree(tiny_model, src)
    gen = json.load(open(src / "generation_config.json"))
    gen["eos_token_id"] = [1, 2]
    json.dump(gen, open(src / "generation_config.json", "w"))
    out = _torchrun(2, "tests/test_exactness.py", "export", str(src), str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    trainer = torch.load(tmp_path / "trainer.pt")
    for dtype in (torch.bfloat16, torch.float32):
        d = tmp_path / str(dtype)[6:]
        index = json.load(open(d / "model.safetensors.index.json"))
        files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
        assert sorted(set(index["weight_map"].values())) == files and len(files) >= 4
        assert set(index["weight_map"]) == set(trainer) - {"lm_head.weight"}
        for f in files:   # within the limit (+ the safetensors header), unless one tensor alone exceeds it
            assert os.path.getsize(d / f) < 200e3 + 10e3 or list(index["weight_map"].values()).count(f) == 1
        assert json.load(open(d / "config.json"))["dtype"] == str(dtype)[6:]
        assert json.load(open(d / "generation_config.json"))["eos_token_id"] == [1, 2]   # vLLM's stop set
        m = AutoModelForCausalLM.from_pretrained(d)
        assert m.dtype == dtype and m.lm_head.weight is m.model.embed_tokens.weight
        sd = m.state_dict()
        worst = max((sd[k].float() - trainer[k].to(dtype).float()).abs().max().item() for k in trainer)
        moved = max((sd[k].float() - trainer[k]).abs().max().item() for k in trainer)
        print(f"{dtype}: {len(files)} files; max |transformers - trainer cast to {dtype}| = {worst:.1e} "
              f"(to the fp32 trainer: {moved:.1e})")
        assert worst == 0


# -----------------------------------------------------------------------------------------
# Helpers

def _mixed_precision_worker():
    """FSDP2 with bf16 compute (the GPU set-up): the trainer's log-probs against an fp64 head on the
    same bf16 hidden states and weights, and the bf16 logits that HF's own lm_head would give."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    from transformers import Qwen2Config, Qwen2ForCausalLM
    dapo.init_distributed()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                                         tie_word_embeddings=False, use_cache=False))
    with torch.no_grad():
        model.lm_head.weight.mul_(40)   # logits of ~20-40, where bf16 values are 0.125-0.25 apart
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    model.forward_logprobs = dapo.types.MethodType(dapo.forward_logprobs, model)
    register_fsdp_forward_method(model, "forward_logprobs")
    ids = torch.randint(0, 512, (2, 24))
    batch = dapo.collate([{"prompt_ids": r[:12].tolist(), "response_ids": r[12:].tolist(), "truncated": False}
                          for r in ids], 0, "cpu")   # two rows of one sequence each
    seen = {}
    hook = model.model.norm.register_forward_hook(lambda m, i, out: seen.update(hidden=out))
    lp, _ = model.forward_logprobs(batch, 1.0, 1)   # 24 chunks of one token, as ~22 of 1,024 at 22k tokens
    hook.remove()
    lp.sum().backward()
    w = model.lm_head.weight
    w = (w.full_tensor() if hasattr(w, "full_tensor") else w).detach().bfloat16().double().requires_grad_()
    pick = lambda logp: logp[:, 11:-1].gather(-1, ids[:, 12:, None])[..., 0]   # noqa: E731
    ref = pick(torch.log_softmax(seen["hidden"].detach().double() @ w.T, -1))
    ref.sum().backward()   # the head's gradient in fp64 from the same bf16 hidden states and weights
    grad = model.lm_head.weight.grad
    grad = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).double()
    logits = model(input_ids=ids).logits
    bf16 = pick(torch.log_softmax(logits.float(), -1))
    print(json.dumps({"hidden": str(seen["hidden"].dtype), "logits": str(logits.dtype),
                      "max_logit": logits.abs().max().item(), "fused_err": (lp.double() - ref).abs().max().item(),
                      "bf16_err": (bf16.double() - ref).abs().max().item(),
                      "head_grad_err": ((grad - w.grad).norm() / w.grad.norm()).item(),
                      "one_rounding": ((w.grad.bfloat16().double() - w.grad).norm() / w.grad.norm()).item()}))
    torch.distributed.destroy_process_group()


def _rss_mib(field):
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) / 1024


def _peak_rss_growth(fn):
    """fn()'s result and the growth of this process's peak RSS (MiB) while it ran: the kernel's
    high-water mark VmHWM is reset first (clear_refs 5), so earlier peaks do not count."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _rss_mib("VmRSS")
    out = fn()
    return out, _rss_mib("VmHWM") - base


def _load_worker(big_dir, tiny_dir):
    """Under torchrun: each rank's RSS growth during load_policy and, for contrast, during a plain
    from_pretrained(fp32) (the old way); the loaded shards against that plain load."""
    import safetensors.torch  # noqa: F401  (imports done before measuring)
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM
    device = dapo.init_distributed()
    cfg = dapo.Config()
    model, grew = _peak_rss_growth(lambda: dapo.load_policy(cfg, big_dir, device))
    ref, grew_old = _peak_rss_growth(lambda: AutoModelForCausalLM.from_pretrained(big_dir, dtype=torch.float32))
    fp32 = sum(p.numel() for p in ref.parameters()) * 4 / 2**20
    shard = sum(p.to_local().numel() for p in model.parameters()) * 4 / 2**20
    print(f"rank {dapo.rank()}: load_policy peak RSS growth {grew:.0f} MiB = {grew / fp32:.0%} of the fp32 model "
          f"({fp32:.0f} MiB), of which its own fp32 shard {shard:.0f} MiB; beyond it {(grew - shard) / fp32:.0%}; "
          f"plain from_pretrained(fp32): {grew_old:.0f} MiB = {grew_old / fp32:.0%}", flush=True)
    ids = torch.tensor([[5, 17, 300, 4000, 31999, 12, 7, 900]])
    for path, m, r in ((big_dir, model, ref), (tiny_dir, dapo.load_policy(cfg, tiny_dir, device),
                                               AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32))):
        full = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        with torch.no_grad():
            logits = (m(ids % r.config.vocab_size).logits - r.eval()(ids % r.config.vocab_size).logits).abs().max().item()
        if dapo.rank() == 0:
            rsd = r.state_dict()
            assert full.keys() == rsd.keys()
            worst = max((full[k] - rsd[k]).abs().max().item() for k in rsd)
            rope = torch.equal(m.model.rotary_emb.inv_freq, r.model.rotary_emb.inv_freq)
            tied = m.lm_head.weight is m.model.embed_tokens.weight
            print(f"{os.path.basename(path)}: max |loaded - plain| = {worst:.1e} over {len(rsd)} tensors, "
                  f"inv_freq equal {rope}, logits max diff {logits:.1e}, tied {tied}", flush=True)
    torch.distributed.barrier()   # both ranks done before either tears gloo down
    torch.distributed.destroy_process_group()


def _export_worker(model_dir, out_dir):
    """Under torchrun: one optimizer step (so the weights are the trainer's own), then the
    Hugging Face export in bf16 and in fp32 with a tiny file limit, and the trainer's weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoTokenizer
    device = dapo.init_distributed()
    model = dapo.load_policy(dapo.Config(), model_dir, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.tensor([[20, 5, 6, 13, 7, 8, 15, 21]])).logits.sum().backward()
    opt.step()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for dtype in (torch.bfloat16, torch.float32):
        dapo.save_hf(model, tokenizer, os.path.join(out_dir, str(dtype)[6:]), dtype, shard_gb=0.0002)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dapo.rank() == 0:
        torch.save(full, os.path.join(out_dir, "trainer.pt"))
    torch.distributed.barrier()   # both ranks done before either tears gloo down
    torch.distributed.destroy_process_group()


class _FakeLLM:
    """Stands in for vLLM in sample_groups: responses of 50-300 tokens with large token ids
    (as a 150k vocabulary has), drawn from torch's global generator, which seeded_engine seeds
    once per call, so the TP ranks of a group agree."""
    def reset_prefix_cache(self):
        pass

    def generate(self, prompts, params, use_tqdm=False):
        import random, types
        g = random.Random(int(torch.randint(2**31, ())))
        outs = []
        for _ in prompts:
            outputs = []
            for _ in range(params.n):
                ids = [g.randrange(100, 150_000) for _ in range(g.randrange(50, 300))]
                outputs.append(types.SimpleNamespace(   # flat log-probs (SamplingParams(flat_logprobs=True))
                    token_ids=ids, logprobs=types.SimpleNamespace(logprobs=[-g.random() for _ in ids]),
                    finish_reason=g.choice(["stop", "stop", "length"])))
            outs.append(types.SimpleNamespace(outputs=outputs))
        return outs


class _FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return f"so the answer is \\boxed{{{ids[0] % 2}}}"   # right (1) about half of the time


def _traffic_worker(out_path):
    """Under torchrun: two training steps' rollouts at TP 1 and TP 2 (fake engine). Per rank:
    the bytes received the old way (every rank all-gathers every generated sample) and now."""
    import pickle
    import types
    dapo.init_distributed()
    rows = [{"answer": "1"}] * 200
    prompt_ids = [[7] * (10 + i % 20) for i in range(200)]
    report = {}
    for tp in (1, 2):
        cfg = dapo.Config(prompts_per_step=16, group_size=4, gen_batch_size=12, num_mini_batches=2,
                          tp_size=tp, max_response_len=300, overlong_cache_len=50, reward_workers=1)
        sampler = dapo.Sampler(len(rows), seed=0)
        for step in range(2):
            held, before = [], 0
            run = types.SimpleNamespace(llm=_FakeLLM(), tokenizer=_FakeTokenizer(), cfg=cfg, meta_bytes=0)

            def sample_fn(idx, b):
                nonlocal before
                groups, t = dapo.sample_groups(run, rows, prompt_ids, idx, cfg.group_size, 1.0, 1.0, (0, step, b))
                mine = [dict(s) for g in groups for s in g if "vllm_logp" in s]
                held.extend(mine)
                # the old scheme: all_gather_object of every TP leader's full samples
                old = [{k: s[k] for k in ("pos", "row", "prompt_ids", "response_ids", "vllm_logp", "truncated",
                                          "text", "success")} for s in mine]
                before += dapo.all_gather_objects(old if dapo.rank() % tp == 0 else [])[1]
                return groups, t
            kept, _, seen, m = dapo.collect_batch(sample_fn, sampler, cfg)
            every = [s for g in seen for s in g]
            for s, r in zip(every, dapo.shape_rewards(every, cfg).tolist()):
                s["reward"] = r
            samples = [s for g in kept for s in g]
            for s, a in zip(samples, dapo.group_advantages(torch.tensor([s["reward"] for s in samples]), 4).tolist()):
                s["adv"] = a
            tokens = dapo.distribute(samples, cfg)
            trained = [s for s in samples if s["trainer"] == dapo.rank()]
            share = len(pickle.dumps([(s["response_ids"], s["vllm_logp"]) for s in trained]))
            # every rank trains on exactly the samples micro_batches gives it, with the generated tokens
            size = len(samples) // cfg.num_mini_batches
            want = [s for mm in range(cfg.num_mini_batches) for s in samples[mm * size:(mm + 1) * size][dapo.rank()::dapo.world()]]
            assert trained == want
            everyone = [x for part in dapo.all_gather_objects(held)[0] for x in part]
            for s in trained:
                match = [x for x in everyone if x["response_ids"] == s["response_ids"] and x["vllm_logp"] == s["vllm_logp"]]
                assert match and len(s["response_ids"]) == s["len"] and "text" not in s
            for s in samples:
                if s["trainer"] != dapo.rank():
                    assert "vllm_logp" not in s and "response_ids" not in s   # a stub: metadata only
            # the decisions agree across ranks
            view = [(s["row"], s["success"], s["len"], s["truncated"], s["reward"], s["adv"], s["trainer"]) for s in samples]
            views = dapo.all_gather_objects(view)[0]
            assert all(v == views[0] for v in views) and m["sync/tp_mismatch"] == 0
            report[f"tp{tp} step{step}"] = dict(before=before, meta=run.meta_bytes, tokens=tokens, share=share,
                                               generated=len(every), trained=len(trained))
    outs = dapo.all_gather_objects(report)[0]
    if dapo.rank() == 0:
        with open(out_path, "w") as f:
            json.dump(outs, f)
    torch.distributed.barrier()   # both ranks done before either tears gloo down
    torch.distributed.destroy_process_group()


def _sync_worker(model_dir, precision):
    """vLLM started with dummy weights (as every run starts it). First a stream without the tied head's second
    copy (lm_head.weight, the embedding again); then a stream missing one tensor, refused, naming it; the full
    stream then gives vLLM's log-probs equal to the trainer's before any generation, and after an update."""
    from vllm import SamplingParams
    cfg = dapo.Config(max_prompt_len=16, max_response_len=8, cpu_kv_cache_gb=0.25, precision=precision)
    device = dapo.init_distributed()
    llm = dapo.start_engine(cfg, model_dir, device, dummy_weights=True)
    model = dapo.load_policy(cfg, model_dir, device)
    prompt = [20, 5, 6, 13, 7, 8, 15]

    def compare(seed):  # vLLM's log-probs of its own sample (flat, as dapo asks) against the trainer's
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
            max_tokens=6, logprobs=0, seed=seed, flat_logprobs=True, detokenize=False), use_tqdm=False)[0].outputs[0]
        ids = list(out.token_ids)
        batch = dapo.collate([{"prompt_ids": prompt, "response_ids": ids, "truncated": False}], 0, device)
        lp, _ = model.forward_logprobs(batch, 1.0, 1024)
        return lp[0, :len(ids)], torch.tensor(out.logprobs.logprobs)

    dapo.sync_weights(model, llm, skip={"lm_head.weight"})
    with torch.no_grad():
        lp, vllm_lp = compare(0)
    print("without the tied head's second copy: logp diff", (lp - vllm_lp).abs().max().item())
    try:
        dapo.sync_weights(model, llm, skip={"model.layers.1.mlp.down_proj.weight"})
        print("no error")
    except dapo.DapoError as e:
        print("sync error:", e)
    pushed = dapo.sync_weights(model, llm)
    size = torch.tensor([], dtype=llm.llm_engine.model_config.dtype).element_size()
    print("pushed", pushed, "state_dict", sum(t.numel() * size for t in model.state_dict().values()),
          "tied", int(model.config.tie_word_embeddings))
    with torch.no_grad():
        lp, vllm_lp = compare(0)
    print("step-0 logp diff", (lp - vllm_lp).abs().max().item())
    # one optimizer step on the trainer, the sync, then the same comparison: no dapo statistic involved
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    before = lp
    lp, _ = compare(0)
    (-lp.sum()).backward()
    opt.step()
    dapo.sync_weights(model, llm)
    with torch.no_grad():
        after, vllm_after = compare(1)
        moved, _ = compare(0)
    print("after-update logp diff", (after - vllm_after).abs().max().item(),
          "moved", (moved - before).abs().max().item())
    torch.distributed.destroy_process_group()


def _ragged_samples(n=9, seed=0):
    import random
    rng = random.Random(seed)
    return [{"prompt_ids": [rng.randrange(3, 30) for _ in range(rng.randint(1, 6))],
             "response_ids": [rng.randrange(3, 30) for _ in range(rng.randint(1, 15))] + [1], "truncated": False}
            for _ in range(n)]


if __name__ == "__main__":  # the helper processes the tests above start
    if sys.argv[1] == "load":
        _load_worker(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "sync":
        _sync_worker(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "mixed_precision":
        _mixed_precision_worker()
    elif sys.argv[1] == "export":
        _export_worker(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "traffic":
        _traffic_worker(sys.argv[2])
    # results written: skip the interpreter's teardown, where a rank that has destroyed its process group
    # can abort while the other still tears down
    interrupt.kill_children()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
