"""What several test files share: running dapo.py and helper processes, the loss and sample stand-ins, and the
gradient worker (`python tests/shared.py grad ...`) that the exactness and LoRA tests both start."""
import atexit
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout: dapo.py, reward.py, lib/
sys.path[:0] = [HERE, os.path.join(HERE, "tools")]
import torch  # noqa: E402

import dapo  # noqa: E402
from lib import interrupt  # noqa: E402

# The cache of built models (lib/demo_model.py's warm-starts, tools/real_model.py's ~0.5 GB model): one per
# test session, built by the first test that needs a given model and copied by the others; the processes the
# tests start inherit it, and the test session removes it at its end.
if "DAPO_CACHE" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="dapo-test-")
    os.environ["DAPO_CACHE"] = os.path.join(_CACHE, "cache")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)


# The post-DAPO knobs that the gradient test runs beside every --loss (on DAPO's objective)
KNOBS = {"kl_coef": dict(kl_coef=0.1), "tis_token_truncate": dict(tis_cap=1.2),
         "tis_sequence_mask": dict(tis_cap=2.0, tis_min=0.5, tis_mode="sequence_mask"),
         "off_policy_mask": dict(off_policy_mask=0.01), "top_entropy_quantile": dict(top_entropy_quantile=0.3)}


# Two fp32 computations of one gradient that differ only in the order of their sums (micro-batches, ranks,
# packing, recomputation) agree to a few ulps of the largest entry (fp32's epsilon is 1.2e-7); a wrong
# normaliser, a missing micro-batch or attention across sequences moves it by 1e-2 or more of it.
GRAD_RTOL = 1e-5


# The gradients the CPU tests compare, by ranks: _grads computes a model's whole list in one launch
GRAD_RUNS = {1: [(8, 0, 0, 0, 1), (8,), (4, 0, 1), (8, 0, 0, 1), (8, 0, 0, 0, 1, 0, 1), (8, 0, 0, 0, 1, 0, 0, 1),
                 (8, 0, 0, 0, 1, 0, 1, 1), (8, 0, 0, 0, 0, 0, 0, 2)],
             2: [(2, 0, 0, 0, 1), (8, 28, 0), (8, 28, 0, 0, 0, 1), (2, 0, 0, 0, 1, 0, 1), (8, 28, 0, 0, 0, 0, 0, 2)]}


_GRADS = {}  # (model, _gradient's arguments, ranks) -> (gradients, stdout): tests that need the same run share it


E2E_ARGS = ["--demo-sft-target", "0.1", "--prompts-per-step", "16", "--gen-batch-size", "24",
            "--num-mini-batches", "2", "--micro-batch-size", "16", "--eval-samples", "2",
            "--eval-max-prompts", "32", "--warmup-steps", "1", "--lr", "5e-4"]


def _run(cmd, timeout=600, env=None):
    """subprocess.run(cmd) from the checkout, output captured as text, in a process session of its own. On a
    timeout the whole process tree is killed (torchrun's ranks live in process sessions of their own and would
    outlive the launcher, holding both cores) and the test fails."""
    p = subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, env=env)
    try:
        out, err = p.communicate(timeout=timeout)
    except BaseException:
        interrupt.kill_children(p.pid)
        p.kill()
        p.communicate()
        raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def _loss(logp, old, adv, mask, token_level=True, num_tokens=None, num_samples=None, tis_weight=None, **cfg):
    """policy_loss, normalised by this batch's token count (per sample: its sample count) unless the
    whole mini-batch's is given; **cfg: Config fields (eps_high, dual_clip, ...)."""
    if token_level:
        n = mask.sum() if num_tokens is None else num_tokens
    else:
        n = mask.shape[0] if num_samples is None else num_samples
    more = None if tis_weight is None else {"weight": tis_weight}
    return dapo.policy_loss(logp, old, adv, mask, dapo.Config(**cfg), dapo.Normaliser(not token_level, n), more)


def _loss_at(ratio, adv, **kw):
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=torch.float64)
    loss, stats = _loss(logp, old, torch.tensor([adv], dtype=torch.float64), torch.ones(1, 1), **kw)
    loss.backward()
    return loss.item(), logp.grad.item(), stats


def _stubs(lengths, truncated=()):
    return [{"len": n, "truncated": i in truncated} for i, n in enumerate(lengths)]


def _toy_samples():
    """Three samples with EOS (id 1) at the end of each response, of 3, 2 and 4 tokens; the third truncated."""
    return [{"prompt_ids": [5, 6, 7], "response_ids": [8, 9, 1], "truncated": False},
            {"prompt_ids": [5], "response_ids": [8, 1], "truncated": False},
            {"prompt_ids": [5, 6], "response_ids": [8, 9, 9, 9], "truncated": True}]


def _stub_sample_fn(G, uniform=lambda i: i % 3 != 2):
    """Groups whose correctness is decided by the prompt index: `uniform(i)` groups are all
    correct (i % 3 == 0) or all wrong (i % 3 == 1); the others are half right."""
    calls = []

    def fn(idx, b):
        calls.append(list(idx))
        groups = []
        for i in idx:
            if uniform(i):
                flags = [i % 3 == 0] * G
            else:
                flags = [k < G // 2 for k in range(G)]
            groups.append([{"row": i, "score": 1.0 if c else -1.0, "success": c, "response_ids": [1],
                            "truncated": False} for c in flags])
        return groups, {"time/rollout": 0.0}
    return fn, calls


def _grad_worker(model_dir, out_dir, *runs):
    """Run under torchrun (or alone): for each run (its _gradient arguments, as "8 28 0"), the gradient
    to out_dir/<i>.pt, its stdout after a line "== run <i>". One process serves several runs: each start
    costs more than a run."""
    device = dapo.init_distributed()
    for i, run in enumerate(runs):
        if dapo.rank() == 0:
            print(f"== run {i}", flush=True)
        saved = dapo.collate, dapo.forward_logprobs, dapo.packs_one_row
        try:
            grads = _gradient(model_dir, device, *map(int, run.split()))
        finally:
            dapo.collate, dapo.forward_logprobs, dapo.packs_one_row = saved
        if dapo.rank() == 0:
            torch.save(grads, os.path.join(out_dir, f"{i}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _gradient(model_dir, device, micro_batch_size, micro_batch_tokens=0, grad_checkpointing=0, padded=0,
              variants=0, one_row=0, lora=0, plain=0):
    """The gradient of one mini-batch through FSDP2, of every parameter that has one: 3 groups sharing prompts
    of 3, 6 and 2 tokens (3, 3 and 2 responses), each forwarded once (--shared-prefix).
    plain=1: a copy of the prompt per response (--no-shared-prefix), the reference for shared prompts; plain=2:
    neither flag, the CPU's default: sdpa's rule decides in each micro-batch (sharing, with its timed beta).
    padded=1: through the padded layout of _padded_collate (the reference for packed rows; no sharing).
    variants=1: {name: gradient} for every --loss variant, each with its preset, then each of KNOBS
    (vLLM's log-probs, the reference's and π_θold's entropies are made up, a little off π_θold).
    one_row=1: every sequence of a micro-batch in one row, the layout flex/flash attention get on GPU.
    lora=1: --lora-rank 1 --lora-alpha 1, its B random (B = 0 would give A no gradient); on 2 ranks each A
    (1 x in) is one rank's whole and the other's empty shard."""
    import random
    if padded:
        dapo.collate, dapo.forward_logprobs = _padded_collate, _padded_forward_logprobs
    if one_row:
        dapo.packs_one_row = lambda cfg: True
    layouts, collate = set(), dapo.collate

    def recording(mb, *a, **k):   # what layout each micro-batch ran in: the test checks the swap took effect
        batch = collate(mb, *a, **k)
        if sum(not s.get("dummy") for s in mb) > 1:   # one sequence is one row in every layout
            layouts.add(("padded" if "attention_mask" in batch else "one row" if len(batch["input_ids"]) == 1
                         else "packed rows") + (", shared" if "segment" in batch else ""))
        return batch
    dapo.collate = recording
    cfg = dapo.Config(micro_batch_size=micro_batch_size, num_mini_batches=1, logprob_chunk=3, max_response_len=16,
                      overlong_filtering=True, micro_batch_tokens=micro_batch_tokens,
                      grad_checkpointing=bool(grad_checkpointing), lora_rank=1 if lora else 0, lora_alpha=1.0,
                      shared_prefix={0: True, 1: False, 2: None}[plain])
    torch.manual_seed(0)
    model = dapo.load_policy(cfg, model_dir, device)
    print("use_cache", model.config.use_cache)
    if lora:
        from torch.distributed.tensor import distribute_tensor
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("lora_B"):   # the same full tensor on every rank, each keeping its shard
                    full = torch.randn(p.shape, generator=g) * 0.1
                    p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
    rng = random.Random(0)
    samples = []
    for g, (n, prompt_len) in enumerate(((3, 3), (3, 6), (2, 2))):   # one truncated sample
        prompt = [rng.randrange(3, 20) for _ in range(prompt_len)]
        for k in range(n):   # group 0's first two responses long, the rest short
            i, long = len(samples), g == 0 and k < 2
            resp = [rng.randrange(3, 20) for _ in range(rng.randint(8, 14) if long else rng.randint(1, 3))] + [1]
            samples.append({"row": g, "prompt_ids": prompt, "response_ids": resp, "len": len(resp),
                            "truncated": i == 5, "adv": rng.gauss(0, 1)})
    for s in samples:   # an "old" policy a little off the current one, so clipping happens
        s["old_logp"] = torch.tensor([rng.gauss(-3.0, 0.5) for _ in s["response_ids"]])
    extra = random.Random(1)
    for s in samples:   # what the knobs read: vLLM's log-probs, the reference's, π_θold's entropies
        s["vllm_logp"] = [x + extra.gauss(0, 0.3) for x in s["old_logp"].tolist()]
        s["ref_logp"] = s["old_logp"] + torch.tensor([extra.gauss(0, 0.5) for _ in s["response_ids"]])
        s["old_entropy"] = torch.tensor([extra.uniform(0, 2) for _ in s["response_ids"]])
    dapo.overlong_filtering(samples, cfg)
    minis, plan = dapo.micro_batches(samples, cfg, dapo.sharing(cfg, model.config))
    if not micro_batch_tokens:
        assert len(plan[0]) == 8 // dapo.world() // micro_batch_size
    groups = dapo.all_gather_objects([[s["row"] for s in mb if not s.get("dummy")] for mb in plan[0]])[0]
    if dapo.rank() == 0:   # one line each: the ranks' own prints could interleave in the shared pipe
        print("micro-batches per rank", json.dumps({str(r): [len(mb) for mb in c] for r, c in enumerate(groups)}))
        print("groups per micro-batch", json.dumps({str(r): c for r, c in enumerate(groups)}), flush=True)
    out = {}
    runs = {loss: dict(loss=loss, **dapo.OBJECTIVES[loss].get("preset", {})) for loss in dapo.OBJECTIVES}
    for name, knob in {**runs, **KNOBS}.items() if variants else [(cfg.loss, {})]:
        c = dataclasses.replace(cfg, **knob)
        model.zero_grad(set_to_none=True)
        minis, plan = dapo.micro_batches(samples, c, dapo.sharing(c, model.config))
        dapo.select_tokens(minis[0], plan[0], c, (0, 0, 0))   # over the whole mini-batch, every rank's tokens
        dapo.policy_gradient(_pg_run(model, c, device), minis[0], plan[0])
        out[name] = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                     for n, p in model.named_parameters() if p.grad is not None}
    seen = dapo.all_gather_objects(sorted(layouts))[0]
    if dapo.rank() == 0:
        print("layouts", json.dumps(sorted({x for part in seen for x in part})), flush=True)
    return out if variants else out[cfg.loss]


def _torchrun(nproc, *args, timeout=600, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    return _run(cmd, timeout, env)


def _relative_gap(a, b):
    """(the largest |a - b| over all entries, divided by the largest |a| entry; that entry)."""
    scale = max(a[k].abs().max().item() for k in a)
    return max((a[k] - b[k]).abs().max().item() for k in a) / scale, scale


def _grads(model_dir, out_dir, *args, nproc=1, alone=False):
    """_gradient(*args) of model_dir on nproc ranks, and its stdout. The first call also runs the rest of
    GRAD_RUNS[nproc] (unless alone), in the same process (or torchrun), writing into out_dir."""
    key = (model_dir, args, nproc)
    if key not in _GRADS:
        todo = [] if alone else [a for a in GRAD_RUNS.get(nproc, []) if (model_dir, a, nproc) not in _GRADS]
        runs = [args] + [a for a in todo if a != args]
        words = [" ".join(map(str, a)) for a in runs]
        if nproc == 1:
            r = _run([sys.executable, "tests/shared.py", "grad", model_dir, str(out_dir), *words], timeout=300)
        else:
            r = _torchrun(nproc, "tests/shared.py", "grad", model_dir, str(out_dir), *words)
        assert r.returncode == 0, r.stderr[-3000:]
        outs = re.split(r"^== run \d+\n", r.stdout, flags=re.M)[1:]
        for i, a in enumerate(runs):
            _GRADS[(model_dir, a, nproc)] = torch.load(os.path.join(out_dir, f"{i}.pt")), outs[i]
    return _GRADS[key]


def _dcp_model(ckpt):
    """The fp32 model weights a checkpoint's dcp/ holds, read without a process group (nor the optimizer's)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    return _load_state_dict_from_keys({"model"}, checkpoint_id=os.path.join(ckpt, "dcp"))["model"]


def _update_samples(n=8, seed=0):
    """n samples in groups of 2 (each pair shares its prompt)."""
    import random
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        resp = [rng.randrange(3, 20) for _ in range(rng.randint(2, 9))] + [1]
        prompt = samples[-1]["prompt_ids"] if i % 2 else [rng.randrange(3, 20) for _ in range(rng.randint(2, 5))]
        samples.append({"prompt_ids": prompt, "response_ids": resp, "len": len(resp), "truncated": False,
                        "adv": rng.gauss(0, 1), "vllm_logp": [-3.0] * len(resp)})
    return samples


def _pg_run(model, cfg, device):
    """What policy_gradient reads of the run: --shared-prefix resolved as set_up resolves it (sharing); a stand-in
    model without a transformers config takes a copy per response."""
    config = getattr(model, "config", None)
    return types.SimpleNamespace(cfg=cfg, model=model, pad_id=0, device=device,
                                 share=config is not None and dapo.sharing(cfg, config))


def _padded_collate(samples, pad_id, device, one_row=False, shared=False):
    """A padded layout, the reference for packed rows: left-padded prompts, right-padded
    responses, an attention mask and position_ids = cumsum - 1 (as vLLM numbers them)."""
    P = max(len(s["prompt_ids"]) for s in samples)
    R = max(len(s["response_ids"]) for s in samples)
    ids = torch.full((len(samples), P + R), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, s in enumerate(samples):
        p, r = s["prompt_ids"], s["response_ids"]
        ids[i, P - len(p):P] = torch.tensor(p)
        ids[i, P:P + len(r)] = torch.tensor(r)
        attn[i, P - len(p):P + len(r)] = 1
    mask = attn[:, P:].clone().float()
    return {"input_ids": ids.to(device), "attention_mask": attn.to(device),
            "position_ids": (attn.cumsum(1) - 1).clamp(min=0).to(device), "targets": ids[:, P:].to(device),
            "mask": mask.to(device)}


def _padded_forward_logprobs(model, batch, temperature, chunk):
    R = batch["targets"].shape[1]
    hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         position_ids=batch["position_ids"], use_cache=False).last_hidden_state
    return dapo.token_logprobs(hidden[:, -R - 1:-1], model.lm_head.weight, batch["targets"], temperature, chunk)


def _logprob_change(a, b, ids=None):
    from transformers import AutoModelForCausalLM
    ids = torch.tensor([[20, 5, 6, 13, 7, 8, 15, 21, 22, 18, 9, 10, 1]]) if ids is None else ids
    lp = [torch.log_softmax(AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()(ids).logits, -1)
          for p in (a, b)]
    return (lp[0] - lp[1]).abs().max().item()


def _dapo(*args):
    return _run([sys.executable, "dapo.py", *E2E_ARGS, *args], timeout=900)


if __name__ == "__main__":  # the helper processes the tests above start
    if sys.argv[1] == "grad":
        _grad_worker(sys.argv[2], sys.argv[3], *sys.argv[4:])
    # results written: skip the interpreter's teardown, where a rank that has destroyed its process group
    # can abort while the other still tears down
    interrupt.kill_children()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
