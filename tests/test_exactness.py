"""Exactness across ranks and layouts: 2 ranks = 1 process for every objective, packed rows = padded rows, the
fp32 head, the weight sync against vLLM's own log-probs, what each rank receives, loads and exports."""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
import json
import re
import shutil
import types
import pytest
import torch
from lib import interrupt
import dapo
from tests.shared import (
    GRAD_RTOL, KNOBS, _grads, _padded_collate, _padded_forward_logprobs, _relative_gap, _run, _toy_samples,
    _torchrun)
import trainer_check  # tools/trainer_check.py: the shared-prompt check a GPU runs (tests/shared.py puts tools/ on the path)


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
    gradient's largest entry; the groups' shared prompts are forwarded once per part, a group cut across
    micro-batches and another across ranks. The choices made over the whole mini-batch are made alike: the
    entropy threshold over both ranks' tokens, and Clip-Cov's and KL-Cov's tokens (select_tokens), which verl
    picks per micro-batch."""
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
    # a budget of 28 real tokens: group 0's two long responses (3 + 11 and 3 + 15 tokens) are cut apart on
    # rank 0, the rest (27 tokens) fits one micro-batch on rank 1, which then runs a zero-weight extra one
    budget, out = _grads(tiny_model, tmp_path, 8, 28, 0, nproc=2)
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
    flex and flash attention get on GPU; sdpa computes it here); the policy has the KV cache off. The
    packed layouts forward each group's prompt once (--shared-prefix), the padded one a copy per response."""
    padded, out = _grads(tiny_model, tmp_path, 8, 0, 0, 1)
    assert "use_cache False" in out and 'layouts ["padded"]' in out    # the reference's layout really ran
    packed, out_packed = _grads(tiny_model, tmp_path, 8)
    ranks, out_ranks = _grads(tiny_model, tmp_path, 8, 28, 0, nproc=2)
    one_row, out_one = _grads(tiny_model, tmp_path, 8, 28, 0, 0, 0, 1, nproc=2)
    assert 'layouts ["packed rows, shared"]' in out_packed and 'layouts ["packed rows, shared"]' in out_ranks
    assert 'layouts ["one row, shared"]' in out_one
    for name, g in (("packed, 1 process", packed), ("packed, 2 ranks, 28-token budget", ranks),
                    ("one row per micro-batch (the GPU layout), 2 ranks, 28-token budget", one_row)):
        worst, scale = _relative_gap(padded, g)
        print(f"{name}: max |grad - padded grad| = {worst:.1e} of the largest entry {scale:.2e}")
        assert worst < GRAD_RTOL and scale > 1e-3


def test_the_default_cpu_path_shares_through_packing_and_gives_the_padded_gradient(tiny_model, tmp_path):
    """Neither --shared-prefix nor --no-shared-prefix, the CPU's default: sdpa's rule (its beta timed for the model)
    decides in each micro-batch, in one process and on 2 ranks with a 28-token budget (pack_by_tokens keeps each
    group's part whole and in order): the groups' prompts are still shared after packing, and the gradient is the
    padded layout's, a copy of the prompt per response, within GRAD_RTOL."""
    padded, _ = _grads(tiny_model, tmp_path, 8, 0, 0, 1)
    for name, (g, out) in (("1 process", _grads(tiny_model, tmp_path, 8, 0, 0, 0, 0, 0, 0, 2)),
                           ("2 ranks, 28-token budget", _grads(tiny_model, tmp_path, 8, 28, 0, 0, 0, 0, 0, 2, nproc=2))):
        layouts = json.loads(re.search(r"^layouts (\[.*\])", out, re.M)[1])
        worst, scale = _relative_gap(padded, g)
        print(f"the default rule, {name}: layouts {layouts}; max |grad - padded grad| = {worst:.1e} of the largest "
              f"entry {scale:.2e}")
        assert any("shared" in x for x in layouts) and worst < GRAD_RTOL and scale > 1e-3


def test_shared_prompts_give_the_plain_gradient_for_every_objective_with_and_without_lora(tiny_model, tmp_path):
    """--shared-prefix (a group's prompt forwarded once, its responses attending to it) against a copy of the
    prompt per response (--no-shared-prefix), through FSDP2 and policy_gradient, for every --loss (GSPO's
    sequence-level ratio among them) and knob of KNOBS (--top-entropy-quantile among them), without and with
    LoRA: 3 groups with prompts of 3, 6 and 2 tokens, in one process (one micro-batch holding every group)
    and on 2 ranks x 2 micro-batches (group 0 cut across micro-batches, group 1 across ranks), within GRAD_RTOL
    of the largest entry. Clip-Cov and KL-Cov pick their tokens per micro-batch: on 2 ranks they are left out,
    as in the 2-ranks test."""
    by_layout = [k for k, e in dapo.OBJECTIVES.items() if e.get("per_micro_batch")]
    for lora in (0, 1):
        plain, out_plain = _grads(tiny_model, tmp_path, 8, 0, 0, 0, 1, 0, lora, 1)
        shared, out_shared = _grads(tiny_model, tmp_path, 8, 0, 0, 0, 1, 0, lora)
        ranks, out_ranks = _grads(tiny_model, tmp_path, 2, 0, 0, 0, 1, 0, lora, nproc=2)
        assert 'layouts ["packed rows"]' in out_plain   # the reference really ran without sharing
        assert 'layouts ["packed rows, shared"]' in out_shared and '"one row, shared"' in out_ranks   # a pair: a row
        split = json.loads(re.search(r"groups per micro-batch (\{.*\})", out_ranks).group(1))
        assert split == {"0": [[0, 0], [0, 1]], "1": [[1, 1], [2, 2]]}
        assert list(plain) == list(shared) == list(ranks) == list(dapo.OBJECTIVES) + list(KNOBS)
        for loss in plain:
            for name, g in (("1 process", shared), ("2 ranks x 2 micro-batches", ranks)):
                worst, scale = _relative_gap(plain[loss], g[loss])
                print(f"{'LoRA, ' * lora}{loss}, {name}: max |grad(shared prompts) - grad(a copy per response)| = "
                      f"{worst:.1e} of the largest entry {scale:.2e}")
                assert scale > 1e-4 and (worst < GRAD_RTOL or (name != "1 process" and loss in by_layout))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_shared_prompts_give_the_plain_log_probs_and_gradients(arch):
    """The demo's architecture (Qwen2) and SmolLM2's (Llama, grouped KV heads), fp32, sdpa: 4 groups with
    prompts of 7, 2, 12 and 4 tokens (one group of a single response, which shares nothing), forwarded with
    each prompt once give each response the log-probs, entropies and parameter gradient of a copy of the
    prompt per response: in rows (the CPU layout; one row holds two groups) and all in one row (the GPU
    layout, here through sdpa)."""
    model = _tiny_causal_lm(arch)
    samples = _grouped_samples(((7, [5, 9, 3, 12]), (2, [4, 1, 8]), (12, [6]), (4, [10, 2])))
    plain = _logprobs_and_grads(model, samples, shared=False)
    copies = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    once = 7 + 2 + 12 + 4 + sum(len(s["response_ids"]) for s in samples)
    for one_row in (False, True):
        shared = _logprobs_and_grads(model, samples, shared=True, one_row=one_row)
        segment = shared[3]["segment"]
        if not one_row:   # a row of two groups
            assert max(len(set(row.tolist()) - {0}) for row in segment) == 2
        logp, grad = _shared_gaps(shared, plain)
        print(f"{arch}, {'one row' if one_row else 'rows'}: {once} real tokens forwarded ({copies} with a copy of the "
              f"prompt per response); max |log-prob| difference {logp:.1e}, gradient {grad:.1e} of the largest entry")
        assert logp < 1e-5 and grad < GRAD_RTOL and (segment > 0).sum() == once
        assert (shared[1] - plain[1])[plain[3]["mask"].bool()].abs().max() < 1e-5   # the entropies


def test_a_wrong_shared_prompt_mask_fails_the_check(monkeypatch):
    """The check of test_shared_prompts_give_the_plain_log_probs_and_gradients fails by far with a wrong
    mask: responses that also see the earlier responses of their group, or no mask at all (position_ids
    alone: the second response on restarts its positions and so sees no prompt)."""
    model = _tiny_causal_lm("qwen2")
    samples = _grouped_samples(((7, [5, 9, 3, 12]), (2, [4, 1, 8]), (12, [6]), (4, [10, 2])))
    plain = _logprobs_and_grads(model, samples, shared=False)

    def sees_the_other_responses(segment, branch):
        return lambda b, h, q, kv: (kv <= q) & (segment[b, q] == segment[b, kv])
    with monkeypatch.context() as m:
        m.setattr(dapo, "prefix_mask", sees_the_other_responses)
        leaky = _shared_gaps(_logprobs_and_grads(model, samples, shared=True), plain)
    with monkeypatch.context() as m:
        m.setattr(dapo, "shared_prefix_mask", lambda model, batch: None)
        no_mask = _shared_gaps(_logprobs_and_grads(model, samples, shared=True), plain)
    print(f"responses that see each other: log-prob {leaky[0]:.2f} nats, gradient {leaky[1]:.1e} of the largest "
          f"entry; no mask: {no_mask[0]:.2f} nats, {no_mask[1]:.1e}")
    assert min(leaky + no_mask) > 1e-2


def test_flex_block_mask_is_the_sdpa_mask_and_gives_its_log_probs():
    """The GPU path (flex attention's BlockMask over one row), on CPU: prefix_mask evaluated as flex evaluates
    a mask_mod (torch's create_mask: vmap over every (q, kv)) is sdpa's boolean matrix; the BlockMask
    skips the 128 x 128 blocks that mix two sequences or two responses; and flex's forward (torch 2.13 has no
    flex backward on CPU) gives the log-probs of sdpa with a copy of the prompt per response, within 1e-5."""
    from torch.nn.attention.flex_attention import BlockMask, create_mask
    samples = _grouped_samples(((150, [30, 200, 41, 90]), (60, [140, 21]), (20, [35])))   # ~790 tokens
    model = _tiny_causal_lm("qwen2")
    batch = dapo.collate(samples, 0, "cpu", one_row=True, shared=True)
    L = batch["input_ids"].shape[1]
    dense = dapo.shared_prefix_mask(model, batch)
    assert dense.shape == (1, 1, L, L) and dense.dtype == torch.bool
    assert torch.equal(create_mask(dapo.prefix_mask(batch["segment"], batch["branch"]), 1, 1, L, L, "cpu"), dense)
    assert torch.equal(dense[0, 0], _hand_mask(samples))
    with torch.no_grad():
        plain, _ = dapo.forward_logprobs(model, dapo.collate(samples, 0, "cpu"), 1.0, 64)
        model.config._attn_implementation = "flex_attention"
        block = dapo.shared_prefix_mask(model, batch)
        flex, _ = dapo.forward_logprobs(model, batch, 1.0, 64)
    blocks = -(-L // 128)
    causal = blocks * (blocks + 1) // 2
    kept = (block.kv_num_blocks + block.full_kv_num_blocks).sum().item()
    worst = (flex - plain)[batch["mask"].bool()].abs().max().item()
    print(f"one row of {L} tokens: the BlockMask computes {kept} of the {causal} causal 128 x 128 blocks; "
          f"max |flex (shared) - sdpa (a copy per response)| {worst:.1e}")
    assert isinstance(block, BlockMask) and kept < causal and worst < 1e-5


def test_shared_prompts_in_bf16_stay_within_bf16s_own_rounding():
    """bf16 (weights and compute; --precision bf16 keeps fp32 master weights and head besides): the log-probs
    and gradient with each prompt forwarded once differ from a copy per response by at most twice what bf16
    itself moves the plain path from fp32 (log-probs: plus 1e-3 nats), on both architectures."""
    samples = _grouped_samples(((7, [5, 9, 3, 12]), (2, [4, 1, 8]), (12, [6]), (4, [10, 2])))
    for arch in ("qwen2", "llama"):
        model = _tiny_causal_lm(arch)
        fp32 = _logprobs_and_grads(model, samples, shared=False)
        model.to(torch.bfloat16)
        plain = _logprobs_and_grads(model, samples, shared=False)
        shared = _logprobs_and_grads(model, samples, shared=True)
        noise, err = _shared_gaps(plain, fp32), _shared_gaps(shared, plain)
        print(f"{arch} in bf16: shared - plain: log-prob {err[0]:.1e} nats, gradient {err[1]:.1e} of the largest "
              f"entry; bf16 - fp32 (plain): {noise[0]:.1e}, {noise[1]:.1e}")
        assert err[0] <= 2 * noise[0] + 1e-3 and err[1] <= 2 * noise[1]


def test_shared_prefix_by_default_shares_where_it_pays():
    """--shared-prefix resolved for the attention and the model (sharing): flex attention's block mask always
    forwards a group's prompt once; under sdpa, whose dense mask makes a micro-batch cost about rows x L x
    (beta + L) (L the row length: the longest sequence; rows as collate packs them, their tails included; beta a
    position's cost in attention pairs, timed for the model on this machine: sdpa_beta), each micro-batch's groups
    share in parts of the cap that costs least (shared_parts): the longest copy, or a group's whole length, never
    past SDPA_SHARED_MAX. On the project's shapes, one group a
    micro-batch: bench_step's short prompts and long responses, the carry task's and a long-response laptop
    shape stay copies; the demo's, the showcase's and the ladder's groups share whole. The flags force either way;
    flash attention never shares. --micro-batch-tokens counts a copy per response unless sharing is forced, so
    the rule, deciding in each micro-batch, never takes one over its budget."""
    from transformers import LlamaConfig, Qwen2Config
    demo = Qwen2Config(hidden_size=128, intermediate_size=512, num_attention_heads=2, num_key_value_heads=2,
                       head_dim=64)   # the built-in model
    smol = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                       head_dim=64)   # SmolLM2-135M
    # the decoder's FLOPs of one position over one attention pair's: where sdpa_beta's timing lands on a CPU whose
    # matmuls and attention run alike (on 2 Xeon cores with AMX it times 1,450 and 2,470 in fp32)
    beta = {"demo": 2 * (2 * 128 * 128 + 2 * 128 * 128 + 3 * 128 * 512) / (4 * 2 * 64),
            "smol": 2 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536) / (4 * 9 * 64)}
    assert (beta["demo"], beta["smol"]) == (1024, 3072)
    assert dapo.sharing(dapo.Config(), demo) == dapo.sdpa_beta(demo, False) > 0   # sdpa: the rule, timed
    assert dapo.sharing(dapo.Config(attn_impl="flex_attention"), demo) is True
    assert dapo.sharing(dapo.Config(shared_prefix=True), demo) is True
    assert dapo.sharing(dapo.Config(shared_prefix=False, attn_impl="flex_attention"), demo) is False
    assert dapo.sharing(dapo.Config(attn_impl="flash_attention_2"), demo) is False

    def parts(prompt_len, lens, share):
        return [len(r) for r in dapo.prompt_runs([{"prompt_ids": [1] * prompt_len, "len": n} for n in lens], share)]
    shapes = {"bench_step": (8, [117] * 8, "demo", [1] * 8), "demo": (12, [6] * 8, "demo", [8]),
              "carry": (15, [50] * 8, "demo", [1] * 8), "showcase": (92, [6] * 8, "smol", [8]),
              "ladder": (147, [30] * 8, "smol", [8]), "long responses": (173, [512] * 8, "smol", [1] * 8)}
    for name, (P, lens, model, want) in shapes.items():
        got = parts(P, lens, beta[model])
        print(f"{name}: a prompt of {P}, responses of {lens[0]}: forwarded as {got}")
        assert got == want, name
        assert parts(P, lens, True) == [8] and parts(P, lens, False) == [1] * 8
    # positions alone count (beta huge), row tails too: one group of 8 x 300 past SDPA_SHARED_MAX would go in parts
    # of 1,900 and 700 positions, two rows of 1,900 (3,800 positions): its 8 copies take 3,200; two groups of 8 x 250
    # share in parts of 1,850 and 350, the two short parts in one row (5,550 positions against 5,600)
    assert parts(100, [300] * 8, 1e12) == [1] * 8
    two = [{"prompt_ids": [g] * 100, "len": 250} for g in (1, 2) for _ in range(8)]
    assert [len(r) for r in dapo.prompt_runs(two, 1e12)] == [7, 1, 7, 1]
    # within the longest copy (108): three 30-token responses in one part fill a row their copies needed two for;
    # three 5-token ones share a row as copies too, so sharing them saves nothing (a tie goes to copies)
    assert parts(8, [100, 30, 30, 30, 100, 100, 100, 100], 1024) == [1, 3, 1, 1, 1, 1]
    assert parts(8, [100, 5, 5, 5, 100, 100, 100, 100], 1024) == [1] * 8
    import random
    rng = random.Random(0)
    samples = []
    for g in range(12):   # groups of 8, prompts of 2-200 tokens, responses of 1-300
        prompt = [g] * rng.randint(2, 200)
        samples += [{"prompt_ids": prompt, "response_ids": [7] * n, "len": n} for n in
                    (rng.randint(1, 300) for _ in range(8))]
    for mb in dapo.pack_by_tokens(samples, 1500, beta["smol"]):
        assert sum(len(mb[r[0]]["prompt_ids"]) + sum(mb[i]["len"] for i in r)
                   for r in dapo.prompt_runs(mb, beta["smol"])) <= max(1500, len(mb[0]["prompt_ids"]) + mb[0]["len"])


def test_a_micro_batch_mixing_shared_and_plain_groups_gives_the_plain_gradient():
    """sdpa's rule on one micro-batch: a group of short responses after a long prompt shares it whole, a group
    of long responses after a 2-token prompt goes plain, a third shares it in two parts (within the longest
    copy, 72 positions); the log-probs, entropies and gradient equal those of a copy of the prompt per response,
    in rows and in one row."""
    model = _tiny_causal_lm("qwen2")
    beta = 640.0   # this model's FLOPs of a position over an attention pair's (as sdpa_beta would time them)
    samples = _grouped_samples(((20, [3, 4, 5, 2]), (2, [60, 62, 64]), (12, [20, 20, 60])))
    runs = dapo.prompt_runs(samples, beta)
    assert [len(r) for r in runs] == [4, 1, 1, 1, 2, 1], runs
    plain = _logprobs_and_grads(model, samples, shared=False)
    for one_row in (False, True):
        mixed = _logprobs_and_grads(model, samples, shared=beta, one_row=one_row)
        logp, grad = _shared_gaps(mixed, plain)
        print(f"{'one row' if one_row else 'rows'}: {mixed[3]['input_ids'].numel()} positions; max |log-prob| "
              f"difference {logp:.1e}, gradient {grad:.1e} of the largest entry")
        assert logp < 1e-5 and grad < GRAD_RTOL
        assert (mixed[1] - plain[1])[plain[3]["mask"].bool()].abs().max() < 1e-5   # the entropies
        assert (mixed[3]["segment"] > 0).sum() == 20 + 14 + 2 * 3 + 186 + 12 * 2 + 100


def test_trainer_ranks_cut_a_mini_batch_into_consecutive_shares_of_equal_load(monkeypatch):
    """On 3 ranks: each mini-batch's samples go in order to consecutive shares (a group stays whole unless a
    cut falls inside it, at most 2 cuts), of equal sample counts with --micro-batch-size, of real tokens within
    one sample's of a third with --micro-batch-tokens (a shared prompt counted once, a copy per sample without
    sharing); every rank computes the same owners from the stubs' lengths alone."""
    monkeypatch.setattr(dapo, "world", lambda: 3)
    import random
    rng = random.Random(0)
    samples = []
    for g in range(12):   # groups of 4, prompts of 5-60 tokens, responses of 1-200
        prompt = [g] * rng.randint(5, 60)
        samples += [{"prompt_ids": prompt, "len": rng.randint(1, 200)} for _ in range(4)]
    for mode in ("micro_batch_size", "micro_batch_tokens", "no sharing"):
        cfg = dapo.Config(num_mini_batches=2, micro_batch_tokens=0 if mode == "micro_batch_size" else 500,
                          shared_prefix=mode != "no sharing")
        owner = dapo.trainer_ranks(samples, cfg, cfg.shared_prefix)
        for m in range(2):
            mine = owner[m * 24:(m + 1) * 24]
            assert mine == sorted(mine) and set(mine) == {0, 1, 2}   # consecutive shares
            mini = samples[m * 24:(m + 1) * 24]
            if mode == "micro_batch_size":
                assert [mine.count(r) for r in range(3)] == [8, 8, 8]
                continue
            cost = [s["len"] + len(s["prompt_ids"]) * (mode == "no sharing" or i % 4 == 0) for i, s in enumerate(mini)]
            load = [sum(c for c, r in zip(cost, mine) if r == rank) for rank in range(3)]
            print(f"{mode}, mini-batch {m}: tokens per rank {load} (a third: {sum(cost) / 3:.0f})")
            assert max(abs(x - sum(cost) / 3) for x in load) <= max(cost)
            cuts = sum(mine[i] != mine[i + 1] for i in range(23) if i % 4 != 3)   # within a group
            assert cuts <= 2
        stubs = [{"prompt_ids": s["prompt_ids"], "len": s["len"]} for s in samples]
        assert dapo.trainer_ranks(stubs, cfg, cfg.shared_prefix) == owner


def test_pack_by_tokens_counts_a_shared_prompt_once_and_cuts_a_group_over_the_budget():
    """--micro-batch-tokens with shared prompts, on the ladder's shapes (groups of 8, prompts of 100-150 tokens,
    responses of 20-40) and a group whose responses are 150-250 long: a micro-batch's real tokens (each group
    part's prompt once, its responses) stay within the budget; the group over it is cut into parts, each with
    its own prompt; a sequence over it stands alone; every sample is in one micro-batch; collate forwards
    exactly these tokens, fewer and in fewer micro-batches than with a copy of the prompt per response."""
    import random
    rng = random.Random(0)
    samples = []
    for g, (lo, hi) in enumerate([(20, 40)] * 5 + [(150, 250)]):
        prompt = [g + 3] * rng.randint(100, 150)
        samples += [{"prompt_ids": prompt, "response_ids": [7] * n, "len": n}
                    for n in (rng.randint(lo, hi) for _ in range(8))]
    samples.append({"prompt_ids": [2] * 30, "response_ids": [7] * 1100, "len": 1100})   # over the budget alone
    packs = dapo.pack_by_tokens(samples, 1024, shared=True)
    assert sorted(map(id, (s for p in packs for s in p))) == sorted(map(id, samples))
    forwarded = 0
    for p in packs:
        runs = dapo.prompt_runs(p)
        real = sum(len(p[r[0]]["prompt_ids"]) + sum(p[i]["len"] for i in r) for r in runs)
        assert real <= 1024 or len(p) == 1
        assert dapo.collate(p, 0, "cpu", one_row=True, shared=True)["input_ids"].shape[1] == real
        forwarded += real
    assert sum(p[0]["prompt_ids"][0] == 8 for p in packs) >= 2   # the long group (prompt token 8), cut
    plain = dapo.pack_by_tokens(samples, 1024)
    copies = sum(len(s["prompt_ids"]) + s["len"] for s in samples)
    print(f"{len(samples)} samples: {len(packs)} micro-batches of <= 1024 real tokens, {forwarded} tokens, with "
          f"shared prompts; {len(plain)} micro-batches, {copies} tokens, with a copy per response")
    assert forwarded < copies and len(packs) < len(plain)


def test_token_budgets_keep_the_rules_sharing():
    """Eight showcase-like groups (a 92-token prompt, 8 answers of 3-12 tokens) cut by --micro-batch-tokens under
    sdpa's rule (a copy per response counted): each micro-batch holds whole groups in order, so the rule still
    shares them; the positions forwarded stay within 1.05x those of forced sharing (about a quarter of the copies'),
    at budgets of 2,000 and 6,000 tokens and at a half, once and twice SmolLM2's FLOP ratio for beta."""
    import random
    rng = random.Random(0)
    samples = []
    for g in range(8):
        prompt = [g + 3] * 92
        samples += [{"prompt_ids": prompt, "response_ids": [7] * n, "len": n} for n in
                    (rng.randint(3, 12) for _ in range(8))]

    def positions(mbs, share):
        return sum(len(mb[r[0]]["prompt_ids"]) + sum(mb[i]["len"] for i in r)
                   for mb in mbs for r in dapo.prompt_runs(mb, share))
    copies = sum(92 + s["len"] for s in samples)
    for budget in (2000, 6000):
        shared = positions(dapo.pack_by_tokens(samples, budget, True), True)
        for beta in (1536.0, 3072.0, 6144.0):
            mbs = dapo.pack_by_tokens(samples, budget, beta)
            assert sorted(map(id, (s for mb in mbs for s in mb))) == sorted(map(id, samples))
            assert all(sum(92 + s["len"] for s in mb) <= budget for mb in mbs)   # copies counted: the rule fits
            got = positions(mbs, beta)
            print(f"budget {budget}, beta {beta:.0f}: {len(mbs)} micro-batches, {got} positions forwarded; forced "
                  f"sharing {shared}, copies {copies}")
            assert got <= 1.05 * shared < copies / 3


def test_collate_with_shared_prompts_predicts_each_first_token_from_the_prompt():
    """The shared layout: each response's positions restart where its prompt ends (as a copy of the prompt
    would have them), its first token is predicted from the prompt's last position, its others from the
    position before them in its own response; a micro-batch with no repeated prompt is the plain layout."""
    samples = _grouped_samples(((3, [2, 4, 1]), (5, [3]), (2, [2, 2])), seed=3)
    b = dapo.collate(samples, 0, "cpu", shared=True)
    flat, pos, index = b["input_ids"].flatten(), b["position_ids"].flatten(), b["index"].tolist()
    at = 0
    for s in samples:
        n, P = len(s["response_ids"]), len(s["prompt_ids"])
        mine = index[at:at + n]   # the inputs that predict its tokens, at a copy's positions
        assert flat[mine].tolist() == [s["prompt_ids"][-1]] + s["response_ids"][:-1]
        assert pos[mine].tolist() == list(range(P - 1, P + n - 1))
        at += n
    assert torch.equal(b["targets"], torch.tensor([t for s in samples for t in s["response_ids"]]))
    alone = [dict(s, prompt_ids=[i] + s["prompt_ids"]) for i, s in enumerate(samples)]   # no prompt repeats
    assert dapo.collate(alone, 0, "cpu", shared=True).keys() == dapo.collate(alone, 0, "cpu").keys()
    assert "segment" not in dapo.collate(alone, 0, "cpu", shared=True)


def test_shared_prefix_is_off_where_the_attention_takes_no_such_mask(tmp_path, capsys):
    """Flash attention takes no mask, and a mask given replaces a sliding window's: there --shared-prefix is
    off, and preflight says so in a note and turns it off in the config the run records; a model whose
    attention is neither sdpa nor flex refuses a shared batch in one line rather than mis-read its mask."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config
    assert dapo.shared_prefix_off(dapo.Config(attn_impl="flash_attention_2")) == "flash attention takes no attention mask"
    assert dapo.shared_prefix_off(dapo.Config(attn_impl="flex_attention"), Qwen2Config()) == ""   # no window in use
    assert dapo.shared_prefix_off(dapo.Config(), LlamaConfig()) == ""
    for config in (Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=0),
                   MistralConfig(sliding_window=4096)):
        assert "sliding-window" in dapo.shared_prefix_off(dapo.Config(), config)
    Qwen2Config(vocab_size=64, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                head_dim=64, use_sliding_window=True, sliding_window=64, max_window_layers=0).save_pretrained(tmp_path)
    cfg = dapo.Config(model=str(tmp_path), max_prompt_len=16, max_response_len=8, overlong_cache_len=2,
                      shared_prefix=True)
    dapo.preflight(cfg)   # given, and impossible: a note, and off in the config the run records
    assert "note: --shared-prefix is off: the model's sliding-window" in capsys.readouterr().out
    assert cfg.shared_prefix is False
    assert dapo.sharing(dapo.Config(), config) is False   # by default: off without a note
    assert dapo.parse_config(["--no-shared-prefix"]).shared_prefix is False and dapo.Config().shared_prefix is None
    eager = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="eager"))
    batch = dapo.collate(_grouped_samples(((3, [2, 2]),)), 0, "cpu", shared=True)
    with pytest.raises(dapo.DapoError, match="--no-shared-prefix"):
        dapo.shared_prefix_mask(eager, batch)


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
    monkeypatch.setattr(dapo, "rank", lambda: 0)
    samples = [{"prompt_ids": [5 + i] * 3, "response_ids": [7] * n, "len": n, "truncated": False, "adv": 1.0}
               for i, n in enumerate((60, 20, 20, 20))]   # half the tokens each: rank 0 trains the long one alone
    _, plan = dapo.micro_batches(samples, dapo.Config(num_mini_batches=1, micro_batch_tokens=24), True)
    pads = [mb for mb in plan[0] if mb[0].get("dummy")]
    assert len(plan[0]) == 3 and len(pads) == 2                              # rank 1 needs 3 micro-batches
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


@pytest.mark.parametrize("precision,compiled", [("fp32", False), ("bf16", False), ("fp32", True)])
def test_weight_sync_refuses_a_missing_tensor_and_is_exact_at_step_0_and_after_an_update(tiny_model, precision,
                                                                                         compiled):
    """In fp32 and (where the CPU has bf16 instructions) bf16, the engine eager, and in fp32 compiled
    (--vllm-compile: the weights are loaded into the compiled model's own parameters). The stream carries every
    state_dict tensor, the tied head twice (lm_head.weight, the embedding again): from vLLM's dummy start (every
    run's first sync, and on CUDA every sync after a level-2 sleep), its fp32 engine on CPU reads the head from that
    name alone, and a stream without it leaves the head at its dummy values (the reason it is streamed every time).
    In bf16 vLLM's fp32 head multiplies by an fp32 copy of its weight, made at each sync (dapo._keep_fp32_head)."""
    if precision == "bf16" and dapo.check_data.cpu_lacks_bf16():
        pytest.skip("this CPU has no bf16 instructions: --precision bf16 is refused on it (tested end to end)")
    out = _run([sys.executable, "tests/test_exactness.py", "sync", tiny_model, precision, str(compiled)], timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"engine compiled: (\S+)", out.stdout).group(1) == str(compiled)
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
    # bf16 on a CPU: vLLM's fp32 head multiplies by a copy kept since the last sync, equal to its weight now
    assert re.search(r"kept fp32 head: (\S+)", out.stdout).group(1) == ("True" if precision == "bf16" else "None")


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
            dapo.shape_rewards(every, cfg)
            samples = [s for g in kept for s in g]
            for s, a in zip(samples, dapo.group_advantages(torch.tensor([s["reward"] for s in samples]), 4).tolist()):
                s["adv"] = a
            tokens = dapo.distribute(samples, cfg, True)
            trained = [s for s in samples if s["trainer"] == dapo.rank()]
            share = len(pickle.dumps([(s["response_ids"], s["vllm_logp"]) for s in trained]))
            # every rank trains on exactly the samples micro_batches gives it, with the generated tokens
            want = [s for micros in dapo.micro_batches(samples, cfg, True)[1] for mb in micros for s in mb if not s.get("dummy")]
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


def _sync_worker(model_dir, precision, compiled):
    """vLLM started with dummy weights (as every run starts it). First a stream without the tied head's second
    copy (lm_head.weight, the embedding again); then a stream missing one tensor, refused, naming it; the full
    stream then gives vLLM's log-probs equal to the trainer's before any generation, and after an update."""
    from vllm import SamplingParams
    cfg = dapo.Config(max_prompt_len=16, max_response_len=8, cpu_kv_cache_gb=0.25, precision=precision,
                      vllm_compile=compiled == "True")
    device = dapo.init_distributed()
    llm = dapo.start_engine(cfg, model_dir, device, dummy_weights=True)
    from torch._dynamo.utils import counters   # graphs dynamo captured in this process (vLLM's, at its start)
    print("engine compiled:", counters["stats"]["unique_graphs"] > 0)
    model = dapo.load_policy(cfg, model_dir, device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)   # before any forward, as set_up: the sharded params
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

    def kept_head(worker):  # the head vLLM multiplies by (kept in fp32 over bf16 weights), against its weight now
        engine = worker.model_runner.get_model()
        head = vars(engine.logits_processor).get("_apply_head")
        h = torch.randn(3, engine.lm_head.weight.shape[1]).to(engine.lm_head.weight.dtype)
        expected = torch.nn.functional.linear(h.float(), engine.lm_head.weight.float())
        return head and torch.equal(head(engine.lm_head, h, None), expected)
    print("kept fp32 head:", llm.collective_rpc(kept_head)[0])
    torch.distributed.destroy_process_group()


def _tiny_causal_lm(arch):
    """A random 2-layer fp32 model under sdpa: Qwen2 (the demo's architecture) or Llama (SmolLM2's, its KV
    heads shared by groups of 3 query heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                                            max_position_embeddings=1024, attn_implementation="sdpa")).eval()
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                                        num_attention_heads=3, num_key_value_heads=1, head_dim=32,
                                        attn_implementation="sdpa")).eval()


def _grouped_samples(spec, seed=0, vocab=64):
    """Samples in groups: spec holds (prompt length, [response lengths]) per group; random tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for prompt_len, lens in spec:
        prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        out += [{"prompt_ids": prompt, "response_ids": torch.randint(3, vocab, (n,), generator=g).tolist()} for n in lens]
    return out


def _logprobs_and_grads(model, samples, shared, one_row=False):
    """tools/trainer_check.py's check, which a GPU runs under flex attention: forward_logprobs of the samples in
    collate's layout, on the CPU, the head in chunks of 7 tokens: (log-probs, entropies, the gradient of the sum of
    the log-probs by parameter name, the batch)."""
    return trainer_check.logprobs_and_grads(model, samples, shared, one_row, "cpu", chunk=7)


def _shared_gaps(a, b):
    """(the largest |log-prob| difference, the largest gradient difference over the largest entry) of a against b
    (tools/trainer_check.py's, as the GPU check computes them)."""
    return trainer_check.shared_gaps(a, b)


def _hand_mask(samples):
    """Who sees whom in one row of the samples' groups, from the definition: a token sees the tokens at or
    before it in its own group's sequence that are in the prompt or in its own response."""
    owner = []   # (group, response or -1 for the prompt) of each token, in collate's one-row order
    runs = dapo.prompt_runs(samples)
    lens = [len(samples[r[0]]["prompt_ids"]) + sum(len(samples[i]["response_ids"]) for i in r) for r in runs]
    for k in dapo.first_fit_decreasing(lens, sum(lens))[0]:
        owner += [(k, -1)] * len(samples[runs[k][0]]["prompt_ids"])
        for i in runs[k]:
            owner += [(k, i)] * len(samples[i]["response_ids"])
    return torch.tensor([[kv <= q and owner[q][0] == owner[kv][0] and owner[kv][1] in (-1, owner[q][1])
                          for kv in range(len(owner))] for q in range(len(owner))])


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
        _sync_worker(sys.argv[2], sys.argv[3], sys.argv[4])
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
