"""
fewshot_addition.py: the laptop showcase's task. 2-digit sums for a real chat model, each prompt holding two
worked examples as earlier chat turns, so the model answers in the checker's format (`Answer: 66`) from the
first step, and DAPO has only the sums left to learn. The math checker (reward.py, dapo.py's default
--reward) scores it: no reward of its own is needed.

    python examples/fewshot_addition.py data/add    # writes data/add/train.jsonl and data/add/eval.jsonl
    python dapo.py --model $(python tools/real_model.py) --train-data data/add/train.jsonl \\
        --eval-data data/add/eval.jsonl               # tools/real_model.py's model: the laptop preset

Why the examples: asked zero-shot (DAPO's template, "The last line of your response should be of the form
Answer: $Answer"), SmolLM2-135M-Instruct writes the right sum in prose ("15 + 43 = 58") and almost never
the `Answer:` line, so nearly every group is all wrong and nothing is learned (docs/real-model.md).

A row: {"prompt": [{"role": "user", "content": "What is 23 + 14?"}, {"role": "assistant", "content":
"Answer: 37"}, ..., {"role": "user", "content": "What is 41 + 25?"}], "answer": "66"}.
"""

import argparse
import json
import os
import random

EXAMPLES = [(23, 14), (58, 36)]  # the worked examples: one sum without a carry, one with


def question(a, b):
    return f"What is {a} + {b}?"


def row(a, b):
    """One prompt: the worked examples as earlier chat turns, then the question."""
    turns = []
    for x, y in EXAMPLES:
        turns += [{"role": "user", "content": question(x, y)}, {"role": "assistant", "content": f"Answer: {x + y}"}]
    return {"prompt": turns + [{"role": "user", "content": question(a, b)}], "answer": str(a + b)}


def rows(held_out=64, seed=0):
    """(train, held-out) rows: every a + b with a, b in 10..99 but the examples, shuffled once."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100) if (a, b) not in EXAMPLES]
    random.Random(seed).shuffle(pairs)
    return [row(a, b) for a, b in pairs[held_out:]], [row(a, b) for a, b in pairs[:held_out]]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("out", help="folder for train.jsonl and eval.jsonl")
    p.add_argument("--held-out", type=int, default=64, help="held-out prompts (default: 64)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for name, part in zip(("train", "eval"), rows(args.held_out)):
        with open(os.path.join(args.out, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
        print(f"{os.path.join(args.out, name + '.jsonl')}: {len(part)} prompts")


if __name__ == "__main__":
    main()
