"""
check_data.py: check what dapo.py is given (data files, a model, a checkpoint), as dapo.py does
before it starts anything slow.

    python lib/check_data.py data/dapo-math-17k.parquet data/aime-2024.parquet
    python lib/check_data.py --model models/Qwen2.5-32B --checkpoint runs/dapo/checkpoints/step_000100
    python lib/check_data.py --reward examples/countdown.py:reward data/countdown.jsonl

A data file is a parquet table in the verl schema (DAPO-Math-17k, AIME-2024), JSON Lines, or a .json
array. Each row gives `prompt` (or `problem`): a string or a list of {role, content} messages, and
`reward_model.ground_truth` (or `answer`): a string or a number for the math checker; with a reward of one's
own (`--reward SPEC`, before or after the files), any value (an object, a list). Every other column is kept
for the reward. A model is a Hugging Face directory
(config.json, safetensors weights) or hub name; a checkpoint is dapo.py's checkpoints/step_N. A good
input prints what it holds; a bad one prints one line naming the file, the row and the fix, and
exits 2.
"""

import dataclasses
import functools
import importlib.util
import json
import math
import os
import re
import sys


class InputError(ValueError):
    """An input dapo.py cannot use (a data file, model, checkpoint or setting); the message is one line
    naming it, and the fix. dapo.py calls it DapoError."""


def one_line(e, limit=200):
    """An exception's message on one line, cut to `limit` characters."""
    return " ".join(str(e).split())[:limit]


DATA_FORMATS = ("give a .parquet file in the verl schema, a .jsonl file with one JSON object per line, "
                "or a .json file holding an array of objects")
ROW_SCHEMA = ("each row needs `prompt` (or `problem`): a string or a list of {role, content} messages, "
              "and `answer` (or `reward_model.ground_truth`): a string or a number (any value with a --reward "
              "of one's own)")
NOT_JSON = {b"PAR1": "it is a parquet file: name it .parquet",  # what a file starts with
            b"\x1f\x8b": "it is gzip-compressed: decompress it first (gunzip)",
            b"PK\x03\x04": "it is a zip archive: extract it first",
            b"\xff\xfe": "it is UTF-16 text: re-save it as UTF-8",
            b"\xfe\xff": "it is UTF-16 text: re-save it as UTF-8"}


def _kind(v):
    """A value's type in the user's (JSON) words."""
    names = {dict: "an object", list: "a list", tuple: "a list", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", bytes: "binary data", type(None): "null"}
    return names.get(type(v), type(v).__name__)


def _json_error(e, with_line=True):
    """A JSON parse error in a few words."""
    if isinstance(e, RecursionError):  # absurdly nested arrays
        return "nested too deeply"
    if not isinstance(e, json.JSONDecodeError):  # e.g. an integer of too many digits
        return str(e).split(";")[0][:100]
    where = f"line {e.lineno} column {e.colno}" if with_line else f"column {e.colno}"
    return f"{e.msg}: {where}"


def _read_text(path):
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8-sig")  # a UTF-8 BOM is fine
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - data.rfind(b"\n", 0, e.start)
        raise InputError(f"{path} line {line} is not UTF-8 text (byte 0x{data[e.start]:02x} at column "
                         f"{column}): re-save the file as UTF-8, e.g. iconv -f latin1 -t utf-8")


def _jsonl_rows(path, text):
    rows, lines = [], text.split("\n")
    for ln, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as e:  # RecursionError: absurdly nested arrays
            fix = ("the file looks truncated: re-download it, or delete this last line" if ln == len(lines)
                   else "a pretty-printed JSON array? name the file .json" if ln == 1 and line.strip() == "["
                   else "each line must be one complete JSON object: fix or delete this line")
            raise InputError(f"{path} line {ln} is not valid JSON ({_json_error(e, False)}): {fix}")
        if isinstance(row, list) and path.lower().endswith(".jsonl"):
            raise InputError(f"{path} row {len(rows)} (line {ln}): expected one JSON object per line, got a "
                             f"list (a JSON array of rows goes in a .json file)")
        rows.append((row, f"row {len(rows)} (line {ln})"))
    return rows


def read_rows(path):
    """[(row, where)] from a .parquet, .jsonl or .json file; `where` names the row (and line)."""
    if not os.path.exists(path):
        raise InputError(f"data file not found: {path} ({DATA_FORMATS})")
    if os.path.isdir(path):
        raise InputError(f"{path} is a directory, not a data file ({DATA_FORMATS})")
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".parquet", ".jsonl", ".json"):
        raise InputError(f"unknown data format: {path} ({DATA_FORMATS})")
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror} (check the path and its permissions)")
    if not head.strip():
        raise InputError(f"{path} is empty: it has no rows ({DATA_FORMATS})")
    if ext == ".parquet":
        if head.lstrip()[:1] in (b"{", b"["):
            raise InputError(f"{path} holds JSON, not parquet: name it .jsonl (one object per line) "
                             f"or .json (an array)")
        import pyarrow.parquet as pq
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:
            why = str(e).strip().split("\n")[0][:200]
            raise InputError(f"cannot read parquet file {path}: {why} (is it a complete parquet file? "
                             f"re-download or re-export it, e.g. with pandas.DataFrame.to_parquet)")
        return [(row, f"row {i}") for i, row in enumerate(rows)]
    wrong = next((why for magic, why in NOT_JSON.items() if head.startswith(magic)), None)
    if wrong is None and b"\x00" in head:
        wrong = "it is a binary file (it holds NUL bytes): give the JSON data file"
    if wrong:
        raise InputError(f"{path} is not JSON text: {wrong}")
    text = _read_text(path)
    if ext == ".jsonl":
        return _jsonl_rows(path, text)
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        if isinstance(e, json.JSONDecodeError) and e.msg == "Extra data":
            return _jsonl_rows(path, text)  # JSON Lines named .json (what datasets' to_json writes)
        fix = ("fix the JSON at that place" if text.rstrip().endswith(("]", "}"))
               else "the file looks truncated: re-download or re-export it")
        raise InputError(f"{path} is not valid JSON ({_json_error(e)}): {fix}")
    if not isinstance(doc, list):
        keys = ""
        if isinstance(doc, dict):
            keys = f" (its keys: {sorted(doc)[:8]}; if the rows are under one of them, save that array alone)"
        raise InputError(f"{path} holds {_kind(doc)}, not an array of rows: write it as "
                         f"[{{\"prompt\": ..., \"answer\": ...}}, ...] or as JSON Lines (.jsonl){keys}")
    return [(row, f"row {i}") for i, row in enumerate(doc)]


def check_row(row, at, any_answer=False):
    """The row, every column kept, with "prompt": `prompt` (else `problem`), a string or chat messages, and
    "answer": `reward_model.ground_truth` (else `answer`), for the math checker a string or a finite number
    (as a string); any_answer (a reward of one's own): any value but null, as the file gives it."""
    import decimal
    if not isinstance(row, dict):
        raise InputError(f"{at}: expected an object, got {_kind(row)} ({ROW_SCHEMA})")
    missing = []
    for names in (("prompt", "problem"), ("answer", "reward_model")):
        if all(row.get(c) is None for c in names):
            nulls = [c for c in names if c in row]  # a null cell: e.g. a parquet row with a gap
            if nulls:
                raise InputError(f"{at}: `{nulls[0]}` is null (an empty cell): fill it in or drop the row")
            missing.append(f"`{names[0]}`/`{names[1]}`")
    if missing:
        raise InputError(f"{at}: missing columns ({' and '.join(missing)}); need `prompt` (chat messages) "
                         f"and `reward_model.ground_truth` (verl parquet), or `prompt`/`problem` and `answer` "
                         f"(JSONL); found {sorted(map(str, row))[:12]}")
    name = "prompt" if row.get("prompt") is not None else "problem"
    prompt = row[name]
    fix = "give the question as a string, or as a list of {\"role\": ..., \"content\": ...} messages"
    if not isinstance(prompt, (str, list)) or prompt == []:
        raise InputError(f"{at}: `{name}` must be a string or a non-empty list of messages, "
                         f"got {_kind(prompt)} ({fix})")
    for k, m in enumerate(prompt if isinstance(prompt, list) else []):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            got = f"an object with keys {sorted(map(str, m))[:6]}" if isinstance(m, dict) else _kind(m)
            raise InputError(f"{at}: `{name}` message {k} must be {{role, content}} with string values, "
                             f"got {got} ({fix})")
    text = prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt)
    if not text.strip():
        empty = "is empty" if isinstance(prompt, str) else "messages are all empty"
        raise InputError(f"{at}: `{name}` {empty} ({fix})")
    rm = row.get("reward_model")
    if rm is not None and not isinstance(rm, dict):
        raise InputError(f"{at}: `reward_model` must be an object like {{\"ground_truth\": \"42\"}}, "
                         f"got {_kind(rm)}")
    name = "reward_model.ground_truth" if rm and rm.get("ground_truth") is not None else "answer"
    answer = rm["ground_truth"] if name != "answer" else row.get("answer")
    if answer is None:
        raise InputError(f"{at}: `reward_model` has no `ground_truth` and the row has no `answer` "
                         f"(give the expected final answer in one of them)")
    if any_answer:
        return {**row, "prompt": prompt, "answer": answer}
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float, decimal.Decimal)):
        raise InputError(f"{at}: `{name}` must be a string or a number for the math checker, got "
                         f"{_kind(answer)} (give the expected final answer, e.g. \"42\", or score it with "
                         f"a --reward of your own)")
    if isinstance(answer, (float, decimal.Decimal)) and not math.isfinite(answer):
        raise InputError(f"{at}: `{name}` is {answer} (give the expected final answer as a string or a "
                         f"finite number)")
    if not str(answer).strip():
        raise InputError(f"{at}: empty answer (`{name}` is blank: give the expected final answer)")
    return {**row, "prompt": prompt, "answer": str(answer).strip()}


def read(path, any_answer=False):
    """Every row of the file, checked (check_row): its columns, "prompt" and "answer"."""
    rows = [check_row(row, f"{path} {where}", any_answer) for row, where in read_rows(path)]
    if not rows:
        raise InputError(f"{path} has no rows ({DATA_FORMATS})")
    return rows


def distinct(rows):
    """The first row of each prompt (DAPO-Math-17k holds each one ~100 times)."""
    first = {}
    for row in rows:
        first.setdefault(json.dumps(row["prompt"], sort_keys=True, default=str), row)
    return list(first.values())


def load(path, dedup=True, any_answer=False):
    """A data file's rows; dedup keeps the first of repeated prompts (DAPO-Math-17k repeats each ~100x)."""
    rows = read(path, any_answer)
    return distinct(rows) if dedup else rows


# -----------------------------------------------------------------------------------------
# Models and checkpoints

CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM 0.32 CPU attention


def check_model(path, max_len=None):
    """Fail early, in one line, on a model neither transformers nor vLLM could load."""
    import torch
    from transformers import AutoConfig
    local = os.path.isdir(path) or path.startswith((".", "/", "~")) or path.count("/") > 1
    if local and not os.path.isfile(os.path.join(os.path.expanduser(path), "config.json")):
        raise InputError(f"cannot load model '{path}': no such model directory, or it has no config.json "
                         f"(give a Hugging Face model directory or a hub name such as Qwen/Qwen2.5-7B)")
    try:
        config = AutoConfig.from_pretrained(os.path.expanduser(path))
    except Exception as e:
        raise InputError(f"cannot load model '{path}': not a local model directory and not on the Hugging "
                         f"Face hub or in its cache ({one_line(e)})")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if not torch.cuda.is_available() and head_dim not in CPU_HEAD_DIMS:
        raise InputError(f"model '{path}' has head_dim={head_dim}, which vLLM's CPU backend does not "
                         f"support (use one of {CPU_HEAD_DIMS}, or run on a GPU)")
    limit = getattr(config, "max_position_embeddings", None)
    if max_len and limit and max_len > limit:
        raise InputError(f"--max-prompt-len + --max-response-len = {max_len} exceeds model '{path}''s "
                         f"max_position_embeddings {limit}: lower them")
    return config


def hf_weight_files(path):
    """A Hugging Face model's safetensors files and {tensor name: shape}, each file checked to be there
    and complete (a hub name is downloaded first)."""
    from safetensors import safe_open
    if not os.path.isdir(path):
        from huggingface_hub import snapshot_download
        try:
            path = snapshot_download(path, allow_patterns=["*.safetensors", "*.json"])
        except Exception as e:
            raise InputError(f"cannot download model '{path}' ({one_line(e)})")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise InputError(f"{index} is not a safetensors index ({type(e).__name__}: {e})")
    elif os.path.exists(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise InputError(f"no weights in '{path}': it has neither model.safetensors nor "
                         f"model.safetensors.index.json (only safetensors checkpoints are supported)")
    missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise InputError(f"'{path}' is incomplete: {len(missing)} of the {len(files)} weight files its index "
                         f"lists are missing (first: {missing[0]})")
    files, shapes = [os.path.join(path, f) for f in files], {}
    for f in files:
        try:  # reads the header only; safetensors checks that the file covers it (not truncated)
            with safe_open(f, "pt") as r:
                shapes.update({k: r.get_slice(k).get_shape() for k in r.keys()})
        except Exception as e:
            raise InputError(f"cannot read {f}: {one_line(e)} (a damaged or truncated file?)")
    return files, shapes


def check_weights(path, shapes, tied=False):
    """A model directory's weight files, once its tensors' names and shapes are checked against the
    model's ({name: shape}; a tied lm_head is stored once, as the embedding)."""
    files, have = hf_weight_files(path)
    missing = [k for k in shapes if k not in have and not (tied and k == "lm_head.weight")]
    wrong = [f"{k} {have[k]} (model: {shapes[k]})" for k in shapes if k in have and have[k] != shapes[k]]
    if missing or wrong:
        raise InputError(f"the weights in '{path}' do not fit its config: {len(missing)} tensors missing "
                         f"{missing[:3]}, {len(wrong)} of the wrong shape {wrong[:3]}")
    return files


def step_dirs(root):
    """The step_N folders under a run's checkpoints/, oldest first."""
    return sorted(d for d in os.listdir(root) if re.fullmatch(r"step_\d+", d)) if os.path.isdir(root) else []


def latest_checkpoint(out_dir):
    """The newest complete checkpoint (renamed, with state.json), or None."""
    root = os.path.join(out_dir, "checkpoints")
    done = [d for d in step_dirs(root) if os.path.exists(os.path.join(root, d, "state.json"))]
    return os.path.join(root, done[-1]) if done else None


def check_checkpoint(ckpt, eval_only=False):
    """Fail in one line, before anything slow starts, on a checkpoint with a file missing or cut short."""
    import torch.distributed.checkpoint as dcp
    hf_weight_files(os.path.join(ckpt, "model"))
    if eval_only:
        return
    d = os.path.join(ckpt, "dcp")
    try:
        meta = dcp.FileSystemReader(d).read_metadata()
    except Exception:
        raise InputError(f"cannot resume from {ckpt}: no readable dcp/.metadata (the model and optimizer "
                         f"state; a damaged checkpoint, or one from an older dapo.py): delete it to resume "
                         f"from the one before")
    need = {}  # the bytes each file must hold
    for info in meta.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    paths = {f: os.path.join(d, f) for f in need}
    bad = [f for f, n in need.items() if not os.path.isfile(paths[f]) or os.path.getsize(paths[f]) < n]
    if bad:
        raise InputError(f"cannot resume from {ckpt}: dcp/{bad[0]} is missing or truncated ({len(bad)} of "
                         f"{len(need)} files): delete this checkpoint to resume from the one before")



# -----------------------------------------------------------------------------------------
# dapo.py's config: each field's range stands in braces in its comment, beside the field

@functools.lru_cache(maxsize=None)  # inspect parses the whole module's source for each class: ~0.25 s a call
def field_helps(cls):
    """Each field of a Config dataclass: its comment (its --help), with the lines below it that start with
    `#  ` (two spaces)."""
    import inspect
    source = "".join(inspect.getsource(c) for c in cls.__mro__ if dataclasses.is_dataclass(c))
    helps = {}
    for name, first, more in re.findall(r"^\s+(\w+):[^#\n]*#\s*(.*)\n((?:[ \t]+#  .*\n)*)", source, re.M):
        helps[name] = " ".join([first] + re.findall(r"#\s*(.*)", more))
    return helps


def field_range(help):
    """A numeric field's range, from the braces in its comment: {>= 1}, {> 0}, {(0, 1]} or {[0, 1]},
    each optionally followed by ': why'. None: >= 0. Returns (low, low open?, high or None, spec, why)."""
    m = re.search(r"\{([^{}:]*)(?::\s*([^{}]*))?\}", help)
    if not m:
        return 0.0, False, None, ">= 0", ""
    spec, why = m.group(1).strip(), f" ({m.group(2).strip()})" if m.group(2) else ""
    if spec.startswith(">"):
        return float(spec.lstrip(">= ")), not spec.startswith(">="), None, spec, why
    low, high = spec[1:-1].split(",")
    return float(low), spec.startswith("("), float(high), spec, why


def _out_of_range(flag, value, help):
    """Why a numeric field's value is refused, with the why of its range where the comment gives one, or None.
    inf and nan are refused as not finite: a range with no upper bound still means a number."""
    low, open_low, high, spec, why = field_range(help)
    inside = (value > low if open_low else value >= low) and (high is None or value <= high)
    if math.isfinite(value) and inside:
        return None
    if high is not None:
        return f"{flag} must lie in {spec}{why} (got {value})"
    if not math.isfinite(value):
        return f"{flag} must be a finite number {spec}{why} (got {value})"
    if open_low and low == 0:
        return f"{flag} must be positive{why} (got {value})"
    return f"{flag} must be {f'at least {low:g}' if low else '>= 0'}{why} (got {value})"


def _ignored(cfg, losses):
    """The settings cfg.loss has no use for, given at other than their defaults: the shared flags its
    OBJECTIVES entry ignores, and another loss's own settings (the Config fields named after it, or its "own")."""
    default, ignores = type(cfg)(), losses.get(cfg.loss, {}).get("ignores", ())
    out = []
    for f in dataclasses.fields(cfg):
        owners = [k for k in losses if f.name.startswith(k + "_") or f.name in losses[k].get("own", ())]
        value, owner = getattr(cfg, f.name), cfg.loss if cfg.loss in owners or not owners else owners[0]
        if (f.name in ignores or owner != cfg.loss) and value != getattr(default, f.name):
            given = "--" + ("no-" if value is False else "") + f.name.replace("_", "-")
            given += "" if isinstance(value, bool) else f" {value}"
            out.append(f"{given} has no effect under --loss {cfg.loss}: drop it" +
                       (f", or pass --loss {owner}" if owner != cfg.loss else ""))
    return out


def _captured(cfg, losses, helps):
    """A loss's own settings are the Config fields named `<loss>_...` whose comment starts `--loss <loss>`:
    a loss whose name starts another field (a loss `kl` and --kl-coef, `tis` and --tis-cap) would take it
    from every other loss. One line for each such field."""
    return [f"the loss {k!r} (OBJECTIVES) starts the name of --{f.name.replace('_', '-')}, which is not its own "
            f"setting (its comment does not start '--loss {k}'): rename the loss"
            for k in losses for f in dataclasses.fields(cfg)
            if f.name.startswith(k + "_") and not re.match(rf"--loss {re.escape(k)}\b", helps.get(f.name, ""))]


def check_config(cfg, losses, choices):
    """dapo.py's Config: refuse, in one line naming each flag, its value and the range it must lie in,
    settings that cannot run or would silently train wrongly: every numeric field finite and in the range
    its comment gives (field_range), every choice flag one of its table's names (choices: {field: names},
    dapo.py's CHOICES), no setting the chosen --loss ignores (losses: dapo.py's OBJECTIVES), no loss whose name
    starts a field not its own (_captured), and the rules below."""
    helps = field_helps(type(cfg))
    problems = [_out_of_range("--" + f.name.replace("_", "-"), getattr(cfg, f.name), helps.get(f.name, ""))
                for f in dataclasses.fields(cfg) if type(getattr(cfg, f.name)) in (int, float)]
    problems += [f"--{k.replace('_', '-')} must be one of {', '.join(n or repr(n) for n in names)}, not "
                 f"{getattr(cfg, k)!r}" for k, names in choices.items() if getattr(cfg, k) not in names]
    ws = int(os.environ.get("WORLD_SIZE", "1"))
    rules = [
        (cfg.attn_impl == "flash_attention_2" and not importlib.util.find_spec("flash_attn"),
         "--attn-impl flash_attention_2 needs the flash-attn package (pip install flash-attn)"),
        (cfg.wandb_project and not importlib.util.find_spec("wandb"),
         "--wandb-project needs Weights & Biases: pip install wandb"),
        (cfg.dual_clip < 0 or 0 < cfg.dual_clip <= 1,
         f"--dual-clip {cfg.dual_clip} would zero the gradient of every A < 0 token: give c > 1 (the "
         f"reference run used 10) or 0 for off"),
        (cfg.tis_cap < 0 or 0 < cfg.tis_cap < 1,
         f"--tis-cap must be 0 (off) or at least 1 (verl and TRL use 2 and 3), not {cfg.tis_cap}"),
        (cfg.tis_min > 0 and not cfg.tis_cap, f"--tis-min {cfg.tis_min} needs --tis-cap: 0 turns rollout "
                                              f"correction off"),
        (cfg.tis_cap and cfg.tis_min >= cfg.tis_cap,
         f"--tis-min {cfg.tis_min} must lie below --tis-cap {cfg.tis_cap}: no weight would be in bounds"),
        (cfg.top_p != 1.0, f"--top-p {cfg.top_p} in training biases the importance ratio (the old log-probs "
                           f"ignore the truncation): use 1.0; --eval-top-p sets evaluation"),
        (cfg.precision == "bf16" and cpu_lacks_bf16(), "--precision bf16: this CPU has no bf16 instructions "
                                                       "(avx512_bf16 or AMX), so bf16 would run slower than fp32: "
                                                       "use --precision fp32, or a GPU"),
    ]
    if not any(problems) and not cfg.eval_only:  # these need valid numbers, and matter for training
        rules += [
            (ws % cfg.tp_size, f"--tp-size {cfg.tp_size} does not divide the {ws} ranks"),
            ((cfg.prompts_per_step * cfg.group_size) % (cfg.num_mini_batches * ws),
             f"the batch of {cfg.prompts_per_step} x {cfg.group_size} responses does not split into "
             f"{cfg.num_mini_batches} mini-batches x {ws} ranks"),
            (cfg.soft_overlong_punishment and not 0 < cfg.overlong_cache_len < cfg.max_response_len,
             "--overlong-cache-len must lie between 0 and --max-response-len"),
        ]
    problems = [p for p in problems if p] + [message for broken, message in rules if broken]
    captured = _captured(cfg, losses, helps)  # before _ignored, which would misread such a field
    problems += captured
    if cfg.loss in losses and not captured:
        problems += _ignored(cfg, losses)
    if problems:
        raise InputError("; ".join(problems))


def cpu_lacks_bf16():
    """True on an x86 CPU, with no GPU, that torch finds without bf16 instructions (avx512_bf16 or AMX); on other
    CPUs torch cannot tell."""
    import platform
    import torch
    if torch.cuda.is_available() or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def cpu_batch_note(cfg):
    """One line for a CPU user whose --model run is sized for GPUs, or None: a step of more than 2^16 response
    tokens (the 32B recipe's is 168M; on 2 cores a ~100M model trains ~1k tokens in 10 s), or, with dynamic
    sampling, generation batches of more than 4x the step's prompts (its default is the recipe's 1,536)."""
    import torch
    if not cfg.model or torch.cuda.is_available():
        return None
    n, tokens = cfg.prompts_per_step * cfg.group_size, cfg.prompts_per_step * cfg.group_size * cfg.max_response_len
    big = [f"one step generates and trains {n:,} responses of up to {cfg.max_response_len:,} tokens "
           f"({tokens / 1e6:.3g}M tokens)"] if tokens > 2**16 else []
    if cfg.dynamic_sampling and cfg.gen_batch_size > 4 * cfg.prompts_per_step:
        big.append(f"each generation batch samples {cfg.gen_batch_size:,} prompts x {cfg.group_size} for a step "
                   f"of {cfg.prompts_per_step} prompts (--gen-batch-size)")
    if not big:
        return None
    return (f"note: no GPU, and {'; '.join(big)}: on a CPU shrink the step with --prompts-per-step, --group-size, "
            f"--max-response-len, --num-mini-batches and --gen-batch-size (about 2x --prompts-per-step); "
            f"tools/real_model.py's model comes with a laptop preset (python dapo.py --help)")


def main(args):
    any_answer = any(kind == "--reward" for kind, _ in args)  # the files are scored by a reward of one's own
    try:
        for kind, path in args:
            if kind == "--reward":
                continue
            elif kind == "--model":
                print(f"{path}: {len(hf_weight_files(path)[1])} tensors, "
                      f"{check_model(path).model_type} model")
            elif kind == "--checkpoint":
                check_checkpoint(path)
                print(f"{path}: complete")
            else:
                rows = read(path, any_answer)
                print(f"{path}: {len(rows)} rows, {len(distinct(rows))} distinct prompts")
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    argv = sys.argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0 if argv else 2)
    args = []
    while argv:
        kind = argv.pop(0)
        args.append((kind, argv.pop(0) if kind in ("--model", "--checkpoint", "--reward") and argv else kind))
    sys.exit(main(args))
