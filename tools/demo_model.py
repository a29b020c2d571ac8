"""
demo_model.py: the built-in demo's tiny model. NOT DAPO: a random model cannot write `Answer: <n>`,
so a short supervised warm-start on the task's reference solutions stands in for pretraining, until
the expected accuracy of sampling at T = 1 reaches a target. dapo.py builds it when --model is not
given; run alone, it builds one for --model (the ladder shares one between all its runs).

    python tools/demo_model.py runs/base                                  # the addition demo's
    python tools/demo_model.py runs/carry-base --task carry
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

# The warm-start's settings. The stopping test costs a forward pass over 256 rows, so it runs every
# few steps. carry: batches of one level (mixing lengths wasted the budget on padding), with a warm-up.
WARM_START = {"add": dict(batch=128, lr=1e-3, warmup=1, check_every=5, max_steps=400),
              "carry": dict(batch=32, lr=3e-3, warmup=50, check_every=10, max_steps=3000)}


def tiny_qwen2(added_tokens, vocab=32, max_len=128, seed=0, fill=False):
    """A character-level tokenizer (digits, "+-=:.", space, newline; each of added_tokens is one
    token) and a random-init Qwen2 of 2 layers, hidden 128, head_dim 64 (vLLM's CPU backend needs
    >= 64). fill: add characters until the tokenizer has `vocab` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    # Written in the byte-level form Qwen2's tokenizer class expects (space is "Ġ", newline "Ċ"),
    # since AutoTokenizer rebuilds a qwen2 model's tokenizer that way.
    specials = ["<|pad|>", "<|endoftext|>", "<|unk|>"]
    chars = list("0123456789+-=:.") + ["Ġ", "Ċ"]
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
    levels = {}  # one level per batch
    for r in rows:
        levels.setdefault(r.get("level", 0), []).append(r)
    pools = [levels[k] for k in sorted(levels)]
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=w["lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / w["warmup"]))

    def batch(rows):  # prompts are strings and there is no chat template: as dapo.encode_prompt
        p = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
        eos = [tokenizer.eos_token_id]
        a = [tokenizer(r["solution"], add_special_tokens=False)["input_ids"] + eos for r in rows]
        T = max(len(x) + len(y) for x, y in zip(p, a))  # right-pad; pads are masked out
        ids = torch.tensor([x + y + [tokenizer.pad_token_id] * (T - len(x) - len(y)) for x, y in zip(p, a)])
        mask = torch.tensor([[0] * len(x) + [1] * len(y) + [0] * (T - len(x) - len(y)) for x, y in zip(p, a)])
        return ids, mask

    dev_ids, dev_mask = batch(rows[:256])
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
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return {"sft_steps": step, "sft_expected_acc": acc}


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("path", help="directory to write the model and tokenizer to")
    p.add_argument("--task", default="add", choices=sorted(WARM_START))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-target", type=float, help="stop at this expected accuracy (default: dapo.py's)")
    a = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import dapo
    rows, _ = dapo.demo_task(a.seed, a.task)
    if a.sft_target is None:
        a.sft_target = dapo.parse_config(["--task", a.task]).demo_sft_target
    info = build(a.path, rows, dapo.DEMO_TOKENS, a.seed, a.sft_target, a.task)
    print(f"{a.path}: supervised warm-start (not DAPO) for {info['sft_steps']} steps, expected accuracy "
          f"{info['sft_expected_acc']:.3f}")


if __name__ == "__main__":
    main()
