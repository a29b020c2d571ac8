"""
demo_model.py: the built-in demo's tiny model. NOT DAPO: a random model cannot write `Answer: <n>`,
so a short supervised warm-start on the task's reference solutions stands in for pretraining, until
the expected accuracy of sampling at T = 1 reaches a target. Also the built-in tasks themselves
(addition prompts in the DAPO template). dapo.py builds the model when --model is not given; run
alone, this builds one for --model (the ladder shares one between all its runs).

    python lib/demo_model.py runs/base                                  # the addition demo's
    python lib/demo_model.py runs/carry-base --task carry
"""

import argparse
import json
import os
import random
import shutil
import tempfile

import torch
import torch.nn.functional as F

# The warm-start's settings. The stopping test costs a forward pass over 256 rows, so it runs every
# few steps. carry: batches of one level (mixing lengths wasted the budget on padding), with a warm-up.
# target: the expected accuracy to stop at (dapo.py's --demo-sft-target: DEMO's and CARRY's).
WARM_START = {"add": dict(batch=128, lr=1e-3, warmup=1, check_every=5, max_steps=400, target=0.3),
              "carry": dict(batch=32, lr=3e-3, warmup=50, check_every=10, max_steps=3000, target=0.25)}

# The built-in tasks: addition prompts in the DAPO template, made on the fly, no download.
DAPO_HEAD = ("Solve the following math problem step by step. The last line of your response should "
             "be of the form Answer: $Answer (without quotes) where $Answer is the answer to the "
             "problem.\n\n")
DAPO_TAIL = "\n\nRemember to put your answer on its own line after \"Answer:\"."
DEMO_TOKENS = [DAPO_HEAD, DAPO_TAIL, "Answer:"]  # single tokens: prompts stay ~10 tokens long
CHARS = "0123456789+-=:. \n"  # every other character would be <|unk|>: a text task needs a real --model
MAX_POSITIONS = 128  # prompt + response


def unknown_chars(text):
    """The characters of text that the built-in model's tokenizer does not know."""
    for t in DEMO_TOKENS:
        text = text.replace(t, "")
    return sorted(set(text) - set(CHARS))


def demo_task(seed=0, task="add"):
    """The built-in task's (train, held-out) rows, each with a reference "solution" for the warm-start.
    add: a+b with a, b in 10..99, 300 held out. carry: operands of 1-5 digits, solved column by column
    (347+589= -> 7+9=16, 4+8+1=13, 3+5+1=9, Answer: 936); "level" is the number of columns, and 250
    problems of each level are held out (20 of the 100 one-column ones)."""
    rng = random.Random(seed)
    if task == "add":
        rows = [{"prompt": f"{DAPO_HEAD}{a}+{b}={DAPO_TAIL}", "answer": str(a + b),
                 "solution": f"Answer: {a + b}"} for a in range(10, 100) for b in range(10, 100)]
        rng.shuffle(rows)
        return rows[300:], rows[:300]
    rng = random.Random(0)  # carry is one fixed dataset, as a data file would be; --seed varies the rest
    train, held = [], []
    for n in range(1, 6):
        pairs = set()  # distinct problems first, then the split: there are only 100 of level 1
        while len(pairs) < (100 if n == 1 else 5000):
            a = rng.randrange(10 ** (n - 1) if n > 1 else 0, 10 ** n)
            m = rng.randint(1, n)
            b = rng.randrange(10 ** (m - 1) if m > 1 else 0, 10 ** m)
            pairs.add((a, b) if rng.random() < 0.5 else (b, a))
        pairs = sorted(pairs)
        rng.shuffle(pairs)
        rows = [{"prompt": f"{DAPO_HEAD}{a}+{b}={DAPO_TAIL}", "answer": str(a + b), "level": n,
                 "solution": carry_solution(a, b)} for a, b in pairs]
        cut = 20 if n == 1 else 250
        held, train = held + rows[:cut], train + rows[cut:]
    rng.shuffle(train)
    return train, held


def carry_solution(a, b):
    lines, carry = [], 0
    for i in range(max(len(str(a)), len(str(b)))):
        x, y = a // 10 ** i % 10, b // 10 ** i % 10
        lines.append(f"{x}+{y}{'+1' if carry else ''}={x + y + carry}")
        carry = (x + y + carry) // 10
    return "\n".join(lines + [f"Answer: {a + b}"])


def tiny_qwen2(added_tokens, vocab=32, max_len=MAX_POSITIONS, seed=0, fill=False):
    """A character-level tokenizer (digits, "+-=:.", space, newline; each of added_tokens is one
    token) and a random-init Qwen2 of 2 layers, hidden 128, head_dim 64 (vLLM's CPU backend needs
    >= 64). fill: add characters until the tokenizer has `vocab` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    # Written in the byte-level form Qwen2's tokenizer class expects (space is "Ġ", newline "Ċ"),
    # since AutoTokenizer rebuilds a qwen2 model's tokenizer that way.
    specials = ["<|pad|>", "<|endoftext|>", "<|unk|>"]
    chars = [{" ": "Ġ", "\n": "Ċ"}.get(c, c) for c in CHARS]
    if fill:
        more = sorted(c for c in pre_tokenizers.ByteLevel.alphabet() if c not in chars)
        chars += more[:vocab - len(specials) - len(chars) - len(added_tokens)]
    vocab_map = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.BPE(vocab_map, merges=[], unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens(added_tokens)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                        unk_token="<|unk|>")
    assert len(tokenizer) <= vocab and (len(tokenizer) == vocab or not fill), len(tokenizer)
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=max_len, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.eos_token_id, dtype="float32")
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def token_nll(model, ids):
    """-log p of each next token of ids, (B, T - 1)."""
    logits = model(ids).logits[:, :-1]
    return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")


def build(path, rows, added_tokens, seed=0, sft_target=0.3, task="add"):
    """Save the tiny model, warm-started on rows' prompt -> "solution" until the expected accuracy
    reaches sft_target, and its tokenizer to `path`."""
    model, tokenizer = tiny_qwen2(added_tokens, seed=seed)
    w = WARM_START[task]
    levels = {}  # one level per batch: row indices
    for i, r in enumerate(rows):
        levels.setdefault(r.get("level", 0), []).append(i)
    pools = [levels[k] for k in sorted(levels)]
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=w["lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / w["warmup"]))
    # tokenized once; prompts are strings and there is no chat template: as dapo.encode_prompts
    prompts = tokenizer([r["prompt"] for r in rows], add_special_tokens=False)["input_ids"]
    answers = tokenizer([r["solution"] for r in rows], add_special_tokens=False)["input_ids"]

    def batch(which):
        p = [prompts[i] for i in which]
        a = [answers[i] + [tokenizer.eos_token_id] for i in which]
        T = max(len(x) + len(y) for x, y in zip(p, a))  # right-pad; pads are masked out
        ids = torch.tensor([x + y + [tokenizer.pad_token_id] * (T - len(x) - len(y)) for x, y in zip(p, a)])
        mask = torch.tensor([[0] * len(x) + [1] * len(y) + [0] * (T - len(x) - len(y)) for x, y in zip(p, a)])
        return ids, mask

    dev_ids, dev_mask = batch(range(min(256, len(rows))))
    for step in range(w["max_steps"]):
        if step % w["check_every"] == 0:
            with torch.no_grad():  # exact expected accuracy of sampling at T = 1
                acc = torch.exp(-(token_nll(model, dev_ids) * dev_mask[:, 1:]).sum(1)).mean().item()
            if acc >= sft_target:
                break
        pool = pools[step % len(pools)]
        idx = torch.randint(len(pool), (w["batch"],), generator=g).tolist()
        ids, mask = batch([pool[i] for i in idx])
        loss = (token_nll(model, ids) * mask[:, 1:]).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    model.config.dapo_demo_task = task  # dapo.py keeps the built-in task's preset for this model
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return {"sft_steps": step, "sft_expected_acc": acc}


def describe(info, cache, hit):
    """cached_build's answer, in the words of dapo.py's line about it."""
    how = f"taken from {cache} (delete it to rebuild)" if hit else f"in {info['seconds']:.0f} s"
    return (f"supervised warm-start (not DAPO) for {info['sft_steps']} steps {how}, expected accuracy "
            f"{info['sft_expected_acc']:.2f}")


def cache_root():
    """Where built models are cached: $DAPO_CACHE, default ~/.cache/dapo. Every entry is safe to delete."""
    return os.environ.get("DAPO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dapo")


def cached_build(path, task="add", seed=0, sft_target=0.3):
    """build() the built-in task's model into path, through a cache: the warm-start is deterministic, so
    it is kept under $DAPO_CACHE (default ~/.cache/dapo), keyed by everything that determines it (this
    file, the task, seed and target, the torch and transformers versions). Safe to delete.
    Returns (build's info, the cache directory or None, whether it was there already)."""
    import hashlib
    import time
    import transformers
    with open(__file__, "rb") as f:
        key = repr((f.read(), task, seed, sft_target, torch.__version__, transformers.__version__))
    root = cache_root()
    cache = os.path.join(root, f"demo-{task}-seed{seed}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")
    hit, t = os.path.isfile(os.path.join(cache, "warm_start.json")), time.perf_counter()
    if not hit:
        try:
            os.makedirs(root, exist_ok=True)
            tmp = tempfile.mkdtemp(dir=root)
        except OSError:  # no writable cache: build in place
            info = build(path, demo_task(seed, task)[0], DEMO_TOKENS, seed, sft_target, task)
            return dict(info, seconds=time.perf_counter() - t), None, False
        info = build(tmp, demo_task(seed, task)[0], DEMO_TOKENS, seed, sft_target, task)
        with open(os.path.join(tmp, "warm_start.json"), "w") as f:
            json.dump(dict(info, seconds=time.perf_counter() - t), f)
        try:
            os.rename(tmp, cache)
        except OSError:  # another run cached the same model first
            shutil.rmtree(tmp)
    shutil.copytree(cache, path, dirs_exist_ok=True)
    with open(os.path.join(path, "warm_start.json")) as f:
        return json.load(f), cache, hit


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("path", help="directory to write the model and tokenizer to")
    p.add_argument("--task", default="add", choices=sorted(WARM_START))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-target", type=float, help="stop at this expected accuracy (default: the task's "
                   "WARM_START target, as dapo.py's)")
    a = p.parse_args()
    target = WARM_START[a.task]["target"] if a.sft_target is None else a.sft_target
    info = build(a.path, demo_task(a.seed, a.task)[0], DEMO_TOKENS, a.seed, target, a.task)
    print(f"{a.path}: supervised warm-start (not DAPO) for {info['sft_steps']} steps, expected accuracy "
          f"{info['sft_expected_acc']:.3f}")


if __name__ == "__main__":
    main()
