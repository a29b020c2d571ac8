"""
code_task.py: code generation as a fork of dapo.py: the model writes a small Python function's body, one
`return` line, and the reward runs it on hidden tests in a sandbox (lib/sandbox.py). Each prompt holds two
worked examples as earlier chat turns, then a signature and docstring, with one example call:

    user:       def add_7(xs):
                    \"\"\"Each number in xs plus 7.
                    >>> add_7([1, 5])
                    [8, 12]
                    \"\"\"
    assistant:  return [x + 7 for x in xs]

    python examples/code_task.py data/code    # writes data/code/train.jsonl and data/code/eval.jsonl
    python dapo.py --model $(python tools/real_model.py) --train-data data/code/train.jsonl \\
        --eval-data data/code/eval.jsonl --reward examples/code_task.py:reward --cpu-kv-cache-gb 2.5 --eval-every 4

(the laptop preset; its KV cache raised for prompts of ~200 tokens: docs/code-task.md). The tests are data: a
row's "answer" is {"name", "arg", "inputs", "outputs"}: six hidden inputs, drawn until no constant or `return xs`
passes, and what the reference returns on them. The reward builds `def name(arg): return <the response's line>`,
has the sandbox call it on the inputs, and compares the outputs here, in the reward's worker: the expected
outputs never enter the sandbox. +1 when every output is right (exactly, as JSON: True is not 1), else -1. Its
answer, for maj@k, is the outputs themselves, so programs that behave alike vote together (`x*9+2` and
`x * 9 + 2`). The held-out split is by constant: each of the sixteen functions is trained with some values of k
and held out with four others.
"""

import argparse
import json
import os
import random
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # dapo.py's checkout
from lib import sandbox  # noqa: E402

# name, argument, docstring, reference (as the model should write it), inputs: each with {k} for the constant
TASKS = [
    ("add_{k}", "xs", "Each number in xs plus {k}.", "[x + {k} for x in xs]", "ints"),
    ("minus_{k}", "xs", "Each number in xs minus {k}.", "[x - {k} for x in xs]", "ints"),
    ("times_{k}", "xs", "Each number in xs times {k}.", "[x * {k} for x in xs]", "ints"),
    ("above_{k}", "xs", "The numbers in xs greater than {k}.", "[x for x in xs if x > {k}]", "ints"),
    ("below_{k}", "xs", "The numbers in xs less than {k}.", "[x for x in xs if x < {k}]", "ints"),
    ("count_{k}", "xs", "How many times {k} is in xs.", "xs.count({k})", "ints"),
    ("has_{k}", "xs", "Whether {k} is in xs.", "{k} in xs", "ints"),
    ("first_{k}", "xs", "The first {k} items of xs.", "xs[:{k}]", "ints"),
    ("last_{k}", "xs", "The last {k} items of xs.", "xs[-{k}:]", "ints"),
    ("sum_plus_{k}", "xs", "The sum of xs plus {k}.", "sum(xs) + {k}", "ints"),
    ("max_plus_{k}", "xs", "The largest number in xs plus {k}.", "max(xs) + {k}", "nonempty"),
    ("repeat_{k}", "s", "The string s repeated {k} times.", "s * {k}", "words"),
    ("head_{k}", "s", "The first {k} characters of s.", "s[:{k}]", "words"),
    ("tail_{k}", "s", "The last {k} characters of s.", "s[-{k}:]", "words"),
    ("shout_{k}", "s", "The string s followed by {k} exclamation marks.", "s + '!' * {k}", "words"),
    ("len_plus_{k}", "s", "The length of s plus {k}.", "len(s) + {k}", "words"),
]
KS = range(2, 21)       # the constants
HELD_OUT_KS = 4         # per function: held out, never trained on
EXAMPLES = [("add_{k}", 2), ("head_{k}", 3)]  # the worked examples (left out of both splits)
WORDS = ["cat", "apple", "sun", "python", "hello", "tree", "moon", "river", "x", "", "dog", "garden"]


def inputs(kind, k, rng, n, hidden):
    """n inputs of a kind: lists of ints (k itself a quarter of the time) or strings. The example shown is short
    (a list of 2 to 6, a word); hidden ones reach past k (a list of up to k + 4 items, empty too unless
    nonempty; a string of up to k + 4 letters), so a slice of k is not the whole."""
    if kind == "words":
        return ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(0, k + 4))) if hidden
                else rng.choice(WORDS) for _ in range(n)]
    least = 1 if kind == "nonempty" else 0
    return [[k if rng.random() < 0.25 else rng.randint(-3, 22)
             for _ in range(rng.randint(least, k + 4) if hidden else rng.randint(2, 6))] for _ in range(n)]


def reference(task, k):
    """The reference implementation: the generator's own code (TASKS), run here; never a model's."""
    name, arg, _, body, _ = task
    space = {}
    exec(f"def {name.format(k=k)}({arg}):\n    return {body.format(k=k)}\n", space)
    return space[name.format(k=k)]


def hidden_tests(task, k, rng, n=6):
    """n hidden inputs, drawn again until they tell programs apart: two outputs at least differ (no constant
    passes) and an output differs from its input (`return xs` does not pass for the first 15 items)."""
    fn = reference(task, k)
    while True:
        xs = inputs(task[4], k, rng, n, hidden=True)
        ys = [fn(x) for x in xs]
        if len({json.dumps(y) for y in ys}) > 1 and any(y != x for x, y in zip(xs, ys)):
            return xs, ys


def prompt_of(task, k, rng):
    """The signature and docstring, with one example call (not among the hidden inputs)."""
    name, arg, doc, _, kind = task
    shown = inputs(kind, k, rng, 1, hidden=False)[0]
    fn = reference(task, k)
    return (f'def {name.format(k=k)}({arg}):\n    """{doc.format(k=k)}\n    >>> {name.format(k=k)}({shown!r})\n'
            f'    {fn(shown)!r}\n    """')


def row(task, k, rng):
    """One prompt: the worked examples as earlier chat turns, then the task; its hidden tests as the answer."""
    turns = []
    for ex_name, ex_k in EXAMPLES:
        ex = next(t for t in TASKS if t[0] == ex_name)
        turns += [{"role": "user", "content": prompt_of(ex, ex_k, random.Random(ex_k))},
                  {"role": "assistant", "content": f"return {ex[3].format(k=ex_k)}"}]
    shown = prompt_of(task, k, rng)
    xs, ys = hidden_tests(task, k, rng)
    return {"prompt": turns + [{"role": "user", "content": shown}],
            "answer": {"name": task[0].format(k=k), "arg": task[1], "inputs": xs, "outputs": ys}}


def rows(seed=0):
    """(train, held-out) rows: every function with every constant but the worked examples'; for each function
    HELD_OUT_KS constants drawn at random are held out."""
    rng = random.Random(seed)
    train, held = [], []
    for task in TASKS:
        ks = [k for k in KS if (task[0], k) not in EXAMPLES]
        out = set(rng.sample(ks, HELD_OUT_KS))
        for k in ks:
            (held if k in out else train).append(row(task, k, rng))
    rng.shuffle(train)
    return train, held


def reward(response, row):
    """The reward contract (reward.py): the response's first `return` line as the body of the function, run on
    the hidden inputs in the sandbox; +1 if every output is right, else -1; the outputs as the answer."""
    truth = row["answer"]
    line = re.search(r"^[ \t]*return[ \t]+(\S.{0,199})$", response[:2000], re.M)
    if line is None:
        return {"reward": -1.0, "success": False, "answer": None}
    source = f"def {truth['name']}({truth['arg']}):\n    return {line.group(1)}\n"
    got = sandbox.call(source, truth["name"], [[x] for x in truth["inputs"]])
    if got["outputs"] is None:  # it did not load, overran or broke a limit
        return {"reward": -1.0, "success": False, "answer": None}
    right = [json.dumps(o) == json.dumps(["ok", want]) for o, want in zip(got["outputs"], truth["outputs"])]
    return {"reward": 1.0 if all(right) else -1.0, "success": all(right), "answer": json.dumps(got["outputs"]),
            "tests_passed": sum(right) / len(right)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("out", help="folder for train.jsonl and eval.jsonl")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for name, part in zip(("train", "eval"), rows()):
        with open(os.path.join(args.out, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
        print(f"{os.path.join(args.out, name + '.jsonl')}: {len(part)} prompts")


if __name__ == "__main__":
    main()
