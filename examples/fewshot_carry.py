"""
fewshot_carry.py: the real-model ladder's task. Sums of 2- to 4-digit numbers, worked column by column
(right to left, each carry written out) by a real chat model, with two worked examples as earlier chat
turns: `What is 347 + 589?` -> `7 + 9 = 16\\n4 + 8 + 1 = 13\\n3 + 5 + 1 = 9\\nAnswer: 936`. A correct
response runs ~20 to ~50 tokens, longer with each column, so the token-level loss and the overlong shaping
have lengths to act on, and one wrong column makes a wrong answer. The math checker (reward.py, dapo.py's
default --reward) scores the `Answer:` line: no reward of its own is needed.

    python examples/fewshot_carry.py data/carry      # writes data/carry/train.jsonl and data/carry/eval.jsonl
    python dapo.py --model $(python tools/real_model.py) --train-data data/carry/train.jsonl \\
        --eval-data data/carry/eval.jsonl --max-prompt-len 384 --max-response-len 64 --overlong-cache-len 16

Why this task: the laptop showcase's answers (examples/fewshot_addition.py) are one short line, so DAPO's
token-level loss and overlong shaping have little to do there; here the responses are written steps of
varied length, as the miniature ladder's carry task (dapo.py --task carry), but in words a real model
reads. "level" is the number of columns (2 to 4): the held-out accuracy is also reported by level.
"""

import argparse
import json
import os
import random

EXAMPLES = [(352, 41), (1768, 475)]  # the worked examples: 3 columns without a carry, 4 with carries


def question(a, b):
    return f"What is {a} + {b}?"


def solution(a, b):
    """The columns right to left, each carry added in the next column, then the answer."""
    lines, carry = [], 0
    for i in range(max(len(str(a)), len(str(b)))):
        x, y = a // 10 ** i % 10, b // 10 ** i % 10
        lines.append(f"{x} + {y}{' + 1' if carry else ''} = {x + y + carry}")
        carry = (x + y + carry) // 10
    return "\n".join(lines + [f"Answer: {a + b}"])


def row(a, b):
    """One prompt: the worked examples as earlier chat turns, then the question."""
    turns = []
    for x, y in EXAMPLES:
        turns += [{"role": "user", "content": question(x, y)}, {"role": "assistant", "content": solution(x, y)}]
    level = max(len(str(a)), len(str(b)))
    return {"prompt": turns + [{"role": "user", "content": question(a, b)}], "answer": str(a + b), "level": level}


def rows(held_out=96, seed=0, per_level=4000):
    """(train, held-out) rows: per_level distinct problems for each number of columns, 2 to 4 (the other
    operand has 1 to as many digits), an equal share of each level held out, shuffled once."""
    rng = random.Random(seed)
    train, held = [], []
    for n in (2, 3, 4):
        pairs = set()
        while len(pairs) < per_level:
            a = rng.randrange(10 ** (n - 1), 10 ** n)
            m = rng.randint(1, n)
            b = rng.randrange(10 ** (m - 1) if m > 1 else 1, 10 ** m)
            if (a, b) not in EXAMPLES and (b, a) not in EXAMPLES:
                pairs.add((a, b) if rng.random() < 0.5 else (b, a))
        pairs = sorted(pairs)
        rng.shuffle(pairs)
        cut = held_out // 3
        held += [row(a, b) for a, b in pairs[:cut]]
        train += [row(a, b) for a, b in pairs[cut:]]
    rng.shuffle(train)
    return train, held


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("out", help="folder for train.jsonl and eval.jsonl")
    p.add_argument("--held-out", type=int, default=96, help="held-out prompts, a third of each level (default: 96)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for name, part in zip(("train", "eval"), rows(args.held_out)):
        with open(os.path.join(args.out, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
        print(f"{os.path.join(args.out, name + '.jsonl')}: {len(part)} prompts")


if __name__ == "__main__":
    main()
