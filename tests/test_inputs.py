"""Inputs and errors: every bad flag, file, model, reward and checkpoint is refused in one line before anything slow;
what a resume takes and refuses; Ctrl-C."""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
import contextlib
import dataclasses
import json
import re
import shutil
import subprocess
import time
import types
import pytest
import torch
import reward
from lib import demo_model, interrupt
import dapo
from tests.shared import E2E_ARGS, HERE, _run, _stub_sample_fn


def _numeric_fields():
    return [f for f in dataclasses.fields(dapo.Config) if type(f.default) in (int, float)]


BAD_REWARDS = {"crash_on_import.py": "import os\nos._exit(3)\n", "syntax_error.py": "def f(:\n",
               "raises_on_import.py": "raise RuntimeError('no GPU here')\n",
               "ok.py": "def three(a, b, c):\n    return True\n", "hangs.py": "import time\ntime.sleep(3600)\n"}


_DETERMINISTIC_PROBE = r"""
import importlib.abc, json, os, sys, torch, types
seen = {}


class Probe(importlib.abc.MetaPathFinder):  # the first import of vllm: record, then stop the run there
    def find_spec(self, name, path, target=None):
        if name == "vllm" and not seen:
            seen.update(env=os.environ.get("VLLM_BATCH_INVARIANT"), torch=torch.are_deterministic_algorithms_enabled())
            raise ImportError("stopped by the test at the first import of vllm")


sys.meta_path.insert(0, Probe())
import dapo
real = torch.cuda.is_available, dapo.init_distributed, torch.cuda.get_device_properties
gpu = types.SimpleNamespace(total_memory=80e9)  # the memory check (preflight) reads the GPU's size
for where, flag in (("cuda", "--deterministic"), ("cuda", "--no-deterministic"), ("cpu", "--deterministic")):
    seen.clear()
    os.environ["VLLM_BATCH_INVARIANT"] = ""
    torch.use_deterministic_algorithms(False)
    if where == "cuda":  # as if on a GPU machine, up to the first import of vllm
        torch.cuda.is_available, dapo.init_distributed, torch.cuda.get_device_properties = (
            lambda: True, lambda timeout_min: torch.device("cuda", 0), lambda i=0: gpu)
    else:
        torch.cuda.is_available, dapo.init_distributed, torch.cuda.get_device_properties = real
    try:
        dapo.main(sys.argv[1:] + [flag])
    except BaseException as e:
        print(json.dumps(dict(seen, where=where, flag=flag, stopped=str(e))))
"""


_CTRL_C_STUB = r"""
import sys, time
sys.path.insert(0, HERE)
import dapo, reward
from lib import interrupt

def train(cfg):  # a stand-in for a long run: reward workers up, step 3 in progress
    reward.score_batch(["1", "2"], ["1", "2"], num_workers=2, fn="reward:compute_score")
    interrupt.STATE["step"] = 3
    said = False
    while True:
        try:
            if not said:  # said inside the try: a Ctrl-C right after it is caught below
                said = print("running", flush=True) or True
            time.sleep(0.05)
        except KeyboardInterrupt:
            if not SWALLOW:
                raise
            print("swallowed", flush=True)  # as a library that catches KeyboardInterrupt would

SWALLOW = sys.argv.pop(1) == "swallow"
dapo.train = train
dapo.main()
"""


pytestmark = pytest.mark.timeout(1200, method="thread")  # the subprocess helpers time out first


def test_resume_takes_cpu_offload_and_the_built_in_models_limits_are_checked_first(tmp_path):
    """--cpu-offload changes where the shards live, not what is trained: a resume takes it silently. The
    built-in model's limits are checked before anything slow: 128 positions (--max-prompt-len plus
    --max-response-len), and a data file whose prompts hold characters it has no token for (letters, '?')."""
    dapo.check_resume(dataclasses.asdict(dapo.Config()), dapo.Config(cpu_offload=True))
    with pytest.raises(dapo.DapoError, match=r"^--max-prompt-len 100 \+ --max-response-len 100 exceeds the "
                                             r"built-in demo model's 128 positions: lower them, or pass --model$"):
        dapo.preflight(dapo.parse_config(["--max-prompt-len", "100", "--max-response-len", "100"]))
    data = tmp_path / "words.jsonl"
    data.write_text(json.dumps({"prompt": "What is 2 + 3?", "answer": "5"}) + "\n")
    with pytest.raises(dapo.DapoError, match=r"holds '\?Wahist', which the built-in demo model has no token for .*"
                                             r"pass --model, e.g. the laptop model") as e:
        dapo.preflight(dapo.parse_config(["--train-data", str(data)]))
    assert "\n" not in str(e.value)
    data.write_text(json.dumps({"prompt": "2+3=", "answer": "5"}) + "\n")
    dapo.preflight(dapo.parse_config(["--train-data", str(data)]))   # digits and signs: accepted


def test_flags_are_generated_from_the_config():
    cfg = dapo.parse_config(["--eps-high", "0.2", "--no-dynamic-sampling", "--model", "m", "--group-size", "4"])
    assert cfg.eps_high == 0.2 and cfg.dynamic_sampling is False and cfg.group_size == 4
    assert cfg.lr == 1e-6 and cfg.prompts_per_step == 512                  # the paper's defaults
    demo = dapo.parse_config(["--lr", "1e-4"])
    assert demo.lr == 1e-4 and demo.prompts_per_step == dapo.DEMO["prompts_per_step"]   # demo defaults


def test_help_states_what_zero_means():
    helps = _run([sys.executable, "dapo.py", "--help"], timeout=120).stdout
    helps = " ".join(helps.split())
    assert "0 = no clipping" in helps and "0 = off (the paper)" in helps


def test_presets_are_visible_and_a_flag_given_wins(tmp_path):
    """--help names what each preset sets (the add and carry tasks, each --loss); a --loss preset
    applies under the flags given; a saved demo model keeps its task's preset, a plain --model none."""
    assert "--task add: 0.0003; --task carry: 0.0002" in _flag_help("--lr")
    assert "--loss gspo: 0.0004; --loss dr_grpo: 0.2" in _flag_help("--eps-high")
    assert "gspo sets eps_low=0.0003, eps_high=0.0004; cispo sets eps_low=1.0; dr_grpo sets eps_high=0.2" in \
        _flag_help("--loss")
    gspo = dapo.parse_config(["--model", "m", "--loss", "gspo", "--eps-high", "0.001"])
    assert (gspo.eps_low, gspo.eps_high, gspo.lr) == (3e-4, 0.001, 1e-6)
    demo_model.tiny_qwen2(demo_model.DEMO_TOKENS)[0].save_pretrained(tmp_path / "plain")
    assert dapo.parse_config(["--model", str(tmp_path / "plain")]).lr == 1e-6
    demo_model.build(str(tmp_path / "demo"), demo_model.demo_task(0)[0][:50], demo_model.DEMO_TOKENS, sft_target=0.0)
    cfg = dapo.parse_config(["--model", str(tmp_path / "demo"), "--task", "carry", "--steps", "9"])
    assert (cfg.lr, cfg.max_response_len, cfg.steps) == (dapo.CARRY["lr"], dapo.CARRY["max_response_len"], 9)
    assert [name for name, _ in dapo.presets(cfg)] == ["--task carry"]


def test_a_choice_flag_is_checked_from_its_table(monkeypatch):
    """Every choice flag is checked against its table in dapo.py (CHOICES): a new entry, e.g. an advantage
    estimator, is accepted with no change in lib/ or here, and a name no table holds is refused, the message
    listing the table's names."""
    cfg = dapo.Config(adv_estimator="forked")
    names = ", ".join(dapo.ADV_ESTIMATORS)
    assert names.startswith("grpo, ")                                   # DAPO's Eq. 9 first
    with pytest.raises(dapo.DapoError, match=re.escape(f"--adv-estimator must be one of {names}, not 'forked'")):
        dapo.check_config(cfg)
    monkeypatch.setitem(dapo.ADV_ESTIMATORS, "forked", "a fork's estimator")
    dapo.check_config(cfg)
    assert set(dapo.CHOICES) >= {"task", "loss", "adv_estimator", "tis_mode", "attn_impl", "save_dtype"}
    assert all(isinstance(getattr(cfg, k), str) for k in dapo.CHOICES)


def test_a_loss_whose_name_starts_a_field_not_its_own_is_refused(monkeypatch):
    """A loss's own settings are the Config fields named `<loss>_...` whose comment starts `--loss <loss>`
    (SAPO's --sapo-tau-pos): a fork's loss named `kl` would take --kl-coef from every other loss, so it is
    refused in one line naming the field; a name that starts none (`reinforce`) passes."""
    monkeypatch.setitem(dapo.OBJECTIVES, "kl", dict(token_loss=dapo.dapo_token_loss))
    with pytest.raises(dapo.DapoError, match=re.escape("the loss 'kl' (OBJECTIVES) starts the name of --kl-coef, "
                                                       "which is not its own setting")) as e:
        dapo.check_config(dapo.Config(model="m"))
    assert "\n" not in str(e.value) and "--kl-cov-ratio" in str(e.value)   # KL-Cov's, not kl's: refused too
    monkeypatch.delitem(dapo.OBJECTIVES, "kl")
    monkeypatch.setitem(dapo.OBJECTIVES, "reinforce", dict(token_loss=dapo.dapo_token_loss))
    dapo.check_config(dapo.Config(model="m", loss="reinforce"))


@pytest.mark.parametrize("flags, message", [
    (["--tp-size", "3"], "--tp-size 3 does not divide the 1 ranks"),
    (["--group-size", "1"], "--group-size must be at least 2 (Eq. 9 needs a group) (got 1)"),
    (["--overlong-cache-len", "8", "--max-response-len", "8"], "--overlong-cache-len must lie between 0 and"),
    (["--task", "mult"], "--task must be one of add, carry, not 'mult'"),
    (["--loss", "ppo"], f"--loss must be one of {', '.join(dapo.OBJECTIVES)}, not 'ppo'"),
    (["--adv-estimator", "ppo"], f"--adv-estimator must be one of {', '.join(dapo.ADV_ESTIMATORS)}, not 'ppo'"),
    (["--attn-impl", "flash"], "--attn-impl must be one of '', flex_attention, flash_attention_2, sdpa, not 'flash'"),
    (["--save-dtype", "float16"], "--save-dtype must be one of '', bfloat16, float32, not 'float16'"),
    (["--temperature", "3"], "--temperature must lie in [0.01, 2] (vLLM's range) (got 3.0)"),
    (["--eval-temperature", "0.001"], "--eval-temperature must lie in [0.01, 2] (vLLM's range) (got 0.001)"),
    (["--dppo-anchor", "rollout", "--dppo-ratio-cap", "3"], "--dppo-ratio-cap 3.0 has no effect under --loss dapo: "
                                                            "drop it, or pass --loss dppo_tv"),
    (["--loss", "dppo_kl", "--dppo-anchor", "old"], "--dppo-anchor must be one of rollout, recompute, not 'old'"),
    (["--hf-shard-gb", "0"], "--hf-shard-gb must be positive (got 0.0)"),
    (["--gen-batch-size", "0"], "--gen-batch-size must be at least 1 (got 0)"),
    (["--prompts-per-step", "5", "--group-size", "2", "--num-mini-batches", "3"],
     "the batch of 5 x 2 responses does not split into 3 mini-batches x 1 ranks"),
    (["--dual-clip", "1"], "--dual-clip 1.0 would zero the gradient"),
    (["--dual-clip", "0.5"], "--dual-clip 0.5 would zero the gradient"),
    (["--max-gen-batches", "0"], "--max-gen-batches must be at least 1"),
    (["--top-p", "0.7"], "--top-p 0.7 in training biases the importance ratio"),
    (["--tis-cap", "0.5"], "--tis-cap must be 0 (off) or at least 1"),
    (["--max-nonfinite", "0"], "--max-nonfinite must be at least 1"),
    (["--grad-clip", "-1"], "--grad-clip must be >= 0"),
    (["--loss", "sapo", "--dual-clip", "10"], "--dual-clip 10.0 has no effect under --loss sapo: drop it"),
    (["--loss", "cispo", "--dual-clip", "10"], "--dual-clip 10.0 has no effect under --loss cispo: drop it"),
    (["--loss", "sapo", "--eps-high", "0.3"], "--eps-high 0.3 has no effect under --loss sapo"),
    (["--loss", "gspo", "--no-token-level-loss"], "--no-token-level-loss has no effect under --loss gspo"),
    (["--sapo-tau-pos", "2"], "--sapo-tau-pos 2.0 has no effect under --loss dapo: drop it, or pass --loss sapo"),
    (["--kl-coef", "-0.1"], "--kl-coef must be >= 0 (got -0.1)"),
    (["--top-entropy-quantile", "1.5"], "--top-entropy-quantile must lie in (0, 1] (got 1.5)"),
    (["--top-entropy-quantile", "0"], "--top-entropy-quantile must lie in (0, 1] (got 0.0)"),
    (["--tis-cap", "2", "--tis-min", "2"], "--tis-min 2.0 must lie below --tis-cap 2.0"),
    (["--tis-min", "0.5"], "--tis-min 0.5 needs --tis-cap: 0 turns rollout correction off"),
    (["--lora-rank", "-1"], "--lora-rank must be >= 0 (got -1)"),
    (["--lora-alpha", "nan"], "--lora-alpha must be a finite number > 0 (got nan)"),
    (["--loss", "kl_cov", "--kl-cov-coef", "inf"], "--kl-cov-coef must be a finite number > 0 (got inf)"),
    (["--loss", "clip_cov", "--clip-cov-ub", "inf"], "--clip-cov-ub must be a finite number > 0 (got inf)"),
    (["--loss", "dppo_tv", "--dppo-ratio-cap", "inf"], "--dppo-ratio-cap must be a finite number > 0 (for no "
                                                       "truncation give a large finite c, as the default 1e4) "
                                                       "(got inf)"),
    (["--kl-coef", "inf"], "--kl-coef must be a finite number >= 0 (got inf)"),
    (["--tis-mode", "seq"], "--tis-mode must be one of token_truncate, token_mask, sequence_truncate, sequence_mask, not 'seq'"),
])
def test_config_rules_each_refuse_in_one_line(flags, message):
    """Every setting that cannot run or would train wrongly is refused in one line naming the flag and the fix;
    a valid set of the same flags passes."""
    with pytest.raises(dapo.DapoError, match=re.escape(message)) as e:
        dapo.check_config(dapo.parse_config(["--model", "m", *flags]))
    assert "\n" not in str(e.value)
    dapo.check_config(dapo.parse_config(["--model", "m", "--dual-clip", "10", "--tis-cap", "2", "--grad-clip", "0"]))


@pytest.mark.parametrize("field, value", [(f.name, v) for f in _numeric_fields()
                                          for v in (0, -1) + ((float("nan"),) if f.type is float else ())])
def test_every_numeric_config_value_is_meaningful_or_refused_in_one_line(field, value):
    """Every numeric field of Config (a field added later too) at 0, -1 and (floats) nan: the
    check accepts it and --help says what 0 means, or refuses it in one line naming the flag. The
    checks run directly, on the paper's defaults (--model given), and no engine starts."""
    flag = "--" + field.replace("_", "-")
    cfg = dataclasses.replace(dapo.parse_config(["--model", "m"]), **{field: type(getattr(dapo.Config, field))(value)})
    try:
        dapo.check_config(cfg)
    except dapo.DapoError as e:
        assert flag in str(e) and "\n" not in str(e), str(e)
        return
    doc = _flag_help(flag)
    assert value == 0 and ("0 =" in doc or ">= 0" in doc), (field, value, doc)


def test_a_cpu_run_with_the_recipe_batch_is_told_what_a_step_means(tmp_path, capsys):
    """--model on a machine with no GPU, with a step sized for GPUs (the 32B recipe's batch) or generation batches
    far larger than the step (the recipe's 1,536 prompts for a step of 8): one line each, before anything slow,
    with what a step means and the flags that shrink it. A laptop-sized run, or the built-in model, gets none;
    tools/real_model.py's model takes the laptop preset (its config says so), which passes every check."""
    model = str(tmp_path / "plain")   # a plain model (a demo-built one takes the demo's preset)
    demo_model.tiny_qwen2(demo_model.DEMO_TOKENS)[0].save_pretrained(model)
    with pytest.raises(dapo.DapoError, match="max_position_embeddings"):   # the model check comes after it
        dapo.preflight(dapo.parse_config(["--model", model, "--max-prompt-len", "16"]))
    note = capsys.readouterr().out.strip()
    assert note.startswith("note: no GPU, and one step generates and trains 8,192 responses of up to 20,480 tokens "
                           "(168M tokens): on a CPU shrink the step") and "\n" not in note
    assert all(f in note for f in ("--prompts-per-step", "--group-size", "--max-response-len", "--gen-batch-size"))
    small = ["--model", model, "--max-prompt-len", "16", "--max-response-len", "64", "--overlong-cache-len", "16",
             "--prompts-per-step", "8", "--group-size", "8"]
    dapo.preflight(dapo.parse_config(small))
    note = capsys.readouterr().out.strip()
    assert note.startswith("note: no GPU, and each generation batch samples 1,536 prompts x 8 for a step of 8 "
                           "prompts (--gen-batch-size)") and "\n" not in note
    dapo.preflight(dapo.parse_config(small[:-4] + ["--prompts-per-step", "4", "--gen-batch-size", "8"]))
    dapo.preflight(dapo.parse_config([]))
    assert capsys.readouterr().out == ""
    config = json.load(open(os.path.join(model, "config.json")))
    json.dump({**config, "dapo_preset": "laptop", "max_position_embeddings": 512}, open(os.path.join(model, "config.json"), "w"))
    cfg = dapo.parse_config(["--model", model])
    laptop = dict(dapo.LAPTOP, cpu_kv_cache_gb=0.75 if dapo.LAPTOP["precision"] == "bf16" else 1.5)
    assert {k: getattr(cfg, k) for k in dapo.LAPTOP} == laptop
    for precision, kv in (("bf16", 0.75), ("fp32", 1.5)):  # the same 273 blocks of 128 tokens
        assert dapo.parse_config(["--model", model, "--precision", precision]).cpu_kv_cache_gb == kv
    assert dapo.parse_config(["--model", model, "--cpu-kv-cache-gb", "2"]).cpu_kv_cache_gb == 2.0
    dapo.check_config(cfg)
    assert dapo.cpu_batch_note(cfg) is None and dapo.presets(cfg)[0][0] == "laptop"


def test_wandb_requested_but_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)           # as if not installed
    with pytest.raises(dapo.DapoError, match="--wandb-project needs Weights & Biases: pip install wandb"):
        dapo.train(dapo.parse_config(["--wandb-project", "x"]))


def test_deterministic_is_set_before_vllm_is_imported(tiny_model):
    """--deterministic: on a GPU machine (CUDA faked up to the first import of vLLM) VLLM_BATCH_INVARIANT=1
    is in the environment when vLLM is first imported (it reads it then), and torch's deterministic
    algorithms are on; on CPU only torch's (vLLM's batch-invariant kernels are Triton's, for GPUs: on the
    CPU backend they fail in the first forward); without the flag, neither. CPU runs are deterministic
    already, so this checks the wiring only (docs/gpu.md says what a GPU would show)."""
    out = _run([sys.executable, "-c", _DETERMINISTIC_PROBE, "--model", tiny_model, "--max-prompt-len", "16",
                "--max-response-len", "8"], timeout=300)
    got = {}
    for row in (json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")):
        assert "first import of vllm" in row["stopped"], (out.stdout[-2000:], out.stderr[-2000:])
        got[row["where"], row["flag"]] = row["env"], row["torch"]
    assert got == {("cuda", "--deterministic"): ("1", True), ("cuda", "--no-deterministic"): ("", False),
                   ("cpu", "--deterministic"): ("", True)}


def test_load_data_formats(tmp_path):
    """Rows keep every column (the reward gets the whole row), with "prompt" and "answer" added: the ground truth
    as a string for the math checker. With a reward of one's own (any_answer) it stays as the file gives it, a
    dict or a list included (TinyZero's Countdown); the math checker refuses that in one line."""
    msgs = [{"role": "user", "content": "What is 1+1?"}]
    p = tmp_path / "d.parquet"
    verl = {"prompt": msgs, "reward_model": {"ground_truth": "2", "style": "rule"}, "data_source": "toy"}
    _write_parquet(p, [verl] * 3)
    assert dapo.load_data(str(p)) == [{**verl, "answer": "2"}]                  # de-duplicated
    assert len(dapo.load_data(str(p), dedup=False)) == 3
    j = tmp_path / "d.jsonl"
    j.write_text('{"problem": "1+2", "answer": 3, "level": 1}\n\n{"prompt": "2+2", "answer": "4"}\n')
    assert dapo.load_data(str(j)) == [{"problem": "1+2", "prompt": "1+2", "answer": "3", "level": 1},
                                      {"prompt": "2+2", "answer": "4"}]
    countdown = {"prompt": "Reach 46 with [3, 7, 25]", "reward_model": {"ground_truth": {"target": 46, "numbers": [3, 7, 25]}}}
    _write_parquet(p, [countdown])
    assert dapo.load_data(str(p), any_answer=True) == [{**countdown, "answer": {"target": 46, "numbers": [3, 7, 25]}}]
    j.write_text('{"prompt": "list", "answer": [1, 2]}\n')
    assert dapo.load_data(str(j), any_answer=True) == [{"prompt": "list", "answer": [1, 2]}]
    with pytest.raises(dapo.DapoError, match=r"row 0: `reward_model.ground_truth` must be a string or a number for "
                                             r"the math checker, got an object .*--reward of your own\)$"):
        dapo.load_data(str(p))


def test_data_files_users_have_load(tmp_path):
    """.json arrays, JSON Lines named .json, a UTF-8 BOM, CRLF line ends, numbers as answers,
    prompt/problem mixed across rows, a null `prompt` cell next to a `problem` column."""
    import decimal
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [{"prompt": "1+1", "answer": 2}, {"problem": "2+2.5", "answer": 4.5},
            {"prompt": [{"role": "user", "content": "3+3"}], "reward_model": {"ground_truth": 6}}]
    want = [{"prompt": "1+1", "answer": "2"}, {"prompt": "2+2.5", "answer": "4.5"},
            {"prompt": [{"role": "user", "content": "3+3"}], "answer": "6"}]
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "a.json").write_text(json.dumps(rows, indent=2))
    (tmp_path / "lines.json").write_text(lines)
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + lines.replace("\n", "\r\n").encode())
    (tmp_path / "b.jsonl").write_text(lines + "\n\n")
    want = [{**r, **w} for r, w in zip(rows, want)]                       # every column kept
    for name in ("a.json", "lines.json", "bom.jsonl", "b.jsonl"):
        assert dapo.load_data(str(tmp_path / name)) == want, name
    pq.write_table(pa.table({"prompt": ["1+1", None], "problem": [None, "2+2"],
                             "answer": pa.array([decimal.Decimal("2"), decimal.Decimal("4.5")], pa.decimal128(4, 1)),
                             "extra_info": [{"split": "train"}, None]}), tmp_path / "p.parquet")
    assert dapo.load_data(str(tmp_path / "p.parquet")) == [
        {"prompt": "1+1", "problem": None, "answer": "2.0", "extra_info": {"split": "train"}},
        {"prompt": "2+2", "problem": "2+2", "answer": "4.5", "extra_info": None}]


def test_encode_prompts_applies_a_chat_template_and_prepare_data_drops_long_prompts(capsys):
    """With a chat template the prompt is rendered by it (generation prompt added); without one the
    messages' contents are joined. The batched call gives each prompt's own ids. Prompts over
    --max-prompt-len are dropped, and none left is an error."""
    tok = demo_model.tiny_qwen2(demo_model.DEMO_TOKENS)[1]
    msgs = [{"role": "user", "content": "12+34="}]
    assert dapo.encode_prompts(tok, [msgs]) == [tok("12+34=", add_special_tokens=False)["input_ids"]]
    assert dapo.encode_prompts(tok, []) == []
    tok.chat_template = "{% for m in messages %}::{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}=={% endif %}"
    assert dapo.encode_prompts(tok, [msgs]) == [tok("::12+34===", add_special_tokens=False)["input_ids"]]
    mixed = ["12+34=", msgs, "1+1=", [{"role": "user", "content": "9+9="}]]   # a string is one user message
    assert dapo.encode_prompts(tok, mixed) == [dapo.encode_prompts(tok, [p])[0] for p in mixed]
    assert dapo.encode_prompts(tok, mixed)[0] == dapo.encode_prompts(tok, [msgs])[0]
    train = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "1234+5678=", "answer": "6912"}]
    rows, ids, held, held_ids = dapo.prepare_data(dapo.Config(max_prompt_len=8), tok, train, [])
    assert rows == train[:1] and len(ids[0]) <= 8 and held == held_ids == []
    assert capsys.readouterr().out == "train: dropped 1 prompts longer than --max-prompt-len 8\n"
    with pytest.raises(dapo.DapoError, match="^every eval prompt is longer than --max-prompt-len 8$"):
        dapo.prepare_data(dapo.Config(max_prompt_len=8), tok, train[:1], train[1:])


def test_every_malformed_data_file_is_one_line_naming_file_row_and_fix(tmp_path, capsys):
    """Every case through the command line's path (main -> preflight), in-process: exit 2, one `error:` line
    naming the file, the row and the fix."""
    for path, expect in _malformed_files(tmp_path):
        with pytest.raises(SystemExit) as e:
            dapo.main(["--train-data", path, "--out-dir", str(tmp_path / "run")])
        err = capsys.readouterr().err
        assert e.value.code == 2, (path, err)
        assert err.count("\n") == 1 and err.startswith("error: ") and path in err and re.search(expect, err), (path, err)
        assert len(err) < 600, err


def test_malformed_data_cli_one_line_no_traceback(tmp_path):
    """A few classes through the real command line, fast: refused before vLLM or the model start, one line, no
    traceback; a missing file too."""
    cases = {"latin1.jsonl": "--train-data", "prompt_object.jsonl": "--train-data", "number.json": "--eval-data",
             "missing.jsonl": "--train-data"}
    files = dict((os.path.basename(p), p) for p, _ in _malformed_files(tmp_path))
    procs = {n: subprocess.Popen([sys.executable, "dapo.py", flag, files[n]], cwd=HERE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, start_new_session=True)
             for n, flag in cases.items()}
    try:
        for name, p in procs.items():
            out, err = p.communicate(timeout=120)
            assert p.returncode == 2 and "Traceback" not in err, (name, err)
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: ") and files[name] in lines[0], (name, err)
    finally:
        for p in procs.values():
            _end_session(p)


def test_check_data_tool_runs_on_its_own(tmp_path):
    """lib/check_data.py, which dapo.py reads data through, alone: the row counts of good files;
    for a bad one the same one line as dapo.py's, and exit 2."""
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text('{"prompt": "1+1", "answer": 2}\n' * 3 + '{"problem": "2+2", "answer": "4"}\n')
    bad.write_text('{"prompt": "1+1", "answer": true}\n')
    run = [sys.executable, "lib/check_data.py"]
    out = _run(run + [str(good)], timeout=60)
    assert out.returncode == 0 and out.stdout == f"{good}: 4 rows, 2 distinct prompts\n", out
    out = _run(run + [str(good), str(bad)], timeout=60)
    with pytest.raises(dapo.DapoError) as e:
        dapo.load_data(str(bad))
    assert out.returncode == 2 and out.stderr == f"error: {e.value}\n", out
    assert "`answer` must be a string or a number for the math checker, got a boolean" in out.stderr


def test_check_data_takes_reward_before_or_after_the_files(tmp_path):
    """lib/check_data.py --reward SPEC relaxes the answer check (a dict answer, as a reward of one's own reads it)
    for every file, whether the flag comes before or after them; without it the same file is refused in one line."""
    rows = tmp_path / "code.jsonl"
    rows.write_text('{"prompt": "def f(x):", "answer": {"inputs": [1], "outputs": [2]}}\n' * 2)
    run, spec = [sys.executable, "lib/check_data.py"], "examples/code_task.py:reward"
    for argv in ([str(rows), "--reward", spec], ["--reward", spec, str(rows)]):
        out = _run(run + argv, timeout=60)
        assert out.returncode == 0 and out.stdout == f"{rows}: 2 rows, 1 distinct prompts\n", (argv, out)
    out = _run(run + [str(rows)], timeout=60)
    assert out.returncode == 2 and "must be a string or a number for the math checker" in out.stderr, out


def test_a_bad_reward_is_refused_in_one_line_before_vllm_starts(tmp_path):
    """A --reward whose module does not import (missing, a syntax error, an exception, a crash), a missing file
    or function, a function that cannot take (response, row), or a malformed spec: dapo.py exits 2 with one line
    naming it, before vLLM is imported. The module is imported by a worker process at start-up, never by the
    trainer's. A module whose import hangs is refused once its time is up (here 3 s; dapo.py allows 60)."""
    for name, text in BAD_REWARDS.items():
        (tmp_path / name).write_text(text)
    d = str(tmp_path)
    cases = {"nosuchmodule:f": "importing nosuchmodule failed (ModuleNotFoundError",
             f"{d}/syntax_error.py:f": "importing " + d + "/syntax_error.py failed (SyntaxError",
             f"{d}/raises_on_import.py:f": "failed (RuntimeError: no GPU here)",
             f"{d}/crash_on_import.py:f": "exited while loading it (exit code 3)",
             f"{d}/missing.py:f": "no such file",
             f"{d}/ok.py:two": "has no function two (it has three)",
             f"{d}/ok.py:three": "three(a, b, c) cannot be called as three(response, row)",
             "justamodule": "give module:function or path/to/file.py:function"}
    code = ("import sys, dapo\nfor spec in sys.argv[1:]:\n    try:\n        dapo.main(['--reward', spec])\n"
            "    except SystemExit as e:\n        print('exit', e.code)\n"
            "print('vllm imported' if 'vllm' in sys.modules else 'vllm never imported')\n")
    out = _run([sys.executable, "-c", code, *cases], timeout=300)
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.stdout.split() == ["exit", "2"] * len(cases) + ["vllm", "never", "imported"], out.stdout + out.stderr
    assert len(lines) == len(cases), out.stderr
    for line, (spec, why) in zip(lines, cases.items()):
        assert line.startswith(f"error: --reward {spec if ':' in spec else repr(spec)}") and why in line, (line, why)
    with pytest.raises(ValueError, match="took over 3 s"):
        reward.check_reward(f"{d}/hangs.py:f", timeout=3)


def test_unknown_model_gives_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")                  # CI has no network: do not retry the hub
    with pytest.raises(dapo.DapoError, match="cannot load model 'no/such-model-here': not a local model directory"):
        dapo.check_model("no/such-model-here")
    with pytest.raises(dapo.DapoError, match="no such model directory, or it has no config.json"):
        dapo.check_model(str(tmp_path))                        # a directory without config.json
    with pytest.raises(dapo.DapoError, match="no such model directory"):
        dapo.check_model("./models/missing")
    (tmp_path / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4}')
    with pytest.raises(dapo.DapoError, match="head_dim=16, which vLLM's CPU backend does not support"):
        dapo.check_model(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 128, "num_attention_heads": 2, '
                                          '"max_position_embeddings": 64}')
    with pytest.raises(dapo.DapoError, match="= 22528 exceeds model .* max_position_embeddings 64"):
        dapo.check_model(str(tmp_path), 22528)


def test_bad_checkpoints_fail_in_one_line(tiny_model, tmp_path):
    import torch.distributed.checkpoint as dcp
    ck = tmp_path / "checkpoints" / "step_000002"
    shutil.copytree(tiny_model, ck / "model")
    os.remove(ck / "model" / "model.safetensors")
    with pytest.raises(dapo.DapoError, match="neither model.safetensors nor model.safetensors.index.json"):
        dapo.check_checkpoint(str(ck))
    (ck / "model" / "model.safetensors.index.json").write_text("{\"weight_map\": 3}")
    with pytest.raises(dapo.DapoError, match="is not a safetensors index"):
        dapo.check_checkpoint(str(ck))
    shutil.copy(os.path.join(tiny_model, "model.safetensors"), ck / "model" / "model-00001-of-00002.safetensors")
    (ck / "model" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(dapo.DapoError, match=r"1 of the 2 weight files its index lists are missing \(first: model-00002"):
        dapo.check_checkpoint(str(ck))
    os.remove(ck / "model" / "model.safetensors.index.json")
    shutil.move(ck / "model" / "model-00001-of-00002.safetensors", ck / "model" / "model.safetensors")
    dapo.check_checkpoint(str(ck), eval_only=True)     # the export alone is enough to evaluate
    with open(ck / "model" / "model.safetensors", "r+b") as f:
        f.truncate(5000)
    with pytest.raises(dapo.DapoError, match=r"cannot read .*model.safetensors: .*\(a damaged or truncated file\?\)"):
        dapo.check_checkpoint(str(ck), eval_only=True)
    shutil.copy(os.path.join(tiny_model, "model.safetensors"), ck / "model" / "model.safetensors")
    with pytest.raises(dapo.DapoError, match="no readable dcp/.metadata"):
        dapo.check_checkpoint(str(ck))
    dcp.save({"w": torch.zeros(1000)}, checkpoint_id=str(ck / "dcp"))   # no process group: one writer
    dapo.check_checkpoint(str(ck))
    shard = next(f for f in os.listdir(ck / "dcp") if f.endswith(".distcp"))
    with open(ck / "dcp" / shard, "r+b") as f:
        f.truncate(100)
    with pytest.raises(dapo.DapoError, match=rf"dcp/{shard} is missing or truncated"):
        dapo.check_checkpoint(str(ck))
    # through the command line: a one-line error before anything slow starts
    args = ["--model", tiny_model, "--max-prompt-len", "16", "--max-response-len", "8", "--overlong-cache-len", "2",
            "--out-dir", str(tmp_path)]
    state = {"step": 2, "sampler": [0, 0], "first_eval": {}, "config": dataclasses.asdict(dapo.parse_config(args))}
    (ck / "state.json").write_text(json.dumps(state))
    out = _run([sys.executable, "dapo.py", *args, "--resume"], timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert re.fullmatch(rf"error: cannot resume from \S+: dcp/{shard} is missing or truncated .*\n", out.stderr), out.stderr


def test_resume_without_a_checkpoint_is_one_line(tmp_path):
    with pytest.raises(dapo.DapoError, match=rf"^--resume: no complete checkpoint under {tmp_path}/checkpoints$"):
        dapo.preflight(dapo.parse_config(["--resume", "--out-dir", str(tmp_path)]))


def test_resume_refuses_a_changed_config(capsys):
    """Run length, evaluation, logging, memory and limits change silently; --lr (what a mid-run error advises)
    with one note; --model, which changes what is trained, is refused, naming each difference."""
    saved = dataclasses.asdict(dapo.Config(model="a", lr=1e-6))
    dapo.check_resume(saved, dapo.Config(model="a", lr=1e-6, steps=99, eval_every=5, micro_batch_size=1,
                                         grad_checkpointing=True, max_gen_batches=20))   # silently
    assert capsys.readouterr().out == ""
    dapo.check_resume(saved, dapo.Config(model="a", lr=2e-6))
    assert capsys.readouterr().out == "resume: --lr 1e-06 -> 2e-06: from here the run differs from a straight one\n"
    with pytest.raises(dapo.DapoError, match=r"--model 'a' -> 'b'; these change what is trained: start a new run"):
        dapo.check_resume(saved, dapo.Config(model="b", lr=2e-6))


def test_dynamic_sampling_that_cannot_fill_the_batch_is_one_line_naming_the_counts_and_fixes():
    """Eq. 11's dynamic sampling out of generation batches: the error, in one line, names the counts in the
    reward's terms and the fixes. With nothing kept it stops after the first batch (at twice a keep rate of 0
    the batches left could never fill it) and does not advise more generation batches. A graded reward's
    uniform groups are counted by their value, not as all wrong; where most responses failed in the reward,
    that is named first."""
    cfg = dapo.Config(prompts_per_step=8, group_size=4, gen_batch_size=6, max_gen_batches=3)
    fn, calls = _stub_sample_fn(4)   # a third of the groups are mixed: 5 of 8 kept after 3 batches
    with pytest.raises(dapo.DapoError, match=r"kept only 5 of 8 groups after 3 generation batches \(18 groups: "
                                             r"7 all scored \+1, 6 all scored -1, 5 with rewards that differ; "
                                             r"accuracy 52.8%\)\. The data") as e:
        dapo.collect_batch(fn, dapo.Sampler(300, seed=0), cfg)
    assert "group size" in str(e.value) and "--no-dynamic-sampling" in str(e.value) and "--max-gen-batches" in str(e.value)
    assert "\n" not in str(e.value)
    assert len(calls) == 3
    fn, calls = _stub_sample_fn(4, uniform=lambda i: True)
    many = dataclasses.replace(cfg, max_gen_batches=20)
    with pytest.raises(dapo.DapoError, match=r"kept only 0 of 8 groups after 1 generation batch \(6 groups: .*"
                                             r"0 with rewards that differ; accuracy 50.0%\); no group's rewards "
                                             r"differed, so more generation batches would not fill it") as e:
        dapo.collect_batch(fn, dapo.Sampler(300, seed=0), many)
    assert "easier data" in str(e.value) and "--no-dynamic-sampling" in str(e.value) and len(calls) == 1
    assert "\n" not in str(e.value)
    assert "--max-gen-batches" not in str(e.value) and "--gen-batch-size" not in str(e.value)
    graded = [[{"score": 0.2, "success": False}] * 4] * 5 + [[{"score": -1.0, "success": False}] * 4] * 2
    said = str(dapo.too_few_groups(0, graded, 1, cfg))
    assert "(7 groups: 5 all scored +0.2, 2 all scored -1, 0 with rewards that differ; accuracy 0.0%)" in said
    failing = [[{"score": -1.0, "success": False, "failed": True}] * 4] * 5 + graded[:1]
    said = str(dapo.too_few_groups(0, failing, 1, cfg))
    assert said.startswith("20 of the 24 responses failed in the reward (reward/errors, reward/timeouts; its first "
                           "error is printed above): fix the reward first. dynamic sampling kept only 0"), said


def test_every_flag_a_mid_run_error_advises_is_taken_by_resume(capsys, monkeypatch):
    """Each error a run can stop with after its start (dynamic sampling that cannot fill the batch, too many
    non-finite steps in a row, a broken weight sync) names the flags to change; resuming with each changed is
    accepted, silently (a limit, memory) or with a one-line note (the run then differs from a straight one)."""
    cfg = dapo.Config(prompts_per_step=4, group_size=2, max_gen_batches=3)
    seen = [[{"score": 1.0, "success": True}] * 2] * 5 + [[{"score": 1.0, "success": True},
                                                            {"score": -1.0, "success": False}]]
    errors = [dapo.too_few_groups(1, seen, 3, cfg), dapo.nonfinite_error(10)]
    monkeypatch.setattr(dapo, "sync_diff_stats", lambda samples: {"sync/logp_diff_mean": 0.4})   # a broken sync
    with pytest.raises(dapo.DapoError) as e:
        dapo.check_sync(types.SimpleNamespace(cfg=dapo.Config(max_sync_diff=0.1), step=3), [])
    errors.append(e.value)
    flags = {f for e in errors for f in re.findall(r"--(?:no-)?[a-z][a-z-]+", str(e)) if f != "--resume"}
    assert len(errors) == 3 and "--max-sync-diff" in str(errors[2]) and "--resume" in str(errors[0]) + str(errors[1])
    assert flags >= {"--group-size", "--gen-batch-size", "--max-gen-batches", "--no-dynamic-sampling", "--lr",
                     "--max-nonfinite", "--max-sync-diff"}, flags
    saved = dataclasses.asdict(dapo.Config())
    for flag in sorted(flags):
        field = flag.removeprefix("--no-").removeprefix("--").replace("-", "_")
        default = getattr(dapo.Config(), field)
        changed = not default if isinstance(default, bool) else default * 2
        dapo.check_resume(saved, dataclasses.replace(dapo.Config(), **{field: changed}))   # never refused
        note = capsys.readouterr().out
        assert note == "" if field in dapo.RESUMABLE else note.startswith(f"resume: {flag.replace('no-', '')} "), note


def test_resume_takes_a_field_the_checkpoint_predates_as_its_default(capsys):
    """A checkpoint saved before --loss existed (an older dapo.py, or a fork's) resumes under the
    default, with one note; asking for another value is still a refused change."""
    saved = dataclasses.asdict(dapo.Config(model="a"))
    del saved["loss"]
    dapo.check_resume(saved, dapo.Config(model="a"))
    assert capsys.readouterr().out == "resume: the checkpoint predates --loss: it ran with the default\n"
    with pytest.raises(dapo.DapoError, match=r"--loss 'dapo' -> 'gspo'"):
        dapo.check_resume(saved, dapo.Config(model="a", loss="gspo"))


def test_interrupted_save_leaves_the_previous_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step_000002").mkdir(parents=True)
    (root / "step_000002" / "state.json").write_text("{}")
    (root / "step_000004.tmp" / "dcp").mkdir(parents=True)   # a save killed before its rename
    (root / "step_000003").mkdir()                     # no state.json: incomplete
    assert dapo.latest_checkpoint(str(tmp_path)) == str(root / "step_000002")
    assert dapo.latest_checkpoint(str(tmp_path / "none")) is None


def test_a_tp_groups_stale_shared_memory_is_named_in_one_line(monkeypatch):
    """A TP run that ended before unlink_group_shm (killed while it started, or an older dapo.py) leaves vLLM's
    /dev/shm files, and the next one cannot create them (errno 17, EEXIST): the one-line error names both
    causes and which files to delete."""
    def stale(**kw):
        raise RuntimeError("create shm in SHMManager failed. errno: 17")
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=stale))   # no real vLLM in this process
    with pytest.raises(dapo.DapoError, match=r"an earlier TP run that ended .* rm /dev/shm/-tp:\*-cpushm_\*$"):
        dapo.start_engine(dapo.Config(), "model", torch.device("cpu"))


def test_run_32b_preflight(tmp_path):
    """run_32b.sh checks each node before it starts torchrun: one line and exit 2 for a hub name
    instead of a local model, a missing data file, a loopback MASTER_ADDR on several nodes, a
    NODE_RANK out of range. A fake torchrun first on PATH records what would have been launched."""
    model, bin_ = tmp_path / "model", tmp_path / "bin"
    model.mkdir(), bin_.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    data = tmp_path / "train.parquet"
    data.write_bytes(b"")
    called = tmp_path / "torchrun_args"
    (bin_ / "torchrun").write_text(f'#!/bin/sh\necho "$@" > {called}\n')
    (bin_ / "torchrun").chmod(0o755)
    good = dict(NNODES="2", NODE_RANK="1", MASTER_ADDR="10.0.0.1", MODEL=str(model), TRAIN=str(data), EVAL=str(data))

    def run(**env):
        e = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", **good, **env}
        return _run(["bash", "run_32b.sh"], timeout=60, env=e)

    for env, msg in [(dict(TRAIN=str(tmp_path / "missing.parquet")), "data file .*missing.parquet not found on this node"),
                     (dict(MODEL="Qwen/Qwen2.5-32B"), "MODEL=Qwen/Qwen2.5-32B is not a local model directory"),
                     (dict(MASTER_ADDR="127.0.0.1"), "MASTER_ADDR=127.0.0.1 with NNODES=2"),
                     (dict(NODE_RANK="2"), r"NODE_RANK=2 must be one of 0\.\.1")]:
        out = run(**env)
        print(out.stderr.strip())
        assert out.returncode == 2 and re.fullmatch(f"error: {msg}.*\n", out.stderr), out.stderr
        assert not called.exists()
    out = run()
    assert out.returncode == 0, out.stderr
    args = called.read_text()
    print("would launch: torchrun", args[:160], "...")
    assert args.startswith("--nnodes 2 --node-rank 1 --nproc-per-node 8 --master-addr 10.0.0.1 --master-port 29500 dapo.py")
    assert f"--model {model} " in args and " --dual-clip 10 " in args and " --collective-timeout-min 180" in args


def test_a_stuck_subprocess_fails_within_its_deadline_and_leaves_nothing_running(tmp_path):
    """A torchrun whose ranks hang is killed, ranks included (they run in process sessions of
    their own), when _run's timeout expires; _wait_for fails on a silent process at its deadline."""
    script = tmp_path / "hang.py"
    script.write_text(f"import os, time\nopen(os.path.join({str(tmp_path)!r}, str(os.getpid())), 'w').close()\n"
                      "time.sleep(3600)\n")
    t = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
             timeout=10)
    ranks = [int(f.name) for f in tmp_path.iterdir() if f.name.isdigit()]
    assert len(ranks) == 2, ranks

    def alive(pid):
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    end = time.monotonic() + 10
    while any(map(alive, ranks)) and time.monotonic() < end:
        time.sleep(0.1)
    assert not any(map(alive, ranks)) and time.monotonic() - t < 60
    p, _ = _start([sys.executable, "-c", "import time; time.sleep(60)"])
    t = time.monotonic()
    try:
        with pytest.raises(AssertionError, match="no line matching 'never' within 2 s"):
            _wait_for(p, "never", 2)
        assert time.monotonic() - t < 10
    finally:
        _end_session(p)


@pytest.mark.parametrize("swallow", [False, True])
def test_ctrl_c_stops_and_second_ctrl_c_exits_at_once(tmp_path, swallow):
    """First Ctrl-C: a clean stop, one line with the step, the last checkpoint and the --resume
    command, exit 130, the reward workers gone. If the run does not stop (the interrupt is
    swallowed), a second Ctrl-C exits at once."""
    import signal
    ckpt = tmp_path / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text("{}")
    (tmp_path / "checkpoints" / "step_000003.tmp").mkdir()  # a save cut short: not complete
    script = tmp_path / "dapo_stub.py"
    script.write_text(_CTRL_C_STUB.replace("HERE", repr(HERE)))
    p, err = _start([sys.executable, str(script), "swallow" if swallow else "stop", "--out-dir", str(tmp_path),
                     "--steps", "9"])
    def second_ctrl_c():
        _wait_for(p, "swallowed", 10)
        assert p.poll() is None
        p.send_signal(signal.SIGINT)

    stderr, took = _interrupt(p, err, "running", 120, 30, second_ctrl_c if swallow else None,
                              min_alive=3)  # the run and its two reward workers
    print(f"Ctrl-C ({'second' if swallow else 'first'}) to exit: {took:.2f} s")
    assert p.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines() == [
        f"interrupted at step 3 of 9; last complete checkpoint: {ckpt} (resume with: python {script} "
        f"--out-dir {tmp_path} --steps 9 --resume)"], stderr
    assert took < 5
    assert _no_leftovers(p.pid) == []


def test_ctrl_c_stops_a_real_run_cleanly(tmp_path):
    """The demo run through vLLM + FSDP2, SIGINT mid-run: it stops within seconds, exit 130, one
    line with the step, the last complete checkpoint and the resume command, no traceback, and
    nothing it started is left running."""
    p, err = _start([sys.executable, "dapo.py", *E2E_ARGS, "--steps", "50", "--save-every", "1",
                     "--out-dir", str(tmp_path)])
    stderr, took = _interrupt(p, err, r"^step\s+2\s", 600, 60)
    print(f"Ctrl-C to exit: {took:.2f} s")
    assert p.returncode == 130, stderr[-4000:]
    assert "Traceback" not in stderr, stderr[-4000:]
    said = [line for line in stderr.splitlines() if "interrupted" in line]
    assert len(said) == 1 and stderr.rstrip().endswith(said[0]), stderr[-4000:]
    m = re.fullmatch(r"interrupted at step (\d+) of 50; last complete checkpoint: (\S+) "
                     r"\(resume with: python dapo\.py (.*) --resume\)", said[0])
    assert m, said[0]
    step, ckpt = int(m[1]), m[2]
    assert os.path.exists(os.path.join(ckpt, "state.json"))
    assert 1 <= json.load(open(os.path.join(ckpt, "state.json")))["step"] <= step  # step 2's save may be cut short
    assert f"--out-dir {tmp_path}" in m[3] and "--steps 50" in m[3]
    assert took < 20
    assert _no_leftovers(p.pid) == []


# -----------------------------------------------------------------------------------------
# Helpers

def _write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), path)


def _flag_help(flag):
    """A flag's --help text, on one line."""
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        dapo.parse_config(["--help"])
    options = out.getvalue().split("options:")[1]
    entry = re.search(rf"\n  {flag}[ ,\n](.*?)(?=\n  -)", options, re.S).group(1)
    return " ".join(entry.split())


def _malformed_files(d):
    """Data files as users meet them, written into d: [(path, what the one-line error must say)].
    The expected text includes the row (and line, for JSONL) where there is one."""
    import gzip
    import pyarrow as pa
    import pyarrow.parquet as pq
    ok = '{"prompt": "1+1", "answer": 2}\n'
    msgs = [{"role": "user", "content": "1+1"}]
    files = [
        # encodings and things that are not JSON text
        ("latin1.jsonl", (ok + '{"prompt": "caf\xe9", "answer": "1"}\n').encode("latin-1"), r"line 2 is not UTF-8 text \(byte 0xe9.*re-save the file as UTF-8"),
        ("latin1.json", '[{"prompt": "caf\xe9", "answer": "1"}]'.encode("latin-1"), r"line 1 is not UTF-8 text"),
        ("utf16.jsonl", ok.encode("utf-16"), r"is not JSON text: it is UTF-16 text: re-save it as UTF-8"),
        ("binary.jsonl", bytes(range(256)) * 8, r"is not JSON text: it is a binary file"),
        ("gzipped.jsonl", gzip.compress(ok.encode()), r"gzip-compressed: decompress it first"),
        ("empty.jsonl", b"", r"is empty: it has no rows"),
        ("blank_lines.jsonl", b"\n \n\n", r"is empty: it has no rows"),
        ("nested.jsonl", b"[" * 100000 + b"]" * 100000 + b"\n", r"line 1 is not valid JSON \(nested too deeply\)"),
        ("huge_integer.jsonl", ('{"prompt": "x", "answer": ' + "9" * 5000 + "}\n").encode(), r"line 1 is not valid JSON \(Exceeds the limit"),
        # JSONL structure
        ("truncated.jsonl", (ok + '{"prompt": "2+2", "ans').encode(), r"line 2 is not valid JSON .*the file looks truncated"),
        ("bad_line.jsonl", (ok + '{"prompt": oops}\n' + ok).encode(), r"line 2 is not valid JSON .*fix or delete this line"),
        ("pretty_array.jsonl", b'[\n  {"prompt": "1+1", "answer": 2}\n]\n', r"line 1 is not valid JSON .*name the file .json"),
        ("number_line.jsonl", (ok + "42\n").encode(), r"row 1 \(line 2\): expected an object, got a number"),
        ("array_line.jsonl", b'[{"prompt": "1+1", "answer": 2}]\n', r"row 0 \(line 1\): expected one JSON object per line, got a list \(a JSON array of rows goes in a .json file\)"),
        ("mixed_schemas.jsonl", (ok + '{"problem": "2+2", "answer": "4"}\n{"question": "3+3", "solution": "6"}\n').encode(),
         r"row 2 \(line 3\): missing columns .*found \['question', 'solution'\]"),
        # wrong types in every column
        ("prompt_object.jsonl", b'{"prompt": {"text": "1+1"}, "answer": 2}\n', r"row 0 \(line 1\): `prompt` must be a string or a non-empty list of messages, got an object"),
        ("prompt_number.jsonl", (ok + '{"prompt": 7, "answer": 2}\n').encode(), r"row 1 \(line 2\): `prompt` must be a string .*got a number"),
        ("problem_list_of_numbers.jsonl", b'{"problem": [1, 2], "answer": 2}\n', r"row 0 \(line 1\): `problem` message 0 must be \{role, content\}"),
        ("message_without_role.jsonl", b'{"prompt": [{"content": "1+1"}], "answer": 2}\n', r"`prompt` message 0 must be \{role, content\}.*keys \['content'\]"),
        ("message_content_number.jsonl", b'{"prompt": [{"role": "user", "content": 2}], "answer": 2}\n', r"`prompt` message 0 must be \{role, content\} with string values"),
        ("prompt_blank.jsonl", b'{"prompt": "  ", "answer": 2}\n', r"row 0 \(line 1\): `prompt` is empty"),
        ("prompt_empty_list.jsonl", b'{"prompt": [], "answer": 2}\n', r"`prompt` must be a string or a non-empty list"),
        ("prompt_null.jsonl", b'{"prompt": null, "answer": 2}\n', r"row 0 \(line 1\): `prompt` is null"),
        ("answer_object.jsonl", b'{"prompt": "1+1", "answer": {"value": 2}}\n', r"row 0 \(line 1\): `answer` must be a string or a number for the math checker, got an object"),
        ("answer_list.jsonl", b'{"prompt": "1+1", "answer": [2]}\n', r"`answer` must be a string or a number for the math checker, got a list"),
        ("answer_bool.jsonl", b'{"prompt": "1+1", "answer": true}\n', r"`answer` must be a string or a number for the math checker, got a boolean"),
        ("answer_null.jsonl", b'{"prompt": "1+1", "answer": null}\n', r"`answer` is null"),
        ("answer_nan.jsonl", b'{"prompt": "1+1", "answer": NaN}\n', r"`answer` is nan"),
        ("answer_blank.jsonl", b'{"prompt": "1+1", "answer": " "}\n', r"row 0 \(line 1\): empty answer"),
        ("reward_model_string.jsonl", b'{"prompt": "1+1", "reward_model": "2"}\n', r"`reward_model` must be an object"),
        ("reward_model_no_ground_truth.jsonl", b'{"prompt": "1+1", "reward_model": {"style": "rule"}}\n', r"`reward_model` has no `ground_truth`"),
        ("no_answer.jsonl", b'{"prompt": "1+1"}\n', r"row 0 \(line 1\): missing columns \(`answer`/`reward_model`\)"),
        # .json
        ("object.json", b'{"data": [{"prompt": "1+1", "answer": 2}], "version": 1}', r"holds an object, not an array of rows.*keys: \['data', 'version'\]"),
        ("number.json", b"42", r"holds a number, not an array of rows"),
        ("null.json", b"null", r"holds null, not an array of rows"),
        ("empty_array.json", b"[]", r"has no rows"),
        ("truncated.json", b'[{"prompt": "1+1", "answer": 2}, {"prompt": "2+', r"is not valid JSON .*the file looks truncated"),
        ("array_with_number.json", b'[{"prompt": "1+1", "answer": 2}, 3]', r"row 1: expected an object, got a number"),
        ("nested_arrays.json", b'[[{"prompt": "1+1", "answer": 2}]]', r"row 0: expected an object, got a list"),
        # parquet and file names
        ("garbage.parquet", bytes(range(256)) * 8, r"cannot read parquet file .*re-download or re-export it"),
        ("json_named.parquet", ok.encode(), r"holds JSON, not parquet: name it .jsonl"),
        ("parquet_named.jsonl", None, r"is not JSON text: it is a parquet file: name it .parquet"),
        ("data.csv", b"prompt,answer\n1+1,2\n", r"unknown data format"),
        ("data", ok.encode(), r"unknown data format"),
    ]
    tables = [
        ("prompt_int.parquet", {"prompt": [1, 2], "answer": ["1", "2"]}, r"row 0: `prompt` must be a string .*got a number"),
        ("prompt_bytes.parquet", {"prompt": [b"1+1"], "answer": ["2"]}, r"row 0: `prompt` must be a string .*got binary data"),
        ("prompt_null.parquet", {"prompt": [msgs, None], "answer": ["2", "3"]}, r"row 1: `prompt` is null"),
        ("answer_nan.parquet", {"prompt": ["1+1", "2+2"], "answer": [2.0, float("nan")]}, r"row 1: `answer` is nan"),
        ("answer_bool.parquet", {"prompt": ["1+1"], "answer": [True]}, r"row 0: `answer` must be a string or a number for the math checker, got a boolean"),
        ("ground_truth_list.parquet", {"prompt": [msgs], "reward_model": [{"ground_truth": [1, 2]}]},
         r"row 0: `reward_model.ground_truth` must be a string or a number for the math checker, got a list"),
        ("reward_model_string.parquet", {"prompt": [msgs], "reward_model": ["2"]}, r"row 0: `reward_model` must be an object"),
        ("wrong_columns.parquet", {"question": ["1+1"], "solution": ["2"]}, r"row 0: missing columns .*found \['question', 'solution'\]"),
    ]
    out = []
    for name, data, expect in files:
        if data is not None:
            (d / name).write_bytes(data)
        out.append((str(d / name), expect))
    for name, cols, expect in tables:
        pq.write_table(pa.table(cols), d / name)
        out.append((str(d / name), expect))
    good = (d / "prompt_int.parquet").read_bytes()
    (d / "parquet_named.jsonl").write_bytes(good)
    (d / "truncated.parquet").write_bytes(good[: len(good) // 2])
    out.append((str(d / "truncated.parquet"), r"cannot read parquet file"))
    (d / "a_directory.jsonl").mkdir()
    out.append((str(d / "a_directory.jsonl"), r"is a directory, not a data file"))
    out.append((str(d / "missing.jsonl"), r"data file not found"))
    return out


def _alive_in_session(sid):
    """Processes (not zombies) in session sid: the run and everything it started."""
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            alive.append(int(pid))
    return alive


def _no_leftovers(sid, within=10.0):
    end = time.monotonic() + within
    while _alive_in_session(sid) and time.monotonic() < end:
        time.sleep(0.1)
    return _alive_in_session(sid)


def _start(cmd):
    """cmd in its own session (as a terminal would); its stdout lines go to p.lines (a queue), its
    stderr is collected."""
    import queue
    import threading
    p = subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    err, p.lines = [], queue.Queue()
    threading.Thread(target=lambda: err.append(p.stderr.read()), daemon=True).start()
    threading.Thread(target=lambda: [p.lines.put(line) for line in p.stdout], daemon=True).start()
    return p, err


def _wait_for(p, pattern, timeout):
    """Until a stdout line matches, or fail after `timeout` seconds, silent process or not."""
    import queue
    end, seen = time.monotonic() + timeout, []
    while not (seen and re.search(pattern, seen[-1])):
        try:
            seen.append(p.lines.get(timeout=max(0.0, end - time.monotonic())))
        except queue.Empty:
            raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n" + "".join(seen)[-3000:])


def _end_session(p):
    """After a test, passed or failed: leave nothing running (the process session, and any process it
    started in another one)."""
    import signal
    if p.poll() is None:
        interrupt.kill_children(p.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _interrupt(p, err, ready, ready_timeout, exit_timeout, then=None, min_alive=0):
    """Wait for `ready` on p's stdout, send SIGINT (and run `then`, e.g. a second one), wait for
    the exit, clean up. Returns (stderr, seconds from the last SIGINT to the exit)."""
    import signal
    try:
        _wait_for(p, ready, ready_timeout)
        print("processes during the run:", _alive_in_session(p.pid))
        assert len(_alive_in_session(p.pid)) >= min_alive
        p.send_signal(signal.SIGINT)
        t = time.monotonic()
        if then:
            then()
            t = time.monotonic()
        p.wait(timeout=exit_timeout)
        took = time.monotonic() - t
    finally:
        _end_session(p)
    time.sleep(0.2)
    return (err[0] if err else ""), took
