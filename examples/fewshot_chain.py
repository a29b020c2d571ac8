"""
fewshot_chain.py: the real-model ladder's task. Sums of 3 to 5 one-digit numbers, written as a running
total, one addition a line, by a real chat model, with two worked examples as earlier chat turns:
`What is 7 + 6 + 9 + 2?` -> `7 + 6 = 13\\n13 + 9 = 22\\n22 + 2 = 24\\nAnswer: 24`. A correct response runs
~15 to ~35 tokens, one line more with each number, so the token-level loss and the overlong shaping have
lengths to act on, and one wrong line makes a wrong answer. The math checker (reward.py, dapo.py's
default --reward) scores the `Answer:` line: no reward of its own is needed.

    python examples/fewshot_chain.py data/chain      # writes data/chain/train.jsonl and data/chain/eval.jsonl
    python dapo.py --model $(python tools/real_model.py) --train-data data/chain/train.jsonl \\
        --eval-data data/chain/eval.jsonl --max-response-len 64 --overlong-cache-len 16

Why this task: the laptop showcase's answers (examples/fewshot_addition.py) are one short line, so DAPO's
token-level loss and overlong shaping have little to do there; here the responses are written steps of
varied length, as the miniature ladder's carry task (dapo.py --task carry). Column-by-column sums of 2-4
digit numbers, tried first, were beyond SmolLM2-135M-Instruct (held-out avg@4 0.000 before training: no
group had a right answer to learn from); running totals of one-digit numbers start at ~0.1. "level" is the
count of numbers (3 to 5): the held-out accuracy is also reported by level.
"""

import argparse
import json
import os
import random

EXAMPLES = [(3, 5, 4), (7, 6, 9, 2)]  # the worked examples: 3 numbers, then 4


def question(nums):
    return "What is " + " + ".join(map(str, nums)) + "?"


def solution(nums):
    """The running total, one addition a line, then the answer."""
    total, lines = nums[0], []
    for x in nums[1:]:
        lines.append(f"{total} + {x} = {total + x}")
        total += x
    return "\n".join(lines + [f"Answer: {total}"])


def row(nums):
    """One prompt: the worked examples as earlier chat turns, then the question."""
    turns = []
    for e in EXAMPLES:
        turns += [{"role": "user", "content": question(e)}, {"role": "assistant", "content": solution(e)}]
    return {"prompt": turns + [{"role": "user", "content": question(nums)}], "answer": str(sum(nums)),
            "level": len(nums)}


def rows(held_out=96, seed=0, per_level=3000):
    """(train, held-out) rows: per_level distinct problems of each length (or all there are), 3 to 5 numbers
    from 1 to 9 (the examples left out), an equal share of each level held out, shuffled once."""
    rng = random.Random(seed)
    train, held = [], []
    for n in (3, 4, 5):
        problems = set()
        while len(problems) < min(per_level, 9 ** n - 1):  # 3 numbers: 729 problems in all
            nums = tuple(rng.randint(1, 9) for _ in range(n))
            if nums not in EXAMPLES:
                problems.add(nums)
        problems = sorted(problems)
        rng.shuffle(problems)
        cut = held_out // 3
        held += [row(p) for p in problems[:cut]]
        train += [row(p) for p in problems[cut:]]
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
