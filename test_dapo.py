"""Tests of dapo.py against the DAPO paper (arXiv 2503.14476), in its order: Eq. 7 (the reward), Eq. 8 (J_DAPO),
Eq. 9 (the group advantage and the ratio), Eq. 10 (Clip-Higher), Eq. 11 (dynamic sampling), Eq. 12 (the token-level
loss), Sec. 3.4 (overlong filtering), Eq. 13 (the soft overlong punishment), Sec. 4.1's warm-up, Algorithm 1, and
the evaluation (avg@k, pass@k). Hand values throughout; each runs in milliseconds (`pytest test_dapo.py`).
Everything else, by topic, is in tests/ (`pytest` from the root runs both)."""
import dataclasses
import math
import os
import types
import pytest
import torch
from reward import compute_score, is_correct
import dapo
from tests.shared import HERE, _loss, _loss_at, _pg_run, _stub_sample_fn, _stubs, _toy_samples


pytestmark = pytest.mark.timeout(300, method="thread")  # a stuck test fails by itself


# =========================================================================================
# Eq. 7: the rule-based reward, R = ±1 (the checker itself: tests/test_reward.py)

def test_eq7_score_values():
    assert compute_score("Answer: 42", "42") == 1.0
    assert compute_score("Answer: 41", "42") == -1.0
    assert compute_score("no answer", "42") == -1.0
    assert is_correct(object(), "42") is False                  # never raises


# =========================================================================================
# Eq. 8: J_DAPO, the objective

def test_eq8_j_dapo_is_the_clipped_token_sum_over_every_token():
    """Eq. 8, J_DAPO = E[1 / Σ_i |o_i| Σ_i Σ_t min(r_{i,t} Â_{i,t}, clip(r_{i,t}, 1 - ε_low, 1 + ε_high) Â_{i,t})],
    by hand on two responses of 2 and 3 tokens: r = 1.1, 1.4 (Â = +1: the second is clipped at 1.28) and
    0.9, 0.7, 1.0 (Â = -1: 0.7 is clipped at 0.8). policy_loss returns -J over the 5 tokens, and only the
    unclipped tokens get a gradient, -Â r / 5 each."""
    ratio = torch.tensor([[1.1, 1.4, 1.0], [0.9, 0.7, 1.0]], dtype=torch.float64)
    logp = ratio.log().requires_grad_()
    mask, adv = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]), torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, stats = dapo.policy_loss(logp, torch.zeros_like(logp), adv, mask, dapo.Config())
    loss.backward()
    j = (min(1.1, 1.1) + min(1.4, 1.28) + min(-0.9, -0.9) + min(-0.7, -0.8) + min(-1.0, -1.0)) / 5
    assert loss.item() == pytest.approx(-j, rel=1e-12)
    want = torch.tensor([[-1.1 / 5, 0.0, 0.0], [0.9 / 5, 0.0, 1.0 / 5]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, want)
    assert stats["clip/high_frac"].item() == pytest.approx(1 / 5) and stats["clip/low_frac"].item() == pytest.approx(1 / 5)


# =========================================================================================
# Eq. 9: the group-relative advantage (and the ratio r_{i,t})

def test_eq9_group_advantage_hand_values():
    """Eq. 9: Â_{i,t} = (R_i - mean) / (std + 1e-6), the unbiased std of the group's G rewards, the same for every
    token of o_i; a group of equal rewards gets 0. set_advantages writes it into each sample (--adv-estimator
    grpo, the default)."""
    adv = dapo.group_advantages(torch.tensor([1.0, -1.0, 1.0, 1.0, 1.0, -1.0]), group_size=3)
    # group 1: mean 1/3, unbiased std sqrt(4/3); group 2 likewise, mirrored
    s = math.sqrt(4 / 3) + 1e-6
    expected = torch.tensor([2 / 3 / s, -4 / 3 / s, 2 / 3 / s, 2 / 3 / s, 2 / 3 / s, -4 / 3 / s])
    torch.testing.assert_close(adv, expected)
    assert dapo.group_advantages(torch.tensor([1.0, 1.0, -1.0, -1.0]), 2).abs().max() == 0  # uniform groups
    adv = dapo.group_advantages(torch.tensor([1.0, -1.0, 1.0, 1.0]), 4)  # std 1 exactly
    torch.testing.assert_close(adv, torch.tensor([0.5, -1.5, 0.5, 0.5]) / (1 + 1e-6))
    samples = [{"reward": x} for x in (1.0, -1.0, 1.0, 1.0)]
    dapo.set_advantages(samples, dapo.Config(group_size=4))
    assert [x["adv"] for x in samples] == pytest.approx([0.5 / (1 + 1e-6), -1.5 / (1 + 1e-6), 0.5 / (1 + 1e-6),
                                                       0.5 / (1 + 1e-6)])


def test_eq9_ratio_is_pi_theta_over_pi_theta_old_per_token(monkeypatch):
    """Eq. 9's r_{i,t} = π_θ(o_{i,t} | q, o_{i,<t}) / π_θold(o_{i,t} | q, o_{i,<t}), one per token, as policy_loss
    hands it to the objective: 0.5 / 0.4 = 1.25, 0.2 / 0.4 = 0.5; a padding token's is 1 (log-ratio 0) whatever
    its log-probs; a log-ratio beyond ±20 is clamped there (as verl's): e^100 is e^20, finite, and has no
    gradient. The loss is Eq. 10's on these r over the 5 tokens, and an unclipped token's gradient -Â r / 5."""
    seen, token_loss = {}, dapo.dapo_token_loss

    def spy(t, cfg):
        seen["t"] = t
        return token_loss(t, cfg)

    monkeypatch.setattr(dapo, "dapo_token_loss", spy)  # policy_loss calls it by name
    logp = torch.tensor([[math.log(0.5), math.log(0.2), 5.0], [0.0, -50.0, -1.0]], dtype=torch.float64,
                        requires_grad=True)
    old = torch.tensor([[math.log(0.4), math.log(0.4), -5.0], [-100.0, -20.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])                     # the first row's last is padding
    loss, stats = dapo.policy_loss(logp, old, torch.tensor([1.0, -1.0], dtype=torch.float64), mask, dapo.Config())
    loss.backward()
    e = math.exp
    torch.testing.assert_close(seen["t"].ratio, torch.tensor([[1.25, 0.5, 1.0], [e(20), e(-20), 1.0]],
                                                             dtype=torch.float64))
    torch.testing.assert_close(seen["t"].log_ratio, torch.tensor([[math.log(1.25), math.log(0.5), 0.0],
                                                                 [20.0, -20.0, 0.0]], dtype=torch.float64))
    # Â = +1: -1.25 and -0.5; Â = -1: e^20, 0.8 (0.8 clips e^-20 from below), 1
    assert loss.item() == pytest.approx((-1.25 - 0.5 + e(20) + 0.8 + 1.0) / 5, rel=1e-12)
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.25 / 5, -0.5 / 5, 0.0], [0.0, 0.0, 1 / 5]],
                                                       dtype=torch.float64))
    assert stats["clip/low_frac"].item() == pytest.approx(1 / 5)


# =========================================================================================
# Eq. 10: Clip-Higher

@pytest.mark.parametrize("ratio, adv, loss, clipped, side", [
    (1.28, 1.0, -1.28, False, None),      # exactly at 1 + eps_high: value r*A
    (1.30, 1.0, -1.28, True, "high"),     # beyond: clipped value, zero gradient
    (1.20, 1.0, -1.20, False, None),
    (0.50, 1.0, -0.50, False, None),      # A > 0 is never clipped from below (pessimistic min)
    (0.80, -1.0, 0.80, False, None),      # exactly at 1 - eps_low
    (0.70, -1.0, 0.80, True, "low"),      # beyond: clipped, zero gradient
    (1.50, -1.0, 1.50, False, None),      # A < 0 is never clipped from above
])
def test_eq10_clip_boundaries(ratio, adv, loss, clipped, side):
    got, grad, stats = _loss_at(ratio, adv)
    assert got == pytest.approx(loss, abs=1e-12)
    assert (grad == 0) == clipped
    assert stats["clip/high_frac"].item() == (1.0 if side == "high" else 0.0)
    assert stats["clip/low_frac"].item() == (1.0 if side == "low" else 0.0)


def test_eq10_clip_higher_is_asymmetric():
    assert _loss_at(1.25, 1.0, eps_high=0.2)[1] == 0          # GRPO's symmetric clip stops at 1.2
    assert _loss_at(1.25, 1.0, eps_high=0.28)[1] != 0         # Clip-Higher keeps learning to 1.28


# =========================================================================================
# Eq. 11: dynamic sampling

def test_eq11_dynamic_sampling_keeps_the_groups_whose_rewards_differ():
    """Eq. 11 keeps a group when 0 < #correct < G. On Eq. 7's ±1 rewards, "not all rewards equal" is exactly
    that, for every group of 1,000 random ones; a graded reward keeps the groups with a spread (a group all at
    0.1 is dropped, one of 0.1 and 0.3 kept)."""
    scores = torch.tensor([1, 1, 1, -1, -1, -1, 1, -1, -1, -1, 1, 1], dtype=torch.float)
    assert dapo.dynamic_sampling_mask(scores, group_size=3).tolist() == [False, False, True, True]
    g = torch.Generator().manual_seed(0)
    for G in (2, 3, 8):
        correct = torch.rand(1000 * G, generator=g) < torch.rand(1000, generator=g).repeat_interleave(G)
        n = correct.view(-1, G).sum(1)
        eq11 = (n > 0) & (n < G)
        assert eq11.any() and not eq11.all()
        assert torch.equal(dapo.dynamic_sampling_mask(correct.float() * 2 - 1, G), eq11)
    graded = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.3, 0.1, 0.0, 0.0, 0.0])
    assert dapo.dynamic_sampling_mask(graded, 3).tolist() == [False, True, False]


def test_eq11_filters_before_eq13_shapes_the_rewards():
    """collect_batch filters on the reward's score, not on the shaped reward: an all-wrong group whose lengths
    fall in Eq. 13's soft zone has shaped rewards that differ (-1.25, -1.5, -1), and is still dropped."""
    cfg = dapo.Config(prompts_per_step=1, group_size=3, gen_batch_size=2, max_gen_batches=1, max_response_len=8,
                      overlong_cache_len=4)
    wrong = [{"score": -1.0, "success": False, "len": n} for n in (5, 6, 3)]
    mixed = [{"score": s, "success": s > 0, "len": 2} for s in (1.0, -1.0, -1.0)]
    dapo.shape_rewards(wrong, cfg)
    assert len({s["reward"] for s in wrong}) == 3
    kept, _, seen, m = dapo.collect_batch(lambda idx, b: ([wrong, mixed], {}), dapo.Sampler(2, 0), cfg)
    assert kept == [mixed] and seen == [wrong, mixed] and m["filter/kept_frac"] == 0.5


def test_eq11_dynamic_sampling_drops_exactly_the_uniform_groups():
    cfg = dapo.Config(prompts_per_step=8, group_size=4, gen_batch_size=6, max_gen_batches=10)
    fn, calls = _stub_sample_fn(4)
    kept, surplus, seen, stats = dapo.collect_batch(fn, dapo.Sampler(300, seed=0), cfg)
    assert len(kept) == 8                                            # the batch fills
    assert all(g[0]["row"] % 3 == 2 for g in kept)                  # only mixed groups are kept
    drawn = [i for c in calls for i in c]
    mixed = [i for i in drawn if i % 3 == 2]
    assert [g[0]["row"] for g in kept] == mixed[:8]                 # all of them, in order
    assert [g[0]["row"] for g in surplus] == mixed[8:]              # what passed beyond N (dropped by default)
    assert stats["filter/gen_batches"] == len(calls) > 1           # it had to draw more batches
    assert stats["filter/kept_frac"] == pytest.approx(len(mixed) / len(drawn)) and stats["filter/carried"] == 0


def test_eq11_float_noise_is_no_spread_and_a_graded_spread_is():
    """Eq. 11 on a graded reward: a group whose rewards spread by float noise (1e-6 of a reward of ~1) is
    dropped, where Eq. 9's std + 1e-6 would have made it advantages of up to 0.76 (G = 16); a spread beyond
    1e-4 of the batch's largest |reward| is kept. For ±1, exactly Eq. 11 (the test above)."""
    G = 16
    noise = torch.full((G,), 0.5)
    noise[0] += 1e-6
    assert dapo.group_advantages(noise, G).abs().max().item() > 0.7          # what Eq. 9 would make of it
    graded = torch.cat([noise, torch.tensor([0.5] * 15 + [0.5002]), torch.tensor([0.2] * 8 + [1.0] * 8)])
    assert dapo.dynamic_sampling_mask(graded, G).tolist() == [False, True, True]
    assert dapo.dynamic_sampling_mask(torch.zeros(2 * G), G).tolist() == [False, False]


def test_eq11_dynamic_sampling_off_keeps_everything():
    cfg = dapo.Config(prompts_per_step=8, group_size=4, gen_batch_size=6, dynamic_sampling=False)
    fn, calls = _stub_sample_fn(4)
    kept, _, _, stats = dapo.collect_batch(fn, dapo.Sampler(300, seed=0), cfg)
    assert len(kept) == 8 and len(calls) == 1 and len(calls[0]) == 8


# =========================================================================================
# Eq. 12: the token-level policy-gradient loss

def test_eq12_padding_never_reaches_the_loss():
    b = dapo.collate(_toy_samples(), pad_id=0, device="cpu")
    logp, old, adv = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3)
    garbage = logp.clone()
    garbage[b["mask"] == 0] = 1e6
    for token_level in (True, False):
        a = _loss(logp, old, adv, b["mask"], token_level=token_level)[0]
        g = _loss(garbage, old, adv, b["mask"], token_level=token_level)[0]
        assert a.item() == g.item()


@pytest.mark.parametrize("token_level", [True, False])
def test_eq12_micro_batch_additivity(token_level):
    torch.manual_seed(0)
    B, T = 8, 12
    lengths = torch.randint(1, T + 1, (B,))
    mask = (torch.arange(T) < lengths[:, None]).float()
    logp = (torch.randn(B, T, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(B, T, dtype=torch.float64) * 0.3
    adv = torch.randn(B, dtype=torch.float64)
    full, _ = _loss(logp, old, adv, mask, token_level=token_level)
    full.backward()
    g_full = logp.grad.clone()
    logp.grad = None
    total = 0.0
    for sl in (slice(0, 3), slice(3, 4), slice(4, 8)):     # uneven micro-batches
        part, _ = _loss(logp[sl], old[sl], adv[sl], mask[sl], token_level=token_level,
                                 num_tokens=mask.sum(), num_samples=B)
        part.backward()
        total += part.item()
    assert abs(total - full.item()) < 1e-6
    torch.testing.assert_close(logp.grad, g_full, atol=1e-6, rtol=0)


def test_eq12_token_level_differs_from_sample_level():
    """Sec. 3.3: with per-sample averaging a long response weighs as much as a short one, so
    its tokens count less. Long answer A = +1 (10 tokens), short answer A = -1 (2 tokens)."""
    mask = torch.tensor([[1.0] * 10, [1.0] * 2 + [0.0] * 8])
    logp = torch.zeros(2, 10, requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    tok, _ = _loss(logp, logp.detach(), adv, mask, token_level=True)
    smp, _ = _loss(logp, logp.detach(), adv, mask, token_level=False)
    assert tok.item() == pytest.approx(-(10 - 2) / 12)
    assert smp.item() == pytest.approx(0.0)          # the two samples cancel
    g_tok = torch.autograd.grad(tok, logp)[0]
    g_smp = torch.autograd.grad(smp, logp)[0]
    assert g_tok[0, 0].item() == pytest.approx(-1 / 12)   # every token weighs 1/12
    assert g_smp[0, 0].item() == pytest.approx(-1 / 20)   # a long sample's token weighs 1/(2*10)
    assert g_smp[1, 0].item() == pytest.approx(1 / 4)     # a short sample's token weighs 1/(2*2)


# =========================================================================================
# Sec. 3.4: overlong filtering

def test_sec34_overlong_filtering_marks_a_truncated_sample_untrained_and_out_of_eq12s_count():
    """Sec. 3.4, overlong filtering: a truncated sample is marked untrained, and its tokens leave Eq. 12's
    denominator (the next test: they bear no loss nor gradient); off (GRPO), it counts like any other."""
    samples = _stubs([2, 3, 4], truncated=(1,))
    dapo.overlong_filtering(samples, dapo.Config())
    assert [s["trained"] for s in samples] == [True, False, True]
    assert dapo.loss_normaliser(samples, dapo.Config()) == (False, 2 + 4)
    dapo.overlong_filtering(samples, dapo.Config(overlong_filtering=False))
    assert all(s["trained"] for s in samples) and dapo.loss_normaliser(samples, dapo.Config()) == (False, 9)


def test_sec34_a_truncated_samples_tokens_bear_no_loss_and_no_gradient():
    """Sec. 3.4 through policy_gradient and the mask it builds (collate's, times each sample's "trained"), on a
    stand-in model whose log-probs are a leaf tensor, at π_θold (r = 1). Of three responses of 3, 2 and 4
    tokens, Â = +1, -1, +1, the truncated third's tokens get exactly no gradient and add nothing to the loss,
    -(3 - 2) / 5 over Eq. 12's 5 trained tokens, while each other token gets -Â / 5. With overlong filtering off
    they train like the others': -Â / 9 each, the loss -(3 - 2 + 4) / 9."""
    for filtering, n, loss in ((True, 5, -(3 - 2) / 5), (False, 9, -(3 - 2 + 4) / 9)):
        cfg = dapo.Config(overlong_filtering=filtering)
        samples = [dict(s, len=len(s["response_ids"]), adv=a) for s, a in zip(_toy_samples(), (1.0, -1.0, 1.0))]
        dapo.overlong_filtering(samples, cfg)
        assert [s["trained"] for s in samples] == [True, True, not filtering]
        assert dapo.loss_normaliser(samples, cfg) == (False, n)
        leaves = []

        def forward_logprobs(batch, temperature, chunk):  # (B, R) log-probs, one leaf tensor per micro-batch
            leaves.append(torch.full(batch["mask"].shape, -1.0, requires_grad=True))
            return leaves[-1], torch.zeros(batch["mask"].shape)

        model = types.SimpleNamespace(forward_logprobs=forward_logprobs)
        sums, tokens = dapo.policy_gradient(_pg_run(model, cfg, "cpu"), samples, [samples])
        truncated = [0.0] * 4 if filtering else [-1.0] * 4
        want = torch.tensor([[-1.0, -1.0, -1.0, 0.0], [1.0, 1.0, 0.0, 0.0], truncated]) / n   # padding: 0
        torch.testing.assert_close(leaves[0].grad, want, rtol=0, atol=1e-7)
        assert (leaves[0].grad[2] == 0).all() == filtering and (leaves[0].grad[0, :3] != 0).all()
        assert tokens == n and sums["loss"] == pytest.approx(loss, rel=1e-6)


# =========================================================================================
# Eq. 13: the soft overlong punishment

def test_eq13_overlong_penalty_pieces():
    lengths = torch.tensor([0, 10, 12, 13, 14, 16, 17, 100])
    got = dapo.overlong_penalty(lengths, max_len=16, cache_len=4)  # soft zone starts at 12
    torch.testing.assert_close(got, torch.tensor([0, 0, 0, -0.25, -0.5, -1.0, -1.0, -1.0]))


def test_eq13_shape_rewards_then_eq9_advantages_hand_values():
    """Eq. 7 + Eq. 13 with L_max 10, L_cache 4 (the soft zone starts after 6 tokens), then Eq. 9 per
    group of 3: a uniform group gets 0 and does not count as effective; punishment off: +-1 only."""
    cfg = dapo.Config(max_response_len=10, overlong_cache_len=4, group_size=3)
    samples = [{"score": 1.0 if c else -1.0, "len": n} for c, n in
               [(True, 4), (True, 8), (False, 12), (True, 5), (True, 6), (True, 3)]]
    dapo.shape_rewards(samples, dataclasses.replace(cfg, soft_overlong_punishment=False))
    assert [s["reward"] for s in samples] == [1.0, 1.0, -1.0, 1.0, 1.0, 1.0]
    dapo.shape_rewards(samples, cfg)
    assert [s["reward"] for s in samples] == [1.0, 1.0 - 0.5, -1.0 - 1.0, 1.0, 1.0, 1.0]
    dapo.set_advantages(samples, cfg)
    assert dapo.effective_groups(samples, 3) == 1                          # the second group is uniform
    r = torch.tensor([1.0, 0.5, -2.0])
    expect = ((r - r.mean()) / (r.std() + 1e-6)).tolist() + [0.0, 0.0, 0.0]
    assert [s["adv"] for s in samples] == pytest.approx(expect, abs=1e-6)


# =========================================================================================
# Sec. 4.1: the learning-rate warm-up (the update's schedule, not a line of Algorithm 1)

def test_sec41_warmup_rises_linearly_over_rollout_steps_from_lr_over_warmup():
    """Sec. 4.1's schedule (not a line of Algorithm 1): a constant lr after a linear warm-up over the first
    warmup_steps rollout steps, starting at lr / warmup_steps (the reference run's first step trains at 0)."""
    cfg = dapo.Config(lr=1e-6, warmup_steps=4)
    assert [dapo.warmup_lr(step, cfg) for step in range(1, 7)] == pytest.approx([2.5e-7, 5e-7, 7.5e-7, 1e-6, 1e-6,
                                                                                 1e-6])
    assert dapo.warmup_lr(1, dataclasses.replace(cfg, warmup_steps=0)) == 1e-6


# =========================================================================================
# Algorithm 1: the loop

def test_algorithm1_train_makes_its_calls_in_the_papers_order():
    """train() is Algorithm 1 and nothing else: in one rollout step it samples, rewards and filters (lines 2 and
    4-8, collect_batch), shapes the rewards (Eq. 13), computes the advantages (line 9, Eq. 9), filters the
    overlong samples (Sec. 3.4), runs the μ updates (lines 10-11), pushes the weights into vLLM (line 3 of the
    next step), evaluates, logs and saves, in that order; the loop calls nothing else but the two hooks after DAPO
    (Part 2: end_of_step after the weight push, before the checkpoint) and the sample exchange (Part 3)."""
    import ast
    tree = next(n for n in ast.parse(open(os.path.join(HERE, "dapo.py")).read()).body
                if isinstance(n, ast.FunctionDef) and n.name == "train")
    loop = next(n for n in ast.walk(tree) if isinstance(n, ast.For))
    nodes = [n for n in ast.walk(loop) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    calls = [n.func.id for n in sorted(nodes, key=lambda n: (n.lineno, n.col_offset))]
    paper = ["collect_batch", "shape_rewards", "set_advantages", "overlong_filtering", "update_policy",
             "push_weights", "evaluate", "log_step", "save_checkpoint"]
    order = sorted(paper, key=lambda c: min(i for i, x in enumerate(calls) if x == c))
    assert order == paper, calls
    hooks = {"after_rollout", "end_of_step"}   # Part 2's, each off at DAPO's defaults
    assert set(calls) == set(paper) | {"steps_left", "sample_groups", "to_trainers"} | hooks, calls
    assert calls.index("push_weights") < calls.index("end_of_step") < calls.index("save_checkpoint"), calls


# The paper's Algorithm 1, line by line: what the line says, and the function of dapo.py that does it
ALGORITHM_1 = {
    1: ("for step = 1, ..., M", "steps_left"),
    2: ("sample a batch D_b from D", "sample_groups"),   # the prompts collect_batch hands to draw()
    3: ("update the old policy model π_θold <- π_θ", "push_weights"),
    4: ("sample G outputs {o_i} ~ π_θold(.|q) for each q in D_b", "sample_groups"),
    5: ("compute rewards {r_i} for each o_i by running R", "sample_groups"),
    6: ("filter out o_i, add the rest to the dynamic sampling buffer (Eq. 11)", "collect_batch"),
    7: ("if buffer size n_b < N:", "collect_batch"),
    8: ("continue", "collect_batch"),
    9: ("for each o_i in the buffer, compute Â_{i,t} (Eq. 9)", "set_advantages"),
    10: ("for iteration = 1, ..., μ", "update_policy"),
    11: ("update π_θ by maximising the DAPO objective (Eq. 8)", "update_policy"),
}


def _line_numbers(text):
    """"2, 4, 5" -> {2, 4, 5}; "6-8" -> {6, 7, 8}; "2 and 4-8" -> {2, 4, 5, 6, 7, 8}."""
    out = set()
    for part in text.replace(" and ", ",").split(","):
        a, _, b = part.strip().partition("-")
        out |= set(range(int(a), int(b or a) + 1))
    return out


def test_algorithm1_line_numbers_are_the_papers():
    """Algorithm 1's line numbers in dapo.py, against the paper's (ALGORITHM_1). In train(), a comment that opens
    with line numbers and a colon ("# 6-8: ...", "# 3, for the next step: ...") labels its statement (the one it
    ends, or for a comment on a line of its own the next), and names exactly the lines done by the functions that
    statement calls (a loop's header, a def's body); together they name each line once. A docstring that says
    "Algorithm 1, lines 2, 4-8" (or "line 3") claims exactly the lines its function does, with those of the
    function train() hands it (collect_batch runs draw, which runs sample_groups)."""
    import ast
    import io
    import re
    import tokenize
    src = open(os.path.join(HERE, "dapo.py")).read()
    tree = ast.parse(src)
    train = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    stmts = [n for n in ast.walk(train) if isinstance(n, ast.stmt) and n is not train]
    defs = {n.name: n for n in stmts if isinstance(n, ast.FunctionDef)}   # draw

    def does(node):  # the paper's lines done by the functions a statement calls
        parts = [node.iter] if isinstance(node, ast.For) else node.body if isinstance(node, ast.FunctionDef) else [node]
        names = {c.func.id if isinstance(c.func, ast.Name) else c.func.attr for p in parts for c in ast.walk(p)
                 if isinstance(c, ast.Call) and isinstance(c.func, (ast.Name, ast.Attribute))}
        return {line for line, (_, fn) in ALGORITHM_1.items() if fn in names}

    wrong, named = [], []
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        row = tok.start[0]
        if tok.type != tokenize.COMMENT or not train.lineno <= row <= train.end_lineno:
            continue
        m = re.match(r"#\s*(\d+(?:\s*[-,]\s*\d+)*)(?:,[^:]*)?:", tok.string)
        if not m:
            if re.match(r"#\s*\d", tok.string):
                wrong.append(f"dapo.py:{row} opens with a number: give Algorithm 1's lines as '# 6-8: ...'")
            continue
        if tok.line[:tok.start[1]].strip():   # at the end of a line: the innermost statement there
            stmt = max((n for n in stmts if n.lineno <= row <= n.end_lineno), key=lambda n: n.lineno)
        else:                                 # on a line of its own: the statement below it
            stmt = min((n for n in stmts if n.lineno > row), key=lambda n: (n.lineno, -n.end_lineno))
        says = _line_numbers(m.group(1))
        named += sorted(says)
        if says != does(stmt):
            wrong.append(f"dapo.py:{row} says lines {sorted(says)}; its statement (line {stmt.lineno}) does "
                         f"{sorted(does(stmt))}: {tok.string}")
    if sorted(named) != sorted(ALGORITHM_1):
        wrong.append(f"train()'s comments name lines {sorted(named)}: name each of 1-{len(ALGORITHM_1)} once")
    handed = {c.func.id: [defs[a.id] for a in c.args if isinstance(a, ast.Name) and a.id in defs]
              for c in ast.walk(train) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
    claimed = set()
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        doc = ast.get_docstring(fn) or ""
        for m in re.finditer(r"Algorithm 1\b[^.]*?\blines?\s+(\d+(?:\s*(?:-|,|\band\b)\s*\d+)*)", doc):
            claimed.add(fn.name)
            lines = {line for line, (_, f) in ALGORITHM_1.items() if f == fn.name}
            lines |= {line for d in handed.get(fn.name, []) for line in does(d)}
            if _line_numbers(m.group(1)) != lines:
                wrong.append(f"{fn.name}'s docstring says Algorithm 1's lines {m.group(1)}; it does {sorted(lines)}")
    assert not wrong, "\n".join(wrong)
    assert claimed >= {"collect_batch", "update_policy", "push_weights"}, claimed


# =========================================================================================
# Evaluation: avg@k, pass@k, maj@k (the paper's avg@32 and cons@32)

def test_evaluate_aggregates_exact_values(monkeypatch, capsys):
    """evaluate() on known successes and answers (the sampler stubbed): avg@k, unbiased pass@k and maj@k
    over the prompts, maj@k ties to the first answer seen, per-level means, the share of responses that
    give an answer at all (eval/answered), --eval-max-prompts. The math checker votes by equivalence class
    ("2" and "2.0" are one answer); a reward of one's own that gives answers votes by identical answers, and
    one that gives none reports neither maj@k nor eval/answered."""
    rows = [{"answer": "1", "level": 1}, {"answer": "2", "level": 1}, {"answer": "3", "level": 2},
            {"answer": "4", "level": 2}, {"answer": "5", "level": 2}]
    graded = [[(True, "1"), (False, "7"), (False, "7"), (False, "7")],      # 1/4 right, majority 7: wrong
              [(True, "2"), (True, "2.0"), (False, "9"), (False, "9")],     # a tie: "2" came first, right
              [(False, "8"), (True, "3"), (False, "9"), (False, None)],     # a tie of three: "8" first, wrong
              [(True, "4"), (True, "4"), (True, "4"), (True, "4")],
              [(True, "5")] * 4]                                            # beyond --eval-max-prompts 4
    answers = True

    def stub(run, rows_, ids, idx, n, temperature, top_p, key):
        assert n == 4 and list(idx) == [0, 1, 2, 3]
        return [[{"success": c, **({"answer": a} if answers else {})} for c, a in graded[i]] for i in idx], {}

    monkeypatch.setattr(dapo, "sample_groups", stub)
    cfg = dapo.Config(eval_samples=4, eval_max_prompts=4)
    run = types.SimpleNamespace(cfg=cfg, eval_rows=rows, eval_ids=[[1]] * 5)
    out = dapo.evaluate(run, "test")
    assert out == {"eval/avg@4": (1 / 4 + 2 / 4 + 1 / 4 + 1) / 4, "eval/pass@4": 1.0, "eval/maj@4": 2 / 4,
                   "eval/avg@4/d1": (1 / 4 + 2 / 4) / 2, "eval/avg@4/d2": (1 / 4 + 1) / 2,
                   "eval/answered": (1 + 1 + 3 / 4 + 1) / 4}                  # one answer is None
    assert capsys.readouterr().out.startswith("eval (test): eval/avg@4 0.500  eval/pass@4 1.000  eval/maj@4 0.500")
    run.cfg = dataclasses.replace(cfg, reward="own.py:graded")               # "2" and "2.0" differ: "9" wins
    assert dapo.evaluate(run, "own")["eval/maj@4"] == 1 / 4
    answers = False                                                         # a reward that gives no answers
    assert set(dapo.evaluate(run, "none")) == {"eval/avg@4", "eval/pass@4", "eval/avg@4/d1", "eval/avg@4/d2"}
    run.cfg = dataclasses.replace(cfg, eval_samples=0)
    assert dapo.evaluate(run, "none") == {}                                 # --eval-samples 0: no evaluation


def test_pass_at_k_unbiased():
    assert dapo.pass_at_k(4, 0, 1) == 0 and dapo.pass_at_k(4, 4, 1) == 1
    assert dapo.pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert dapo.pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)          # 1 - C(3,2)/C(5,2)
