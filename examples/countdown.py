"""
countdown.py: TinyZero's Countdown task as a fork of dapo.py: a data generator and a reward of its own.
Given numbers and a target, the model writes an arithmetic expression that reaches the target, using each
number at most once, in <answer> tags. The ground truth is a dict, {"target": 46, "numbers": [3, 7, 25]},
as in TinyZero's verl parquet, which dapo.py passes to the reward as row["answer"].

    python examples/countdown.py data/countdown      # writes train.jsonl and eval.jsonl there
    python dapo.py --model ... --train-data data/countdown/train.jsonl --eval-data data/countdown/eval.jsonl \\
        --reward examples/countdown.py:reward --max-response-len 1024 ...

The reward (TinyZero's scores): 1.0 for an expression that reaches the target, 0.1 for one that is
well-formed but does not, 0 for none. The expression is parsed with `ast` and computed with exact
fractions: numbers, + - * / and brackets only; model text is never evaluated. TinyZero reports that a 3B
model learns this and a 0.5B one does not: it is a task for a GPU.
"""

import argparse
import ast
import json
import os
import random
import re
from collections import Counter
from fractions import Fraction

PROMPT = ("Using the numbers {numbers}, create an equation that equals {target}. You can use basic arithmetic "
          "operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think> "
          "tags. And return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 "
          "</answer>.")
MAX_CHARS = 200  # a longer answer is not an expression of a few numbers
OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
       ast.Div: lambda a, b: a / b}


def parse(text):
    """The integers an expression uses and the expression's tree, or None if it is anything but integers,
    + - * / and brackets (a name, a call, a power, a unary minus, ...)."""
    if len(text) > MAX_CHARS:
        return None
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    used = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
        elif not (isinstance(node, ast.BinOp) or type(node) in OPS):
            return None
    return used, tree


def value(tree):
    """The exact value of a parsed expression (ZeroDivisionError where it divides by zero)."""
    if isinstance(tree, ast.Constant):
        return Fraction(tree.value)
    return OPS[type(tree.op)](value(tree.left), value(tree.right))


def reward(response, row):
    """The reward contract (reward.py): the last <answer>...</answer> of the response against
    row["answer"] = {"target": int, "numbers": [int, ...]}."""
    truth = row["answer"]
    found = re.findall(r"<answer>(.*?)</answer>", response[-10_000:], re.S)
    parsed = parse(found[-1]) if found else None
    if parsed is None:
        return {"reward": 0.0, "success": False, "formatted": 0.0}
    used, tree = parsed
    try:
        right = not Counter(used) - Counter(truth["numbers"]) and value(tree) == truth["target"]
    except ZeroDivisionError:
        right = False
    return {"reward": 1.0 if right else 0.1, "success": right, "formatted": 1.0}


def puzzle(rng):
    """Three or four numbers from 1-99 combined left to right by random operations, exactly (a division
    only where it comes out whole); the target is the result, from 1 to 999 and none of the numbers."""
    while True:
        numbers = [rng.randint(1, 99) for _ in range(rng.choice((3, 4)))]
        total = numbers[0]
        for n in numbers[1:]:
            op = rng.choice("+-*/")
            if op == "/" and total % n:
                op = "+"
            total = {"+": total + n, "-": total - n, "*": total * n, "/": total // n}[op]
        if 1 <= total <= 999 and total not in numbers:
            rng.shuffle(numbers)
            return {"prompt": PROMPT.format(numbers=numbers, target=total),
                    "answer": {"target": total, "numbers": numbers}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("out", help="folder for train.jsonl and eval.jsonl")
    p.add_argument("--train", type=int, default=10_000, help="training puzzles (default: 10000)")
    p.add_argument("--held-out", type=int, default=200, help="held-out puzzles (default: 200)")
    args = p.parse_args(argv)
    rng, puzzles = random.Random(0), {}
    while len(puzzles) < args.train + args.held_out:  # distinct prompts, so none held out is trained on
        p = puzzle(rng)
        puzzles.setdefault(p["prompt"], p)
    rows = list(puzzles.values())
    os.makedirs(args.out, exist_ok=True)
    for name, part in (("train", rows[args.held_out:]), ("eval", rows[:args.held_out])):
        with open(os.path.join(args.out, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
        print(f"{os.path.join(args.out, name + '.jsonl')}: {len(part)} puzzles")


if __name__ == "__main__":
    main()
