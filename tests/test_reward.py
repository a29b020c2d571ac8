"""The reward checker (reward.py, Eq. 7's is_equivalent) and its contract for a reward of one's own: extraction,
equivalence, the worker processes and their limits, majority voting; the worked examples in examples/."""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
import json
import re
import time
import types
import pytest
import reward
from reward import compute_score, extract_answer, is_correct, is_equivalent, score_batch
import dapo
from tests.shared import HERE


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


pytestmark = pytest.mark.timeout(1200, method="thread")  # the subprocess helpers time out first


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
def test_extract_answer(response, expected):
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
def test_extract_answer_none(response):
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
def test_equivalent(pred, gt):
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
def test_not_equivalent(pred, gt):
    assert not is_equivalent(pred, gt)


def test_integers_never_go_through_floats():
    big = "12345678901234567891"
    assert is_equivalent(big, big)
    assert not is_equivalent("12345678901234567890", big)   # equal as float64, not as integers


@pytest.mark.parametrize("response, gt", [
    pytest.param(r, g, id=f"{name}-{i}") for name, (acc, _) in ANSWER_CLASSES.items() for i, (r, g) in enumerate(acc)])
def test_answer_classes_accept(response, gt):
    assert is_correct(response, gt)


@pytest.mark.parametrize("response, gt", [
    pytest.param(r, g, id=f"{name}-{i}") for name, (_, rej) in ANSWER_CLASSES.items() for i, (r, g) in enumerate(rej)])
def test_answer_classes_reject(response, gt):
    assert not is_correct(response, gt)


def test_answer_classes_score_batch_agrees():
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
def test_adversarial_is_fast(response, gt):
    is_correct("\\boxed{\\sqrt{12}}", "2\\sqrt3")   # warm sympy's import outside the timing
    t = time.perf_counter()
    ok = is_correct(response, gt)
    assert time.perf_counter() - t < 0.5
    assert ok is False or response.startswith("Answer: 9")


@pytest.mark.parametrize("response", [
    "Answer: 1e999999999", "Answer: 1e-999999999", "\\boxed{1.5\\times10^{999999999}}", "\\boxed{10^{999999999}}",
    "Answer: 10**999999999", "\\boxed{1e999999999x}", "\\boxed{x^{999999999}+1}", "Answer: 0." + "0" * 190 + "1"])
def test_huge_numbers_are_decided_in_process(response):
    """score_batch must not hand such answers to a worker (it would spend the whole timeout)."""
    t = time.perf_counter()
    results, stats = score_batch([response] * 50, [{"answer": "42"}] * 50, timeout=20)
    assert time.perf_counter() - t < 0.5
    assert [r["success"] for r in results] == [False] * 50 and stats["in_process"] == 50
    assert is_equivalent("1e999999999", "10^{999999999}") and not is_equivalent("1e999999999", "1e999999998")


def test_throughput_integer_answers():
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


def test_score_batch_default_checker():
    resps = ["Answer: 42", "Answer: 41", "\\boxed{2\\sqrt{3}}", "\\boxed{\\sqrt{13}}", "nothing"]
    gts = ["42", "42", "\\sqrt{12}", "\\sqrt{12}", "1"]
    results, stats = score_batch(resps, [{"answer": g} for g in gts], timeout=20)
    assert [r["success"] for r in results] == [True, False, True, False, False]
    assert [r["reward"] for r in results] == [1.0, -1.0, 1.0, -1.0, -1.0]               # Eq. 7
    assert [r["answer"] for r in results] == ["42", "41", "2\\sqrt{3}", "\\sqrt{13}", None]   # what maj@k votes on
    assert stats["timeouts"] == 0 and stats["in_process"] == 3   # two needed sympy workers


def test_score_batch_kills_a_hanging_item():
    resps = ["Answer: 1", "HANG", "Answer: 3", "CRASH", "Answer: 5", "Answer: 9"]
    rows = [{"answer": str(i)} for i in range(1, 7)]
    t = time.perf_counter()
    results, stats = score_batch(resps, rows, timeout=1.5, num_workers=2, fn="tests.reward_stubs:slow_checker")
    took = time.perf_counter() - t
    assert [r["success"] for r in results] == [True, False, True, False, True, False]
    assert [r["reward"] for r in results] == [1.0, -1.0, 1.0, -1.0, 1.0, -1.0]
    assert stats["timeouts"] == 1 and stats["errors"] == 1
    assert took < 60, took   # the hang is 3600 s; 60 s leaves room for slow worker start-up under load
    pool = reward._POOL["tests.reward_stubs:slow_checker"]
    assert len(pool) == 2 and all(w.proc.poll() is None for w in pool)   # killed workers replaced in place
    # the pool is healthy afterwards
    results, stats = score_batch(["Answer: 7"], [{"answer": "7"}], timeout=5, fn="tests.reward_stubs:slow_checker")
    assert results[0]["success"] and stats["timeouts"] == 0


def test_reward_contract_takes_a_bool_a_number_or_a_dict():
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


def test_a_reward_of_ones_own_sees_the_whole_row_in_a_worker_process(tmp_path, capsys):
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


def test_a_failed_reward_scores_the_lowest_reward_of_its_group():
    """A response on which the reward fails (raises, returns garbage, overruns, crashes its worker) is no
    success and scores the lowest reward of its group, at most -1: for a reward whose range goes below -1 a
    failure never outscores a bad answer; for Eq. 7's ±1 it is -1, as before."""
    rows = [{"answer": "x"}] * 6
    results, stats = score_batch(["-5", "RAISE", "1", "RAISE", "0.5", "GARBAGE"], rows, fn="tests.reward_stubs:low_reward",
                                 timeout=5.0, group_size=2)
    assert [r["reward"] for r in results] == [-5.0, -5.0, 1.0, -1.0, 0.5, -1.0]
    assert [r.get("failed", False) for r in results] == [False, True, False, True, False, True]
    assert not any(r["success"] for r in results[1::2]) and stats["errors"] == 3


def test_the_contract_refuses_huge_rewards_and_a_metric_named_mean_and_says_nan():
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


def test_a_crashed_worker_is_replaced_while_the_others_work_on(tmp_path):
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


def test_fewshot_chain_rows_write_running_totals_the_checker_scores(tmp_path):
    """examples/fewshot_chain.py (the real-model ladder's task): two worked examples as earlier chat turns, each
    a running total one addition a line ending in "Answer: <sum>", then a question of 3 to 5 one-digit numbers;
    the held-out split is a third of each level and never appears in training."""
    chain = _example("fewshot_chain")
    chain.main([str(tmp_path)])
    train, held = (dapo.load_data(str(tmp_path / f"{n}.jsonl")) for n in ("train", "eval"))
    assert len(held) == 96 and sorted({r["level"] for r in train}) == [3, 4, 5]
    assert all(sum(r["level"] == n for r in held) == 32 for n in (3, 4, 5))
    for r in train[:50] + held:
        nums = list(map(int, re.findall(r"\d+", r["prompt"][-1]["content"])))
        assert len(nums) == r["level"] and all(1 <= x <= 9 for x in nums)
        assert r["answer"] == str(sum(nums)) and reward.is_correct(chain.solution(nums), r["answer"])
        for shown in r["prompt"][1:4:2]:
            lines = shown["content"].split("\n")
            for line in lines[:-1]:  # "a + b = c", each right, each a starting from the last total
                a, b, c = map(int, re.findall(r"\d+", line))
                assert a + b == c
            assert lines[-1] == f"Answer: {c}"
    assert not {json.dumps(r["prompt"]) for r in held} & {json.dumps(r["prompt"]) for r in train}


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


# -----------------------------------------------------------------------------------------
# Helpers

def _example(name):
    sys.path.insert(0, os.path.join(HERE, "examples"))
    return __import__(name)
