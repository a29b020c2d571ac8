"""What came after DAPO (dapo.py's Part 2), each behind its own flag: the later objectives (OBJECTIVES) and advantage
estimators (ADV_ESTIMATORS) against hand values, the rollout corrections, the KL penalty, the token selection,
carried surplus and skipped prompts (on the demo, where they bite), and LoRA (its gradient, reference, export)."""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
import dataclasses
import json
import math
import re
import shutil
import types
import pytest
import torch
from lib import interrupt
import dapo
from tests.shared import (
    GRAD_RTOL, KNOBS, _dapo, _dcp_model, _grads, _loss, _loss_at, _relative_gap, _run, _stub_sample_fn,
    _stubs, _torchrun, _update_samples)


pytestmark = pytest.mark.timeout(1200, method="thread")  # the subprocess helpers time out first


def test_advantage_estimators_after_dapo_hand_values():
    """--adv-estimator dr_grpo (R - mean) and rloo (R - the mean of the other G - 1) on [1, -1, 1, 1]: RLOO's is
    G / (G - 1) times Dr. GRPO's. --loss dr_grpo presets dr_grpo, and set_advantages uses the flag."""
    r = torch.tensor([1.0, -1.0, 1.0, 1.0])
    assert dapo.dr_grpo_advantages(r, 4).tolist() == [0.5, -1.5, 0.5, 0.5]
    torch.testing.assert_close(dapo.rloo_advantages(r, 4), torch.tensor([2 / 3, -2.0, 2 / 3, 2 / 3]))
    torch.testing.assert_close(dapo.rloo_advantages(torch.tensor([0.1, 0.1, 0.4]), 3),
                               torch.tensor([-0.15, -0.15, 0.3]))
    assert dapo.parse_config(["--loss", "dr_grpo"]).adv_estimator == "dr_grpo"
    assert dapo.parse_config(["--loss", "dr_grpo", "--adv-estimator", "rloo"]).adv_estimator == "rloo"
    samples = [{"reward": x} for x in r.tolist()]
    dapo.set_advantages(samples, dapo.Config(group_size=4, adv_estimator="rloo"))
    assert [s["adv"] for s in samples] == pytest.approx([2 / 3, -2.0, 2 / 3, 2 / 3])


def _verl_reinforce_pp_baseline(token_level_rewards, response_mask, index):
    """verl's compute_reinforce_plus_plus_baseline_outcome_advantage and its verl_F.masked_whiten
    (verl/trainer/ppo/core_algos.py, verl/utils/torch_functional.py), transcribed as they are."""
    from collections import defaultdict
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean = defaultdict(list), {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx in id2score:
        id2mean[idx] = torch.tensor(0.0) if len(id2score[idx]) == 1 else torch.mean(torch.stack(id2score[idx]))
    for i in range(scores.shape[0]):
        scores[i] = scores[i] - id2mean[index[i]]
    scores = scores.unsqueeze(-1).tile([1, token_level_rewards.shape[-1]]) * response_mask
    masked_mean = lambda v, m: (torch.where(m.bool(), v, 0.0) * m).sum() / (m.sum() + 1e-8)  # noqa: E731
    mean = masked_mean(scores, response_mask)
    var = masked_mean((scores - mean) ** 2, response_mask) * response_mask.sum() / (response_mask.sum() - 1)
    return (scores - mean) * torch.rsqrt(var + 1e-8) * response_mask


def test_reinforce_pp_baseline_equals_verls_and_an_estimator_reads_the_keys_its_entry_names():
    """--adv-estimator reinforce_pp_baseline: the group's mean subtracted, then whitened over the batch's tokens
    (a response counts |o_i| times), equal to verl's on 200 random batches (every token of a response carries the
    response's value). It reads each sample's shaped reward and its length: set_advantages hands an estimator the
    sample keys its ADV_ESTIMATORS entry names, so a new one needs no change outside Part 2."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        G, n = 4, 3
        rewards = torch.randint(-1, 2, (G * n,), generator=g).float() + 0.1 * torch.rand(G * n, generator=g)
        lengths = torch.randint(1, 9, (G * n,), generator=g)
        mask = (torch.arange(8) < lengths[:, None]).float()
        token_rewards = torch.zeros(G * n, 8)
        token_rewards[torch.arange(G * n), lengths - 1] = rewards   # verl: the score on the last token
        want = _verl_reinforce_pp_baseline(token_rewards, mask, [i // G for i in range(G * n)])
        got = dapo.reinforce_pp_baseline_advantages(rewards, lengths, G)
        torch.testing.assert_close(got[:, None] * mask, want)
    assert dapo.ADV_ESTIMATORS["reinforce_pp_baseline"]["reads"] == ("reward", "len")
    samples = [{"reward": r, "len": n} for r, n in ((1.0, 3), (-1.0, 5), (-1.0, 2), (1.0, 7))]
    dapo.set_advantages(samples, dapo.Config(group_size=2, adv_estimator="reinforce_pp_baseline"))
    want = dapo.reinforce_pp_baseline_advantages(torch.tensor([1.0, -1, -1, 1]), torch.tensor([3, 5, 2, 7]), 2)
    assert [s["adv"] for s in samples] == pytest.approx(want.tolist())
    assert samples[0]["adv"] != pytest.approx(-samples[1]["adv"])   # the lengths weigh the whitening's mean


def test_dual_clip_bounds_negative_advantages():
    assert _loss_at(20.0, -1.0)[0] == pytest.approx(20.0)
    got, grad, _ = _loss_at(20.0, -1.0, dual_clip=10.0)
    assert got == pytest.approx(10.0) and grad == 0
    assert _loss_at(20.0, 1.0, dual_clip=10.0)[0] == pytest.approx(-1.28)   # A > 0 untouched


def test_carry_surplus_takes_at_most_half_a_batch_and_every_step_generates():
    """--carry-surplus: the groups that passed Eq. 11 beyond N come first in the next step's batch; at most
    N // 2 are carried (the rest dropped, and counted), so every step draws at least one generation batch and
    at least half its batch is its own; filter/carried is the number carried. The surplus returned is the
    step's new groups alone. Off (no carried groups), collect_batch is as before."""
    cfg = dapo.Config(prompts_per_step=8, group_size=4, gen_batch_size=6, max_gen_batches=10)
    fn, calls = _stub_sample_fn(4)
    kept, surplus, _, _ = dapo.collect_batch(fn, dapo.Sampler(300, seed=0), cfg)
    assert len(surplus) == 1                                         # 3 batches: 9 mixed, 8 kept
    carried, dropped = dapo.keep_surplus(surplus, cfg.prompts_per_step // 2)
    assert carried == surplus and dropped == 0 and all(s["carried"] for g in carried for s in g)
    sampler = dapo.Sampler(300, seed=1)
    calls.clear()
    kept2, surplus2, _, stats = dapo.collect_batch(fn, sampler, cfg, carried=carried)
    assert kept2[0] is surplus[0] and len(kept2) == 8 and stats["filter/carried"] == 1
    assert all(g[0]["row"] % 3 == 2 for g in kept2[1:] + surplus2)  # mixed groups only
    assert all(g not in surplus for g in surplus2)                   # the surplus is new groups only
    many = [[{"row": i, "score": 1.0, "success": True}] for i in range(10)]
    carried, dropped = dapo.keep_surplus(many, cfg.prompts_per_step // 2)
    assert carried == many[:4] and dropped == 6                      # at most N // 2 carried
    calls.clear()
    kept3, surplus3, seen3, stats = dapo.collect_batch(fn, sampler, cfg, carried=carried)
    assert kept3[:4] == many[:4] and len(kept3) == 8 and len(calls) >= 1 and stats["filter/gen_batches"] >= 1
    assert stats["filter/carried"] == 4 and seen3 and all(g not in many for g in kept3[4:] + surplus3)


def test_resume_with_another_group_size_drops_the_carried_groups_of_the_old(capsys):
    """A resume with a changed --group-size (which too_few_groups advises) takes the carried groups of the
    new size alone: Eq. 9 views the batch as groups of G, and groups of 4 among groups of 8 would be
    normalised two as one. The others are dropped, with a note."""
    old = [[{"row": i, "len": 1} for _ in range(4)] for i in range(3)]
    cfg = dapo.Config(group_size=8, prompts_per_step=4)
    assert dapo.restore_carried(old, cfg) == []
    assert capsys.readouterr().out == "resume: dropped the 3 carried groups of 4 responses (--group-size is now 8)\n"
    same = [[{"row": i, "len": 1} for _ in range(8)] for i in range(3)]
    assert dapo.restore_carried(same, cfg) == same[:2] and capsys.readouterr().out == ""   # and at most N // 2


def test_dppo_truncates_its_ratio_at_c_against_the_rollout_policy():
    """DPPO as its authors' code computes it (Stable-RL's dppo_binary_tv): the weight is π_θ / π_rollout,
    truncated at c (--dppo-ratio-cap; default the authors' runs' 1e4, in effect none), and the trust region is
    centred on π_rollout (--dppo-anchor rollout), or on π_θold (recompute, their *_recompute variants). A token
    going from p = 0.001 to 0.05 with A < 0 is inside the TV region: its gradient is the ratio, 50, and c = 10
    truncates it to 10."""
    logp = torch.tensor([[math.log(0.05)]], dtype=torch.float64, requires_grad=True)
    old = torch.full((1, 1), math.log(0.001), dtype=torch.float64)
    adv, mask = torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 1)
    cfg = dapo.Config(loss="dppo_tv", **dapo.OBJECTIVES["dppo_tv"]["preset"])
    assert cfg.dppo_ratio_cap == 1e4 and cfg.dppo_anchor == "rollout"
    for c, want in ((1e4, 50.0), (10.0, 10.0)):                       # -A min(50, c)
        lp = logp.detach().clone().requires_grad_()
        loss, _ = dapo.policy_loss(lp, old, adv, mask, dataclasses.replace(cfg, dppo_ratio_cap=c))
        loss.backward()
        assert lp.grad.item() == pytest.approx(want), c
    # the rollout's log-probs, where they differ from π_θold's: the ratio is π_θ / π_rollout either way, the
    # region's centre follows --dppo-anchor. π_θ = 0.6, π_θold = 0.5, π_rollout = 0.4, A > 0: +0.2 from the
    # rollout is beyond ε 0.15; +0.1 from π_θold is inside, with the weight 0.6 / 0.4 = 1.5
    p, q, rollout = (torch.tensor([[math.log(x)]], dtype=torch.float64) for x in (0.6, 0.5, 0.4))
    for anchor, want in (("rollout", 0.0), ("recompute", -1.5)):
        c = dataclasses.replace(cfg, dppo_anchor=anchor)
        lp = p.clone().requires_grad_()
        loss, st = dapo.policy_loss(lp, q, torch.tensor([1.0], dtype=torch.float64), mask, c,
                                    more={"rollout_logp": rollout})
        loss.backward()
        assert lp.grad.item() == pytest.approx(want), anchor
        assert st["clip/high_frac"].item() == (want == 0.0)


def test_dppo_counts_the_rollout_correction_once_and_refuses_tis_cap():
    """DPPO's weight min(π_θ / π_rollout, c) is itself the rollout correction. One token with π_θ = π_θold = 0.5,
    π_rollout = 0.4, A = +1: d loss / d log π = -1.25, as in Stable-RL and in verl (dppo_tv's π_θ / π_θold times
    its rollout weight π_θold / π_rollout). --tis-cap would multiply π_θold / π_rollout in again (-1.5625): the
    pair is refused in one line, as are --tis-mode and --tis-min."""
    half, rollout = (torch.tensor([[math.log(x)]], dtype=torch.float64) for x in (0.5, 0.4))
    for loss_name in ("dppo_tv", "dppo_kl"):
        cfg = dapo.Config(loss=loss_name, **dapo.OBJECTIVES[loss_name]["preset"])
        lp = half.clone().requires_grad_()
        loss, _ = dapo.policy_loss(lp, half, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 1), cfg,
                                   more={"rollout_logp": rollout})
        loss.backward()
        assert lp.grad.item() == pytest.approx(-1.25), loss_name
        for flags in (["--tis-cap", "2"], ["--tis-mode", "sequence_mask"]):
            with pytest.raises(dapo.DapoError) as e:
                dapo.check_config(dapo.parse_config(["--loss", loss_name, *flags]))
            assert f"{flags[0]} " in str(e.value) and f"--loss {loss_name}" in str(e.value) and "\n" not in str(e.value)


def test_gmpo_takes_the_geometric_mean_of_per_token_weights_and_a_selection_holds():
    """Under GMPO a per-token weight (a rollout correction's) enters as one per sequence, their geometric mean,
    as verl's geo_mean: weights 2 and 0.5 give 1, a loss of -1.0 at r = 1, A = 1 (their arithmetic mean would
    give -1.25). GSPO's weighting stays the arithmetic mean (verl's too). With a token selection
    (--top-entropy-quantile), a token not selected gets no gradient under GSPO and GMPO, as under DAPO: each
    token carries the sequence's ratio with its own token's gradient (verl's s_i,t = sg[s_i] π / sg[π])."""
    mask, adv, w = torch.ones(1, 2), torch.tensor([1.0], dtype=torch.float64), torch.tensor([[2.0, 0.5]])
    gmpo = dapo.Config(loss="gmpo", **dapo.OBJECTIVES["gmpo"]["preset"])
    gspo = dapo.Config(loss="gspo", **dapo.OBJECTIVES["gspo"]["preset"])
    zero = torch.zeros(1, 2, dtype=torch.float64)
    norm = dapo.Normaliser(per_sample=True, n=1)
    assert dapo.policy_loss(zero, zero, adv, mask, gmpo, norm, {"weight": w})[0].item() == pytest.approx(-1.0, abs=1e-8)
    assert dapo.policy_loss(zero, zero, adv, mask, gspo, norm, {"weight": w})[0].item() == pytest.approx(-1.25)
    select = torch.tensor([[1.0, 0.0]])
    for cfg in (gmpo, gspo, dapo.Config()):
        logp = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
        full = torch.autograd.grad(dapo.policy_loss(logp, zero, adv, mask, cfg, norm)[0], logp)[0]
        sel = torch.autograd.grad(dapo.policy_loss(logp, zero, adv, mask, cfg, norm, {"select": select})[0], logp)[0]
        assert sel[0].tolist() == pytest.approx([full[0, 0].item(), 0.0]) and full[0, 1] != 0, cfg.loss


def test_skip_solved_sets_aside_the_prompts_always_solved():
    """--skip-solved 2: a prompt whose group was all right in each of its last 2 draws is drawn no more; one
    wrong response resets its count. The pool never falls below a generation batch: then every prompt set
    aside returns. The sampler's order is otherwise the same (a resume restores the set)."""
    right, wrong = [{"row": 3, "success": True}] * 4, [{"row": 3, "success": True}] * 3 + [{"row": 3, "success": False}]
    record = {}
    assert dapo.set_aside_solved(record, [right], 2) == [] and record == {3: 1}
    assert dapo.set_aside_solved(record, [wrong], 2) == [] and record == {3: 0}
    assert dapo.set_aside_solved(record, [right], 2) == [] and dapo.set_aside_solved(record, [right], 2) == [3]
    sampler, plain = dapo.Sampler(10, seed=0, keep=4), dapo.Sampler(10, seed=0)
    assert sampler.set_aside([3, 5]) == 2
    drawn = sampler.take(20)
    assert 3 not in drawn and 5 not in drawn and drawn == [i for i in plain.take(25) if i not in (3, 5)][:20]
    assert sampler.set_aside([0, 1, 2, 4]) == 6 and sampler.set_aside([6]) == 0   # 3 left < 4: all return
    again = dapo.Sampler(10, seed=0, keep=4)
    again.restore(sampler.epoch, sampler.pos, [3, 5])
    assert 3 not in again.take(16)


def test_gspo_clips_a_sequence_as_a_whole_and_each_token_gets_its_share():
    """GSPO: s_i = exp(mean log-ratio). Sequence 0 (A = +1): its first token's own ratio is 1, inside
    the clip, but s_0 = e^0.2 is beyond 1 + 4e-4, so no token of it gets a gradient (DAPO's token clip
    would train that token). Sequence 1 (A = -1, s_1 = 1): each of its 4 tokens gets 1/(|y| N) = 1/8."""
    cfg = dapo.Config(loss="gspo", **dapo.OBJECTIVES["gspo"]["preset"])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    logp = torch.tensor([[0.0, 0.4, 0.0, 0.0], [0.002, -0.002, 0.001, -0.001]], dtype=torch.float64,
                        requires_grad=True)
    old, adv = torch.zeros(2, 4, dtype=torch.float64), torch.tensor([1.0, -1.0], dtype=torch.float64)
    stubs = _stubs([2, 4])
    dapo.overlong_filtering(stubs, cfg)
    norm = dapo.loss_normaliser(stubs, cfg)
    assert norm == (True, 2)                                         # the mean of the sequence means
    loss, st = dapo.policy_loss(logp, old, adv, mask, cfg, norm)
    loss.backward()
    assert loss.item() == pytest.approx((-(1 + 4e-4) + 1.0) / 2)     # clipped value, then s_1 |A|
    assert logp.grad[0].abs().max().item() == 0.0                    # the whole sequence is clipped
    torch.testing.assert_close(logp.grad[1], torch.full((4,), 1 / 8, dtype=torch.float64))
    assert st["clip/high_frac"].item() == pytest.approx(2 / 6) and st["clip/low_frac"].item() == 0
    dapo_grad = torch.autograd.grad(_loss(logp, old, adv, mask)[0], logp)[0]
    assert dapo_grad[0, 0].item() != 0                               # DAPO's token clip would train it


def test_cispo_keeps_the_gradient_beyond_the_clip_with_its_weight_capped():
    """CISPO: -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi. A token at r = 2 (A > 0) still gets a
    gradient, with its weight capped at 1.28; one at r = 1.1 gets exactly DAPO's gradient; with no lower
    bound (eps_low = 1) a token at r = 0.5 (A < 0) keeps its weight 0.5, where DAPO's clip zeroes it."""
    cfg = dapo.Config(loss="cispo", **dapo.OBJECTIVES["cispo"]["preset"])
    assert cfg.eps_low == 1.0 and cfg.eps_high == 0.28
    logp = torch.tensor([[math.log(2.0), math.log(1.1)], [math.log(0.5), 0.0]], dtype=torch.float64,
                        requires_grad=True)
    old, mask = torch.zeros(2, 2, dtype=torch.float64), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, st = dapo.policy_loss(logp, old, adv, mask, cfg)                # the token mean, over 3 tokens
    loss.backward()
    assert loss.item() == pytest.approx(-(1.28 * math.log(2.0) + 1.1 * math.log(1.1) - 0.5 * math.log(0.5)) / 3)
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.28 / 3, -1.1 / 3], [0.5 / 3, 0.0]], dtype=torch.float64))
    dapo_grad = torch.autograd.grad(_loss(logp, old, adv, mask, eps_low=0.2)[0], logp)[0]
    assert dapo_grad[0, 0].item() == 0 and dapo_grad[1, 0].item() == 0    # DAPO's clip: no gradient there
    assert dapo_grad[0, 1].item() == pytest.approx(logp.grad[0, 1].item(), abs=1e-15)
    assert st["clip/high_frac"].item() == pytest.approx(1 / 3)            # where the weight is capped
    assert st["clip/low_frac"].item() == 0


def test_dr_grpo_divides_by_a_constant_and_keeps_the_mean_centred_advantage():
    """Dr. GRPO: A_i = R_i - mean (no std) and the loss divided by L_max x samples (here 8 x 4), whatever
    the lengths and even where overlong filtering masks a sample; each token's gradient is -A / 32."""
    cfg = dapo.Config(loss="dr_grpo", **dapo.OBJECTIVES["dr_grpo"]["preset"], max_response_len=8, group_size=4,
                      soft_overlong_punishment=False)   # the preset: --adv-estimator dr_grpo
    samples = [dict(s, score=r) for s, r in zip(_stubs([2, 3, 1, 4], truncated=(3,)), (1.0, -1.0, -1.0, -1.0))]
    dapo.shape_rewards(samples, cfg)
    dapo.set_advantages(samples, cfg)
    assert [s["adv"] for s in samples] == [1.5, -0.5, -0.5, -0.5]        # R - mean(R): 1, -1, -1, -1
    dapo.overlong_filtering(samples, cfg)
    norm = dapo.loss_normaliser(samples, cfg)
    assert norm == (False, 8 * 4) and [s["trained"] for s in samples] == [True, True, True, False]
    mask = (torch.arange(4) < torch.tensor([2, 3, 1, 4])[:, None]).double()
    mask[3] = 0.0                                                         # as policy_gradient masks it
    logp = torch.zeros(4, 4, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([s["adv"] for s in samples], dtype=torch.float64)
    loss, _ = dapo.policy_loss(logp, logp.detach(), adv, mask, cfg, norm)
    loss.backward()
    assert loss.item() == pytest.approx(-(1.5 * 2 - 0.5 * 3 - 0.5 * 1) / 32)
    torch.testing.assert_close(logp.grad, (-adv[:, None] / 32) * mask)


def test_sapo_gate_weighs_the_gradient_by_4_sigma_1_minus_sigma():
    """SAPO: the token loss -sigmoid(τ (r - 1)) 4/τ A, τ_pos = 1.0 where A > 0 and τ_neg = 1.05 elsewhere.
    Its gradient in log π is -w r A, the unclipped one times the gate weight w = 4 σ(1 - σ): exactly 1 at
    r = 1 (to float64 rounding) and decaying smoothly on both sides. clip/high_frac counts where w < 1/2."""
    cfg = dapo.Config(loss="sapo")
    ratios = torch.tensor([0.5, 0.8, 0.95, 1.0, 1.05, 1.25, 2.0, 3.0], dtype=torch.float64)
    for adv, tau in ((1.0, cfg.sapo_tau_pos), (-1.0, cfg.sapo_tau_neg)):
        logp = ratios.log()[None].clone().requires_grad_()
        loss, st = dapo.policy_loss(logp, torch.zeros_like(logp), torch.tensor([adv], dtype=torch.float64),
                                    torch.ones(1, 8), cfg, dapo.Normaliser(per_sample=False, n=1))
        loss.backward()
        weight = -logp.grad[0] / (ratios * adv)
        sig = torch.sigmoid(tau * (ratios - 1))
        assert loss.item() == pytest.approx(-(sig * 4 / tau * adv).sum().item(), rel=1e-12)
        torch.testing.assert_close(weight, 4 * sig * (1 - sig), rtol=1e-12, atol=0)
        assert weight[3].item() == pytest.approx(1.0, abs=1e-12)                     # r = 1: the plain gradient
        assert all(a < b for a, b in zip(weight[:3], weight[1:4]))                    # fading below r = 1
        assert all(a > b for a, b in zip(weight[3:-1], weight[4:])) and weight[-1] < 0.5   # and above
        assert st["clip/high_frac"].item() == pytest.approx(1 / 8) and st["clip/low_frac"].item() == 0


def test_dppo_keeps_the_policy_gradient_inside_a_probability_trust_region():
    """DPPO (--loss dppo_tv, dppo_kl, with verl's thresholds 0.15 and 0.05): the gradient of -sg(r) A log π,
    -A r per token, where the sampled token's probability moved within the bound on the side A pushes, and 0
    beyond it. π_θold = 0.5 for five tokens; π_θ = 0.6 (A +1), 0.7 (A +1), 0.7 (A -1), 0.3 (A -1), 0.3 (A +1).
    TV: |Δp| = 0.1 is inside; +0.2 with A > 0 and -0.2 with A < 0 are beyond, the other two move the way A
    does not push. KL: the binary KL of 0.5 -> 0.6 is 0.0204, inside 0.05; 0.5 -> 0.7 or 0.3 is 0.0872.
    Token-level normaliser: 5 tokens. As verl's compute_policy_loss_dppo_tv / _kl compute them."""
    p = torch.tensor([[0.6], [0.7], [0.7], [0.3], [0.3]], dtype=torch.float64)   # five one-token samples
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    old, mask = torch.full((5, 1), math.log(0.5), dtype=torch.float64), torch.ones(5, 1)
    assert 0.5 * math.log(0.5 / 0.7) + 0.5 * math.log(0.5 / 0.3) == pytest.approx(0.08718, abs=1e-5)
    assert 0.5 * math.log(0.5 / 0.6) + 0.5 * math.log(0.5 / 0.4) == pytest.approx(0.02041, abs=1e-5)
    r = (p / 0.5).flatten().tolist()
    for kind in ("dppo_tv", "dppo_kl"):
        cfg = dapo.Config(loss=kind, **dapo.OBJECTIVES[kind]["preset"])
        logp = torch.log(p).requires_grad_()
        loss, stats = dapo.policy_loss(logp, old, adv, mask, cfg)
        loss.backward()
        want = [-r[0] / 5, 0.0, r[2] / 5, 0.0, -r[4] / 5]   # -A r / 5 inside, 0 beyond
        assert logp.grad.flatten().tolist() == pytest.approx(want, abs=1e-12), kind
        assert stats["clip/high_frac"].item() == pytest.approx(1 / 5) and stats["clip/low_frac"].item() == pytest.approx(1 / 5)


def test_gmpo_takes_the_geometric_mean_of_log_space_clipped_ratios():
    """GMPO (--loss gmpo, ε 0.4 in log space): one sequence, log r = 0.1, 0.6, -0.5. With A = +1 the clip caps
    the rise (0.6 -> 0.4) and lets the fall through: mean(0.1, 0.4, -0.5) = 0, ratio 1, loss -1, and the
    gradient -1/3 on the two unclipped tokens, 0 on the clipped one. With A = -1 it floors the fall (-0.5 ->
    -0.4): mean(0.1, 0.6, -0.4) = 0.1, loss e^0.1. The per-sample normaliser makes it the sequence's loss, as
    verl's compute_policy_loss_geo_mean."""
    cfg = dapo.Config(loss="gmpo", **dapo.OBJECTIVES["gmpo"]["preset"])
    old, mask = torch.zeros(1, 3, dtype=torch.float64), torch.ones(1, 3)
    for a, want_loss, want_grad in ((1.0, -1.0, [-1 / 3, 0.0, -1 / 3]),
                                    (-1.0, math.exp(0.1), [math.exp(0.1) / 3, math.exp(0.1) / 3, 0.0])):
        logp = torch.tensor([[0.1, 0.6, -0.5]], dtype=torch.float64, requires_grad=True)
        norm = dapo.loss_normaliser([{"trained": True, "len": 3}], cfg)
        loss, stats = dapo.policy_loss(logp, old, torch.tensor([a], dtype=torch.float64), mask, cfg, norm)
        loss.backward()
        assert norm.per_sample and loss.item() == pytest.approx(want_loss, abs=1e-12)
        assert logp.grad[0].tolist() == pytest.approx(want_grad, abs=1e-12)
        assert (stats["clip/high_frac"] if a > 0 else stats["clip/low_frac"]).item() == pytest.approx(1 / 3)


def _cov_mini(adv, logps):
    """A mini-batch for covariance_picks: samples with A and π_θold's log-probs, every token trained."""
    return [{"adv": a, "old_logp": torch.tensor(lp, dtype=torch.float64), "trained": True, "response_ids": [0] * len(lp)}
            for a, lp in zip(adv, logps)]


def test_clip_cov_cuts_the_gradient_of_a_high_covariance_token_ppo_left_alone():
    """Clip-Cov (the authors' scripts: share 2e-4, bounds (1, 5), PPO's clip widened to [0, 2]): over the whole
    mini-batch, the covariance (A - mean A)(log π_θold - mean log π_θold) of each trained token; the gradient
    is cut on max(1, int(2e-4 n)) = 1 token drawn among those in (1, 5). Here exactly one token qualifies, (A - 0)
    (log π - 0) = 1 x 2 = 2, so it is the one cut; the others keep PPO's gradient (-A r / 4)."""
    cfg = dapo.parse_config(["--loss", "clip_cov"])
    assert (cfg.eps_low, cfg.eps_high, cfg.clip_cov_ratio, cfg.clip_cov_lb, cfg.clip_cov_ub) == (1.0, 1.0, 2e-4, 1.0, 5.0)
    mini = _cov_mini([1.0, -1.0], [[2.0, 0.0], [-1.0, -1.0]])   # mean A 0, mean log π 0: covariances 2, 0; 1, 1
    dapo.select_tokens(mini, [mini], cfg, (0, 0, 0))
    picked = torch.stack([s["picked"] for s in mini])
    assert picked.tolist() == [[1.0, 0.0], [0.0, 0.0]]
    logp = torch.tensor([[2.0, 0.0], [-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    adv, mask = torch.tensor([1.0, -1.0], dtype=torch.float64), torch.ones(2, 2)
    loss, stats = dapo.policy_loss(logp, logp.detach(), adv, mask, cfg, None, {"picked": picked})
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.25], [0.25, 0.25]], dtype=torch.float64))
    assert stats["cov/cut_frac"].item() == pytest.approx(1 / 4)


def test_kl_cov_penalises_the_top_covariance_token_with_the_absolute_log_ratio():
    """KL-Cov (the authors' scripts: coefficient 1; share 2e-4 at 32B): the unclipped -A r on every token, plus
    1 x |log r| on the max(1, int(2e-4 n)) = 1 token of the mini-batch's largest covariance. At r = e^0.5 on every
    token of [A = +1: log π_θold 2, 0; A = -1: log π_θold -1, -1] the top covariance is token (0, 0): its gradient
    is -(r - 1) / 4, the others' -A r / 4. No clip binds."""
    cfg = dapo.parse_config(["--loss", "kl_cov"])
    assert (cfg.kl_cov_ratio, cfg.kl_cov_coef) == (2e-4, 1.0)
    mini = _cov_mini([1.0, -1.0], [[2.0, 0.0], [-1.0, -1.0]])
    dapo.select_tokens(mini, [mini], cfg, (0, 0, 0))
    picked = torch.stack([s["picked"] for s in mini])
    assert picked.tolist() == [[1.0, 0.0], [0.0, 0.0]]
    old = torch.tensor([[2.0, 0.0], [-1.0, -1.0]], dtype=torch.float64)
    logp = (old + 0.5).requires_grad_()
    adv, mask, r = torch.tensor([1.0, -1.0], dtype=torch.float64), torch.ones(2, 2), math.exp(0.5)
    loss, stats = dapo.policy_loss(logp, old, adv, mask, cfg, None, {"picked": picked})
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-(r - 1) / 4, -r / 4], [r / 4, r / 4]], dtype=torch.float64))
    assert loss.item() == pytest.approx((-2 * r + 2 * r + 0.5) / 4)
    assert stats["cov/penalised_frac"].item() == pytest.approx(1 / 4) and stats["clip/high_frac"].item() == 0


def test_clip_cov_and_kl_cov_pick_their_share_of_the_whole_mini_batch_whatever_its_micro_batches():
    """Clip-Cov and KL-Cov choose their tokens once per mini-batch (select_tokens, from π_θold), not per
    micro-batch as verl's: 180 trained tokens at a share of 1/90 pick int(180 / 90) = 2 tokens, in one
    micro-batch or three (per micro-batch it would be 3 x max(1, int(60 / 90)) = 3), the same ones, and the
    draw repeats for the same key (a resume) and changes with the step. A sample masked by overlong filtering
    is never picked."""
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(12, generator=g).tolist()
    logps = [(torch.randn(15, generator=g) - 2).tolist() for _ in range(12)]
    for loss in ("kl_cov", "clip_cov"):
        cfg = dataclasses.replace(dapo.parse_config(["--loss", loss]), kl_cov_ratio=1 / 90, clip_cov_ratio=1 / 90,
                                  clip_cov_lb=-1e9, clip_cov_ub=1e9)
        picks = []
        for cut in (1, 3):
            mini = _cov_mini(adv, logps)
            mini.append({**mini[0], "trained": False})   # overlong-filtered: never picked, not counted
            micros = [mini[i::cut] for i in range(cut)]
            dapo.select_tokens(mini, micros, cfg, (0, 5, 1))
            picks.append(torch.stack([s["picked"] for s in mini]))
        assert picks[0].sum() == 2 and torch.equal(picks[0], picks[1]) and picks[0][-1].sum() == 0, loss
        mini = _cov_mini(adv, logps)
        dapo.select_tokens(mini, [mini], cfg, (0, 6, 1))   # another step: another draw (Clip-Cov's)
        if loss == "clip_cov":
            assert not torch.equal(torch.stack([s["picked"] for s in mini]), picks[0][:-1])


def test_maxrl_on_the_successes_never_gives_a_right_answer_a_negative_advantage():
    """--adv-estimator maxrl (prime-rl's rule): (s - p) / p on the successes as 0/1, 0 for a group with none.
    [right, wrong, wrong, wrong]: 3, -1, -1, -1 (prime-rl's own test); all wrong: 0; all right: 0. SkyRL's
    formula on Eq. 7's ±1 rewards would give the right answer (1 + 0.5) / (-0.5) = -3. Over random groups a
    right answer never gets a negative advantage, and set_advantages reads the successes, not the rewards."""
    s = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1])
    assert dapo.maxrl_advantages(s, 4).tolist() == [3.0, -1.0, -1.0, -1.0, 0, 0, 0, 0, 0, 0, 0, 0]
    g = torch.Generator().manual_seed(0)
    wins = (torch.rand(4000, generator=g) < 0.3).float()
    adv = dapo.maxrl_advantages(wins, 8)
    assert adv[wins == 1].min() >= 0 and adv[wins == 0].max() <= 0
    samples = [{"reward": r, "success": r > 0} for r in (1.0, -1.0, -1.2, -1.5)]
    dapo.set_advantages(samples, dapo.Config(group_size=4, adv_estimator="maxrl"))
    assert [x["adv"] for x in samples] == [3.0, -1.0, -1.0, -1.0]


def test_kl_penalty_adds_beta_times_k3_to_the_reference():
    """--kl-coef β: each trained token's loss gains β (π_ref/π_θ - log(π_ref/π_θ) - 1), the k3 estimator,
    whose gradient in log π_θ is β (1 - π_ref/π_θ); kl/ref is its mean over the trained tokens. With A = 0
    the policy term is 0, so the loss is the penalty alone."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.0, -1.5, -3.0]], dtype=torch.float64)
    mask, cfg = torch.tensor([[1.0, 1.0, 0.0]]), dapo.Config(kl_coef=0.1)
    loss, st = dapo.policy_loss(logp, logp.detach(), torch.zeros(1, dtype=torch.float64), mask, cfg, None,
                                {"ref_logp": ref})
    loss.backward()
    k3 = [math.exp(0.0) - 0.0 - 1, math.exp(0.5) - 0.5 - 1]                     # the padded token never counts
    assert loss.item() == pytest.approx(0.1 * sum(k3) / 2, rel=1e-12)
    assert st["kl/ref"].item() == pytest.approx(sum(k3) / 2, rel=1e-12)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.1 * (1 - math.exp(0.5)) / 2, 0.0]], dtype=torch.float64))
    _, plain = dapo.policy_loss(logp, logp.detach(), torch.zeros(1, dtype=torch.float64), mask, dapo.Config())
    assert "kl/ref" not in plain                                                 # 0: no reference at all


def test_tis_modes_truncate_or_mask_per_token_or_per_sequence():
    """The four rollout-correction modes on one batch, bounds [0.8, 2.0] (TRL's semantics). Token ratios
    exp(old - rollout): e^0.5, e^-0.3, e^1.0 (sequence 0); e^0.2, e^0.2 (sequence 1, then padding). A
    sequence's ratio is their product, as a sum of logs: e^1.2 and e^0.4. *_truncate clamps to the
    bounds, *_mask zeroes what lies outside; the stats count truncated or masked tokens and sequences.
    Then --tis-cap alone (token_truncate, no floor): exact log-probs leave the loss as it is, and the
    weights scale each token's loss."""
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    old = torch.zeros(2, 3)
    rollout = -torch.tensor([[0.5, -0.3, 1.0], [0.2, 0.2, 7.0]])   # old - rollout; 7.0 is padding
    e = math.exp
    want = {"token_truncate": [[e(0.5), 0.8, 2.0], [e(0.2), e(0.2), 1.0]],
            "token_mask": [[e(0.5), 0.0, 0.0], [e(0.2), e(0.2), 1.0]],
            "sequence_truncate": [[2.0], [e(0.4)]], "sequence_mask": [[0.0], [e(0.4)]]}
    for mode, w_hand in want.items():
        w, st = dapo.tis_weights(old, rollout, mask, cap=2.0, mode=mode, lower=0.8)
        torch.testing.assert_close(w, torch.tensor(w_hand), rtol=1e-6, atol=1e-6)
        assert st["tis/clipped_frac"].item() == pytest.approx(2 / 5 if mode.startswith("token") else 3 / 5)
        assert st["tis/clipped_seq_frac"].item() == pytest.approx(1 / 2)
    # token_truncate with no lower bound is the plain truncated IS: min(exp(old - rollout), C), bit for bit
    w, st = dapo.tis_weights(old, rollout, mask, cap=2.0)
    assert torch.equal(w, torch.exp(torch.where(mask.bool(), old - rollout, 0.0)).clamp(max=2.0))
    assert st["tis/weight_mean"].item() == pytest.approx((e(0.5) + e(-0.3) + 2.0 + 2 * e(0.2)) / 5)
    # exact log-probs give weights 1 and the unchanged loss; otherwise the loss is scaled token by token
    logp, adv = torch.tensor([[0.1, 0.0, -0.1], [0.05, -0.05, 0.0]]), torch.tensor([1.0, 1.0])
    assert torch.equal(dapo.tis_weights(old, old.clone(), mask, cap=2.0)[0], torch.ones(2, 3))
    plain, _ = _loss(logp, old, adv, mask)
    assert _loss(logp, old, adv, mask, tis_weight=torch.ones(2, 3))[0].item() == plain.item()
    ratio = torch.exp(logp - old)                            # 1.105, 1, 0.905; 1.05, 0.95: none clipped (A > 0)
    hand = -(ratio * w * mask).sum().item() / 5
    assert _loss(logp, old, adv, mask, tis_weight=w)[0].item() == pytest.approx(hand, rel=1e-6)


def test_off_policy_mask_drops_negative_sequences_far_from_the_rollout_policy():
    """DeepSeek-V3.2's mask at δ = 0.1: the mean over a sequence's tokens of log π_rollout - log π_θ is 0.2
    (sequence 0, A < 0: dropped), 0.2 (sequence 1, A > 0: kept), 0.05 (sequence 2, A < 0: under δ, kept);
    padding never enters the mean. Through policy_loss the dropped sequence gets no gradient."""
    logp = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -1.0, 0.0], [-1.0, -1.0, 9.0]], requires_grad=True)
    rollout = torch.tensor([[-0.9, -0.7, 0.0], [-0.7, -0.9, 0.0], [-0.9, -1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([-1.0, 1.0, -1.0])
    keep, st = dapo.off_policy_keep(logp, rollout, adv[:, None], mask, 0.1)
    assert keep[:, 0].tolist() == [0.0, 1.0, 1.0] and st["offpolicy/dropped_seq_frac"].item() == pytest.approx(1 / 3)
    loss, _ = dapo.policy_loss(logp, logp.detach(), adv, mask, dapo.Config(), None, {"weight": keep})
    loss.backward()
    assert logp.grad[0].abs().max() == 0 and logp.grad[1:, :2].abs().min() > 0


def test_top_entropy_quantile_keeps_every_token_in_the_denominator():
    """Beyond the 80/20 rule at ρ = 0.4: the threshold is the 0.6 quantile of the mini-batch's entropies
    (linear interpolation: 0.5 + 0.4 (0.7 - 0.5) = 0.58), so 0.7 and 0.9 carry the loss. Eq. 12's
    denominator still counts all 5 tokens, as in the paper and TRL: a selected token's gradient is what
    DAPO would give it (the selection removes terms, it does not rescale the rest)."""
    ent = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.7, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    floor = dapo.entropy_threshold(ent[mask.bool()], 0.4)
    assert floor == pytest.approx(0.58)
    chosen = (ent >= floor).float()
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    adv, norm = torch.tensor([1.0, -1.0]), dapo.Normaliser(per_sample=False, n=5)
    full = torch.autograd.grad(dapo.policy_loss(logp, logp.detach(), adv, mask, dapo.Config(), norm)[0], logp)[0]
    sel = torch.autograd.grad(dapo.policy_loss(logp, logp.detach(), adv, mask, dapo.Config(), norm,
                                               {"select": chosen})[0], logp)[0]
    torch.testing.assert_close(sel, full * chosen)
    assert (sel != 0).sum() == 2 and full[0, 2].item() == pytest.approx(-1 / 5)


def test_lora_gradient_2_ranks_x_2_micro_batches_equals_1_process(tiny_model, tmp_path):
    """--lora-rank 1: for every --loss and knob, only the adapters (B A of every linear layer of the decoder) have a
    gradient, and 2 ranks x 2 micro-batches give the 1-process gradient within GRAD_RTOL, as without LoRA (rank 1
    of 2 holds an empty shard of each A)."""
    (v1, _), (v2, _) = (_grads(tiny_model, tmp_path, 8, 0, 0, 0, 1, 0, 1),
                        _grads(tiny_model, tmp_path, 2, 0, 0, 0, 1, 0, 1, nproc=2))
    assert list(v1) == list(v2) == list(dapo.OBJECTIVES) + list(KNOBS)
    layers = [f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "self_attn.k_proj",
              "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    for loss in v1:
        assert sorted(v1[loss]) == sorted(f"{x}.lora_{ab}" for x in layers for ab in "AB") == sorted(v2[loss])
        worst, scale = _relative_gap(v1[loss], v2[loss])
        print(f"LoRA, {loss}: max |grad(2 ranks x 2 micro) - grad(1 x 1)| = {worst:.1e} of the largest entry {scale:.2e}")
        assert scale > 1e-4 and (dapo.OBJECTIVES.get(loss, {}).get("per_micro_batch") or worst < GRAD_RTOL)


def test_carry_surplus_runs_the_demo_on_past_the_step_its_surplus_would_fill_a_batch(tmp_path):
    """python dapo.py --carry-surplus on the demo: 96 prompts a generation batch for N = 64, at a keep rate of
    ~0.8-0.9, so that one batch gives more than N groups and the surplus grows each step (uncapped, it reaches N
    by step 4, and a step with N carried groups generated nothing). For 5 steps every step draws a generation
    batch, filter/carried (the number carried) never exceeds N // 2, the cap binds, and what did not fit is
    counted."""
    out = _run([sys.executable, "dapo.py", "--carry-surplus", "--steps", "5", "--eval-samples", "0", "--out-dir",
                str(tmp_path)], timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    carried, dropped = [r["filter/carried"] for r in rows], [r["filter/surplus_dropped"] for r in rows]
    print(f"kept_frac {[round(r['filter/kept_frac'], 2) for r in rows]}; carried {carried}; dropped {dropped}")
    assert len(rows) == 5 and all(r["filter/gen_batches"] >= 1 for r in rows)
    assert carried[0] == 0 and max(carried) == dapo.DEMO["prompts_per_step"] // 2 and sum(dropped) > 0


def test_lora_kl_reference_is_the_base_model_computed_by_hand(tiny_model):
    """--kl-coef under --lora-rank: the reference old_logprobs computes (the policy with its adapters off, no
    second model) equals the base model's log-probs computed alone, on one batch, while the adapted policy's
    differ: a reference that kept its adapters on (or was the policy) would fail here, where kl/ref >= 0 holds
    for any reference (k3 is never negative)."""
    out = _run([sys.executable, "tests/test_after_dapo.py", "lora_reference", tiny_model], timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    gaps = json.loads(re.search(r"^gaps (.*)$", out.stdout, re.M).group(1))
    print(gaps)
    assert gaps["ref_vs_base"] < 1e-5 and gaps["policy_vs_base"] > 1e-2


def test_lora_trains_the_adapters_alone_resumes_bit_exact_and_exports_merged_weights(tmp_path):
    """--lora-rank 4 --lora-alpha 8 on the demo, 3 steps, with --kl-coef (its reference: the policy with its
    adapters off, no second model). The base weights stay exactly as loaded and the adapters move; the sync of
    the merged weights is exact (fp32 noise); a run resumed from step 2 ends with the straight run's step-3
    weights and metrics, bit for bit; a changed rank is refused in one line; the Hugging Face export holds
    W + (α / r) B A in fp32 (the default under LoRA), with no adapter tensor, loads in transformers and generates."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    lora = ["--lora-rank", "4", "--lora-alpha", "8", "--kl-coef", "0.05", "--save-every", "1"]
    a, b = tmp_path / "a", tmp_path / "b"
    out = _dapo(*lora, "--steps", "3", "--eval-samples", "0", "--out-dir", str(a))
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(x) for x in open(a / "metrics.jsonl")]
    assert all(r["sync/logp_diff_max"] < 1e-4 and r["kl/ref"] >= 0 for r in rows), rows
    base = load_file(a / "base_model" / "model.safetensors")
    final = _dcp_model(a / "checkpoints" / "step_000003")
    assert all(torch.equal(base[k], final[k]) for k in base)                  # the base: frozen
    adapters = {k: v for k, v in final.items() if ".lora_" in k}
    assert len(adapters) == 2 * 7 * 2 and max(v.abs().max().item() for k, v in adapters.items() if k.endswith("B")) > 0
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints" / "step_000003")
    out = _dapo(*lora, "--steps", "3", "--eval-samples", "0", "--resume", "--out-dir", str(b))
    assert out.returncode == 0 and "resumed from" in out.stdout, out.stderr[-4000:]
    resumed = _dcp_model(b / "checkpoints" / "step_000003")
    assert all(torch.equal(final[k], resumed[k]) for k in final)
    timing = lambda k: k.startswith(("time/", "mem/")) or k == "tokens/s"   # noqa: E731
    same = lambda r: {k: v for k, v in r.items() if not timing(k)}   # noqa: E731
    assert [same(r) for r in rows] == [same(json.loads(x)) for x in open(b / "metrics.jsonl")]
    out = _dapo(*lora[:1], "8", *lora[2:], "--steps", "4", "--resume", "--out-dir", str(b))
    assert out.returncode == 2 and re.search(r"^error: cannot resume: .*--lora-rank 4 -> 8", out.stderr, re.M), out.stderr
    export = a / "checkpoints" / "step_000003" / "model"
    assert json.load(open(export / "config.json"))["dtype"] == "float32"   # LoRA's default: nothing rounded away
    merged = {k: v for f in export.glob("*.safetensors") for k, v in load_file(f).items()}
    assert not any(".lora_" in k for k in merged) and merged.keys() == base.keys()
    for k in base:
        p = k[:-len("weight")]
        want = base[k] + 8 / 4 * final[p + "lora_B"] @ final[p + "lora_A"] if p + "lora_A" in final else base[k]
        torch.testing.assert_close(merged[k], want, rtol=0, atol=1e-6)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    ids = torch.tensor([[20, 5, 6, 13, 7, 8, 15]])
    assert model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False).shape == (1, 11)


def test_a_stateful_objective_gets_its_state_and_the_step_as_arguments_and_end_of_step_updates_it():
    """The README's stateful example (Forking), run as written: loss_terms hands a --loss whose OBJECTIVES entry has
    "state" its state and the step (run.state["objective"], run.step), policy_loss passes them to its token loss, and
    end_of_step updates the state in place from the step's metrics. For any other --loss end_of_step does nothing
    and loss_terms adds nothing at DAPO's defaults."""
    code = re.search(r"```python\n(.*?)```", open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read(),
                     re.S).group(1)
    table = dict(dapo.OBJECTIVES)
    exec(code, {"torch": torch, "OBJECTIVES": table})
    seen = []
    loss_fn = table["adaptive"]["token_loss"]
    table["adaptive"] = dict(table["adaptive"], token_loss=lambda t, cfg, state, step: seen.append(
        (dict(state), step)) or loss_fn(t, cfg, state, step))
    cfg = dapo.Config(loss="adaptive")
    run = types.SimpleNamespace(cfg=cfg, state={"objective": table["adaptive"]["state"](cfg)}, step=3)
    logp = torch.tensor([[0.0, 0.1], [0.0, -0.1]], dtype=torch.float64, requires_grad=True)
    mask, adv = torch.ones(2, 2), torch.tensor([1.0, -1.0], dtype=torch.float64)
    import unittest.mock
    with unittest.mock.patch.dict(dapo.OBJECTIVES, table):
        more = dapo.loss_terms([], logp, logp.detach(), adv, mask, run)
        assert more["objective"] == (run.state["objective"], 3)
        _, stats = dapo.policy_loss(logp, logp.detach(), adv, mask, cfg, None, more)
        assert seen == [({"eps_high": 0.28}, 3)] and stats["adaptive/up_frac"].item() == 0.5
        dapo.end_of_step(run, {"adaptive/up_frac": 0.25})                   # fewer than half push up: ε_high rises
        assert run.state["objective"] == {"eps_high": pytest.approx(0.30)}
    plain = types.SimpleNamespace(cfg=dapo.Config(), state={}, step=3)
    dapo.end_of_step(plain, {})
    assert plain.state == {} and dapo.loss_terms([], logp, logp.detach(), adv, mask, plain) is None

# A stateful objective of the tests' own, in the spirit of BAPO's adaptive clip (arXiv 2510.18927): where fewer than
# half of the last step's trained tokens have A > 0, ε_high rises and ε_low falls, so that the tokens pushed up weigh
# more, and the other way round. Its state lives where Part 2 keeps one (run.state["objective"]) and reaches the
# token loss as an argument, with the step.
def _adaptive_state(cfg):
    return {"eps_low": cfg.eps_low, "eps_high": cfg.eps_high, "step": 0}


def _adaptive_token_loss(t, cfg, state, step):
    low, high = state["eps_low"], state["eps_high"]
    loss = -torch.min(t.ratio * t.adv, torch.clamp(t.ratio, 1 - low, 1 + high) * t.adv)
    n = t.mask.sum().clamp(min=1)
    stats = {"adaptive/pos_frac": ((t.adv > 0) * t.mask).sum() / n,
             "adaptive/lag": (step - state["step"]) * t.mask.sum() / n}   # 1: the state is the step before's
    return loss, (t.ratio < 1 - low) & (t.adv < 0), (t.ratio > 1 + high) & (t.adv > 0), stats


def _adaptive_end_of_step(state, metrics, step, cfg):
    gap = 0.5 - metrics["adaptive/pos_frac"]   # > 0: too few tokens pushed up
    state.update(eps_low=min(max(state["eps_low"] - 0.2 * gap, 0.01), 0.99),
                 eps_high=max(state["eps_high"] + 0.2 * gap, 0.01), step=step)
    metrics.update({"adaptive/eps_low": state["eps_low"], "adaptive/eps_high": state["eps_high"]})


ADAPTIVE = dict(token_loss=_adaptive_token_loss, state=_adaptive_state, end_of_step=_adaptive_end_of_step)
# Small: 4 prompts x 8 responses, 2 mini-batches, no evaluation; 2 steps, resumed after the first
RESUME_ARGS = ["--demo-sft-target", "0.1", "--prompts-per-step", "4", "--gen-batch-size", "8", "--num-mini-batches",
               "2", "--micro-batch-size", "16", "--warmup-steps", "1", "--lr", "5e-4", "--eval-samples", "0",
               "--steps", "2", "--save-every", "1"]


def test_every_objective_resumes_bit_for_bit_and_a_stateful_one_on_2_ranks_too(tmp_path):
    """2 steps straight against 1 step, a resume and 1 more, bit for bit (the fp32 weights, every metric but the
    timings, the objective's state): every OBJECTIVES entry on one process, and a stateful objective of the tests'
    own (ADAPTIVE: its ε_high moves each step, from the step's statistics summed over the ranks) on one process and
    on 2 ranks. Each resume starts from the straight run's first checkpoint, the later one removed, through
    dapo.train and --resume; one process (or torchrun) runs every objective, with one vLLM engine. ADAPTIVE's
    state matters: resumed without it (removed from state.json), the run differs."""
    losses = list(dapo.OBJECTIVES) + ["adaptive"]
    one = _run([sys.executable, "tests/test_after_dapo.py", "resume", str(tmp_path / "one"), *losses], timeout=900)
    assert one.returncode == 0, one.stderr[-4000:]
    two = _torchrun(2, "tests/test_after_dapo.py", "resume", str(tmp_path / "two"), "adaptive", timeout=900)
    assert two.returncode == 0, two.stderr[-4000:]
    timing = lambda k: k.startswith(("time/", "mem/")) or k == "tokens/s"   # noqa: E731
    for ranks, loss in [("one", x) for x in losses] + [("two", "adaptive")]:
        runs = {how: tmp_path / ranks / loss / how for how in ("straight", "resumed", "lost")}
        weights = {how: _dcp_model(d / "checkpoints" / "step_000002") for how, d in runs.items() if d.exists()}
        rows = {how: [{k: v for k, v in json.loads(x).items() if not timing(k)} for x in open(d / "metrics.jsonl")]
                for how, d in runs.items() if d.exists()}
        final = {how: json.load(open(d / "checkpoints" / "step_000002" / "state.json")).get("objective")
                 for how, d in runs.items() if d.exists()}
        assert [r["step"] for r in rows["resumed"]] == [1, 2], (ranks, loss)
        assert all(torch.equal(weights["straight"][k], weights["resumed"][k]) for k in weights["straight"]), (ranks, loss)
        assert rows["straight"] == rows["resumed"] and final["straight"] == final["resumed"], (ranks, loss)
        if loss == "adaptive":
            eps = [(r["adaptive/eps_low"], r["adaptive/eps_high"]) for r in rows["straight"]]
            print(f"{'1 process' if ranks == 'one' else '2 ranks'}: (ε_low, ε_high) after each step {eps}, "
                  f"state {final['straight']}")
            assert [r["adaptive/lag"] for r in rows["straight"]] == [1.0, 1.0] and final["straight"]["step"] == 2
            assert eps[0][1] > dapo.Config().eps_high and eps[1][1] > eps[0][1]   # few tokens push up: it rises
            assert rows["lost"][1]["adaptive/lag"] == 2.0   # restarted from its start: the step before is lost
            assert any(not torch.equal(weights["straight"][k], weights["lost"][k]) for k in weights["straight"])


# -----------------------------------------------------------------------------------------
# Helpers

def _lora_reference_worker(model_dir):
    """--kl-coef under --lora-rank, on one batch: old_logprobs' reference (the policy with its adapters off)
    against the base model loaded alone, and the adapted policy's own log-probs against both."""
    device = dapo.init_distributed()
    cfg = dapo.Config(lora_rank=2, lora_alpha=4.0, kl_coef=0.1, micro_batch_size=4, num_mini_batches=1)
    model = dapo.load_policy(cfg, model_dir, device)
    with torch.no_grad():   # B random: the adapted policy is not the base
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.to_local().normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    samples = _update_samples()
    for s in samples:
        s["trained"] = True
    run = types.SimpleNamespace(cfg=cfg, model=model, ref=model, pad_id=0, device=device, share=True)
    _, plan = dapo.micro_batches(samples, cfg, True)
    dapo.old_logprobs(run, plan)
    base = dapo.load_policy(dataclasses.replace(cfg, lora_rank=0, kl_coef=0.0), model_dir, device)
    gaps = {"ref_vs_base": 0.0, "policy_vs_base": 0.0}
    with torch.no_grad():
        for mb in plan[0]:
            batch = dapo.collate(mb, 0, device)
            by_hand = base.forward_logprobs(batch, 1.0, 1024)[0]
            policy = model.forward_logprobs(batch, 1.0, 1024)[0]
            for s, h, p in zip(mb, by_hand, policy):
                n = len(s["response_ids"])
                gaps["ref_vs_base"] = max(gaps["ref_vs_base"], (s["ref_logp"] - h[:n]).abs().max().item())
                gaps["policy_vs_base"] = max(gaps["policy_vs_base"], (p[:n] - h[:n]).abs().max().item())
    print("gaps", json.dumps(gaps))
    torch.distributed.destroy_process_group()


def _resume_worker(out_dir, *losses):
    """For each --loss (ADAPTIVE as "adaptive"): RESUME_ARGS straight into out_dir/<loss>/straight, then a copy
    of it without its last checkpoint resumed into out_dir/<loss>/resumed (for ADAPTIVE also one whose state.json
    lost the objective's state, into .../lost), every run through dapo.train in this process (or each rank's), on
    the engine the first one starts."""
    dapo.OBJECTIVES["adaptive"] = ADAPTIVE
    dapo.init_distributed()
    start, engines = dapo.start_engine, []
    dapo.start_engine = lambda *a, **k: engines[0] if engines else engines.append(start(*a, **k)) or engines[0]
    for loss in losses:
        root = os.path.join(out_dir, loss)
        dapo.train(dapo.parse_config(RESUME_ARGS + ["--loss", loss, "--out-dir", os.path.join(root, "straight")]))
        for how in ("resumed", "lost") if loss == "adaptive" else ("resumed",):
            if dapo.rank() == 0:
                shutil.copytree(os.path.join(root, "straight"), os.path.join(root, how))
                shutil.rmtree(os.path.join(root, how, "checkpoints", "step_000002"))
                if how == "lost":
                    path = os.path.join(root, how, "checkpoints", "step_000001", "state.json")
                    state = json.load(open(path))
                    del state["objective"]
                    json.dump(state, open(path, "w"))
            torch.distributed.barrier()
            dapo.train(dapo.parse_config(RESUME_ARGS + ["--loss", loss, "--out-dir", os.path.join(root, how),
                                                        "--resume"]))
    dapo._shut_down(exiting=True)


if __name__ == "__main__":  # the helper processes the tests above start
    if sys.argv[1] == "lora_reference":
        _lora_reference_worker(sys.argv[2])
    elif sys.argv[1] == "resume":
        _resume_worker(*sys.argv[2:])
    # results written: skip the interpreter's teardown, where a rank that has destroyed its process group
    # can abort while the other still tears down
    interrupt.kill_children()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
