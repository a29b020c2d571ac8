"""bench_kernels.py: the update's kernels outside its matrix products against what could run in their place, at
one layer of SmolLM2-135M's width on the ladder's mini-batch, in bf16 on this machine's threads:

    python tools/bench_kernels.py                     # 2 rows, each a prompt of 150 and 8 responses of 36 (~1 min)
    python tools/bench_kernels.py --prompt 16 --responses 2 --response-len 8 --repeat 1   # a quick look

Each row: the median over --repeat passes (after one warm-up) of the forward and of the backward, and how far its
result is from the first row's, the kernel dapo.py runs (attention and the norm: the largest difference of the
output; the head: the error against fp64).
  attention  sdpa under the shared-prompt mask (dapo.py's shared_prefix_mask on collate's layout: what the update
             runs); sdpa causal, and unmasked (what a mask costs the kernel); sdpa split into each prompt (causal) and each
             response against [its prompt, itself] in a second call (only the pairs the mask keeps); transformers'
             eager attention (bf16 scores, an fp32 softmax, two matmuls); flex attention (its block mask skips what
             no query sees), or the reason torch refuses it.
  head       the fp32 head's backward (_Head.backward's two matmuls, dh and dw) in fp32, and with bf16 operands
             (bf16_operands_matmul, as the head's forward runs on a CPU): relative error against fp64, beside one
             bf16 rounding of the fp64 result, where the gradient ends (tests/test_exactness.py allows 1.25x it).
  rms norm   transformers' RMSNorm (fp32, cast to bf16, times the weight) and torch's fused rms_norm.
"""
import argparse
import os
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # dapo.py's checkout
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dapo  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2, help="packed rows, one group each")
    p.add_argument("--prompt", type=int, default=150, help="a group's prompt, in tokens")
    p.add_argument("--responses", type=int, default=8, help="responses in a group")
    p.add_argument("--response-len", type=int, default=36)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}; {a.rows} rows of {a.prompt} + "
          f"{a.responses} x {a.response_len} positions, {a.heads} heads of {a.head_dim}, bf16")
    print(f"{'kernel':<46} {'forward ms':>10} {'backward ms':>11}   from the first row")
    for name, fwd, bwd, diff in attention_rows(a) + head_rows(a) + norm_rows(a):
        fwd, bwd = (f"{t:.2f}" if t is not None else "-" for t in (fwd, bwd))
        print(f"{name:<46} {fwd:>10} {bwd:>11}   {diff}")


def timed(fn, inputs, repeat):
    """The medians (ms) of fn(*inputs)'s forward and of its backward (a fixed random gradient), and its output."""
    fwd, bwd, grad = [], [], None
    for k in range(repeat + 1):
        for x in inputs:
            x.grad = None
        t = time.perf_counter()
        out = fn(*inputs)
        t1 = time.perf_counter()
        grad = torch.randn_like(out) if grad is None else grad
        out.backward(grad)
        if k:  # the first pass warms up
            fwd.append(t1 - t)
            bwd.append(time.perf_counter() - t1)
    return statistics.median(fwd) * 1e3, statistics.median(bwd) * 1e3, out.detach()


def layout(a):
    """collate's segment and branch of rows that each hold one group: [prompt | response 1 | ... | response G]."""
    L = a.prompt + a.responses * a.response_len
    segment = torch.ones(a.rows, L, dtype=torch.long)
    branch = torch.zeros(a.rows, L, dtype=torch.long)
    for b in range(a.responses):
        at = a.prompt + b * a.response_len
        branch[:, at:at + a.response_len] = b + 1
    return segment, branch


def model_mask(segment, branch, kind):
    """dapo.shared_prefix_mask as the update builds it for a model whose attention is `kind`."""
    model = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation=kind))
    return dapo.shared_prefix_mask(model, {"segment": segment, "branch": branch})


def attention_rows(a):
    segment, branch = layout(a)
    B, L = segment.shape
    mask = model_mask(segment, branch, "sdpa")
    P, G, n = a.prompt, a.responses, a.response_len
    # the split: each response's queries against its prompt's keys and its own, causal within the response
    answers = torch.arange(P, L).view(G, n)
    keys = torch.cat([torch.arange(P).expand(G, P), answers], 1)
    sees = torch.cat([torch.ones(n, P, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], 1)

    def split(q, k, v):
        first = F.scaled_dot_product_attention(q[:, :, :P], k[:, :, :P], v[:, :, :P], is_causal=True)
        qs, ks, vs = (x[:, :, idx].transpose(1, 2).flatten(0, 1) for x, idx in ((q, answers), (k, keys), (v, keys)))
        rest = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=sees)  # (B * G, H, n, D)
        return torch.cat([first, rest.unflatten(0, (B, G)).transpose(1, 2).flatten(2, 3)], 2)

    def eager(q, k, v):  # transformers' eager_attention_forward, its mask as a boolean
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1, dtype=torch.float32)
        return probs.to(q.dtype) @ v

    def flex(q, k, v):
        from torch.nn.attention.flex_attention import flex_attention
        return torch.compile(flex_attention)(q, k, v, block_mask=model_mask(segment, branch, "flex_attention"))

    qkv = [torch.randn(B, a.heads, L, a.head_dim, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    ways = [("attention: sdpa, shared-prompt mask (dapo.py)", lambda q, k, v: F.scaled_dot_product_attention(
                 q, k, v, attn_mask=mask)),
            ("attention: sdpa, causal (another mask)", lambda q, k, v: F.scaled_dot_product_attention(
                q, k, v, is_causal=True)),
            ("attention: sdpa, no mask (another mask)", F.scaled_dot_product_attention),
            ("attention: sdpa, split (the pairs it keeps)", split),
            ("attention: eager, shared-prompt mask", eager),
            ("attention: flex, shared-prompt block mask", flex)]
    rows, first = [], None
    for name, fn in ways:
        try:
            fwd, bwd, out = timed(fn, qkv, a.repeat)
        except NotImplementedError as e:  # flex: no CPU backward in torch 2.13
            rows.append((name, None, None, f"refused: {dapo.one_line(e, 100)}"))
            continue
        first = out if first is None else first
        same = "another function" if "another" in name else f"{(out - first).abs().max().item():.1e}"
        rows.append((name, fwd, bwd, same))
    return rows


def head_rows(a):
    """The backward of the head over the mini-batch's response tokens: dx, the logits' gradient (each token's
    upstream gradient g, as the loss gives one per token, times the targets' one-hot minus the softmax), times the
    bf16 weight (dh) and the bf16 hidden states (dw)."""
    N = a.rows * a.responses * a.response_len
    hidden = torch.randn(N, a.hidden).bfloat16().float()
    weight = (torch.randn(a.vocab, a.hidden) * 0.05).bfloat16().float()
    dx = -torch.softmax(hidden @ weight.T, -1)
    dx[torch.arange(N), torch.randint(0, a.vocab, (N,))] += 1.0
    dx *= torch.randn(N, 1) / N  # g: an advantage over the token count
    exact = (dx.double() @ weight.double(), dx.double().T @ hidden.double())

    def error(got):  # relative (Frobenius) error of dh and dw, the larger
        return max(((g.double() - e).norm() / e.norm()).item() for g, e in zip(got, exact))

    rounding = error([e.bfloat16() for e in exact])
    rows = []
    for name, bf16_operands in (("head backward: fp32 matmuls (dapo.py)", False),
                                ("head backward: bf16 operands", True)):
        times, got = [], None
        with dapo.bf16_operands_matmul(bf16_operands):
            for k in range(a.repeat + 1):
                t = time.perf_counter()
                got = (dx @ weight, dx.T @ hidden)
                times.append(time.perf_counter() - t)
        err = error([g.bfloat16() for g in got])  # the gradient leaves in bf16 either way
        rows.append((name, None, statistics.median(times[1:]) * 1e3,
                     f"error {err:.2e} in bf16: {err / rounding:.2f}x one rounding"))
    return rows


def norm_rows(a):
    L = a.prompt + a.responses * a.response_len
    x = torch.randn(a.rows, L, a.hidden, dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(a.hidden)).bfloat16().requires_grad_()

    def transformers(x, w):  # LlamaRMSNorm.forward
        h = x.float()
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)

    rows, first = [], None
    for name, fn in (("rms norm: transformers' (dapo.py)", transformers),
                     ("rms norm: torch's fused rms_norm", lambda x, w: F.rms_norm(x, w.shape, w, 1e-5))):
        fwd, bwd, out = timed(fn, [x, w], a.repeat)
        first = out if first is None else first
        rows.append((name, fwd, bwd, f"{(out - first).abs().max().item():.1e}"))
    return rows


if __name__ == "__main__":
    main()
