"""End to end: the demo through vLLM + FSDP2 + the weight sync, on 1 and 2 ranks and TP 2; a resume after a failed
save equals a straight run bit for bit; a broken sync stops the run."""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
import contextlib
import json
import math
import re
import shutil
import pytest
import dapo
from tests.shared import E2E_ARGS, HERE, _dapo, _dcp_model, _logprob_change, _run, _torchrun


# One process, 4 steps, saved after each: test_end_to_end_single_process checks the run, and
# test_resume_after_a_failed_save_reproduces_a_straight_run resumes a run that fails to save against it.
STRAIGHT = ["--steps", "4", "--warmup-steps", "2", "--save-every", "1", "--keep-checkpoints", "3",
            "--hf-shard-gb", "0.0002", "--kl-coef", "0.05",   # the KL reference: see the resume test
            "--carry-surplus", "--skip-solved", "1"]          # a surplus buffer and a record to checkpoint


_SAVE_FAILS = r"""
import os, sys
sys.path.insert(0, HERE)
import dapo
rename = os.rename


def failing(src, dst):  # step 3's save dies after writing everything, before its commit point
    if str(src).endswith("step_000003.tmp"):
        raise OSError(28, "No space left on device (injected by the test)")
    return rename(src, dst)


os.rename = failing
dapo.main()
"""


pytestmark = pytest.mark.timeout(1200, method="thread")  # the subprocess helpers time out first


def test_end_to_end_single_process(straight_run):
    """Also the learning-rate warm-up over rollout steps (--warmup-steps 2: lr/2, then lr), and the run
    record holding the values actually used (the demo preset's, the flags given)."""
    out_dir, out = straight_run
    assert out.returncode == 0, out.stderr[-4000:]
    _check_run(str(out_dir), out.stdout, steps=4, stderr=out.stderr)
    assert [json.loads(x)["lr"] for x in open(out_dir / "metrics.jsonl")] == [2.5e-4, 5e-4, 5e-4, 5e-4]
    used = json.load(open(out_dir / "run.json"))["config"]
    assert used["warmup_steps"] == 2 and used["group_size"] == dapo.DEMO["group_size"] and used["loss"] == "dapo"
    assert out.stdout.startswith("presets: --task add (")


def test_resume_after_a_failed_save_reproduces_a_straight_run(straight_run, tmp_path):
    """4 straight steps, against a run whose real save_checkpoint fails midway at step 3 (the rename,
    its commit point, raises): the previous checkpoint is the latest complete one, and --resume in the
    same directory continues from it. The logs are trimmed back to step 2, so each step appears once;
    every metric that is not a timing, the samples and the fp32 weights equal the straight run's.
    Also: keeping the last K checkpoints, and an eval-only run through vLLM of a saved checkpoint's
    bf16 Hugging Face export, split into several files by a small --hf-shard-gb. With --kl-coef, so that a
    reference reloaded from the checkpoint instead of the original model would change steps 3-4."""
    (a, out), b, args = straight_run, tmp_path / "resumed", STRAIGHT
    assert out.returncode == 0, out.stderr[-4000:]
    assert sorted(os.listdir(a / "checkpoints")) == ["step_000002", "step_000003", "step_000004"]
    script = tmp_path / "save_fails.py"
    script.write_text(_SAVE_FAILS.replace("HERE", repr(HERE)))
    out = _run([sys.executable, str(script), *E2E_ARGS, *args, "--out-dir", str(b)], timeout=900)
    assert out.returncode != 0 and "injected by the test" in out.stderr, out.stderr[-4000:]
    assert sorted(os.listdir(b / "checkpoints")) == ["step_000001", "step_000002", "step_000003.tmp"]
    assert dapo.latest_checkpoint(str(b)) == str(b / "checkpoints" / "step_000002")
    dapo.check_checkpoint(str(b / "checkpoints" / "step_000002"))
    assert [json.loads(x)["step"] for x in open(b / "metrics.jsonl")] == [1, 2, 3]   # step 3 was logged
    out = _dapo(*args, "--resume", "--out-dir", str(b))
    assert out.returncode == 0, out.stderr[-4000:]
    assert "resumed from" in out.stdout and "step 2" in out.stdout
    wa, wb = (_dcp_model(d / "checkpoints" / "step_000004") for d in (a, b))
    worst = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    print(f"resume: max |w(4 straight) - w(2 + failed save + resume + 2)| = {worst:.2e}")
    assert worst == 0
    ma = [json.loads(x) for x in open(a / "metrics.jsonl")]
    mb = [json.loads(x) for x in open(b / "metrics.jsonl")]
    assert [m["step"] for m in mb] == [1, 2, 3, 4]                                  # the log was trimmed
    timing = lambda k: k.startswith(("time/", "mem/")) or k == "tokens/s"   # noqa: E731
    for x, y in zip(ma, mb):
        assert {k: v for k, v in x.items() if not timing(k)} == {k: v for k, v in y.items() if not timing(k)}
    # the resume crossed a carried surplus (step 2's, used in step 3) and --skip-solved's record: both are in
    # the checkpoint, the surplus whole (its tokens and step-old vLLM log-probs) and held by rank 0
    state = json.load(open(b / "checkpoints" / "step_000002" / "state.json"))
    assert len(state["carried"]) == ma[2]["filter/carried"] > 0 and "set_aside" in state
    assert all(s["carried"] and s["src"] == 0 and len(s["response_ids"]) == len(s["vllm_logp"]) == s["len"]
               for g in state["carried"] for s in g)
    assert len(state["solved"]) >= 2 * 16 and set(state["solved"].values()) <= {0, 1}   # each prompt drawn
    sa, sb = ([json.loads(x) for x in open(d / "samples.jsonl")] for d in (a, b))
    assert sa == sb and [x["step"] for x in sa] == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4
    assert {"prompt", "response", "answer", "reward"} <= sa[0].keys()
    run = json.load(open(a / "run.json"))
    assert run["config"]["steps"] == 4 and "torch" in run["versions"]
    # eval-only: the saved Hugging Face export (bf16, several files) loads in vLLM and is scored
    export = a / "checkpoints" / "step_000004" / "model"
    assert len([f for f in os.listdir(export) if f.endswith(".safetensors")]) >= 4
    assert json.load(open(export / "config.json"))["dtype"] == "bfloat16"
    out = _run([sys.executable, "dapo.py", "--eval-only", "--model", str(export), "--max-prompt-len", "16",
                "--max-response-len", "8", "--eval-samples", "2", "--eval-max-prompts", "32"], timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert re.search(r"eval \(model\): eval/avg@2 \d\.\d+  eval/pass@2 \d\.\d+  eval/maj@2 \d\.\d+", out.stdout), out.stdout


def test_a_broken_weight_sync_stops_the_run_in_one_line(tmp_path):
    """--max-sync-diff X stops a real run once the mean vLLM-vs-trainer log-prob gap exceeds X (here a tiny X:
    CPU fp32 gaps are ~1e-6), before the step's update, with one line naming the step, the figure and the
    causes; the default (0.1) never fires on CPU (every other end-to-end test runs with it).
    test_update_guards_nan_masked_batches_and_forward_passes shows that no optimizer step was taken."""
    out = _dapo("--steps", "3", "--eval-samples", "0", "--max-sync-diff", "1e-12", "--out-dir", str(tmp_path))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-4000:]
    said = out.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"error: step 1: vLLM's log-probs of the sampled tokens differ from the trainer's by \S+ "
                        r"nats on average \(--max-sync-diff 1e-12\), before its update: the weight sync looks "
                        r"broken .*", said), said
    assert open(tmp_path / "metrics.jsonl").read() == ""   # stopped before step 1's update, so nothing logged
    assert dapo.Config().max_sync_diff == 0.1


def test_end_to_end_carry_task_reports_each_level(tmp_path):
    """Also a post-DAPO objective end to end (--loss gspo, with its preset), and a bf16 run on the CPU
    (--precision bf16: FSDP2's bf16 compute over fp32 master weights, vLLM in bf16, the fp32 head on both
    sides), whose sync gap is bf16's rounding: far above fp32's ~1e-6 (test_end_to_end_single_process), far
    below a broken sync's tenths of a nat. On an x86 CPU without bf16 instructions bf16 is refused in one line
    instead, and the run is fp32."""
    lacks = dapo.check_data.cpu_lacks_bf16()
    if lacks:
        refused = _dapo("--precision", "bf16", "--steps", "1")
        assert refused.returncode == 2 and "--precision bf16: this CPU has no bf16 instructions" in refused.stderr
    out = _dapo("--task", "carry", "--loss", "gspo", "--demo-sft-target", "0.0", "--no-dynamic-sampling", "--steps",
                "2", "--max-response-len", "24", "--overlong-cache-len", "8", "--eval-max-prompts", "2000",
                "--eval-samples", "1", "--precision", "fp32" if lacks else "bf16", "--out-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-4000:]
    after = next(x for x in out.stdout.splitlines() if x.startswith("eval (after)"))
    assert all(f"eval/avg@1/d{n} " in after for n in range(1, 6)), after
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert all(r["gen/responses"] == 16 * 8 and 0 <= r["batch/effective_groups"] <= 16 for r in rows)
    assert all(r["entropy/generated"] > 0.5 for r in rows)  # an untrained model: near-uniform tokens
    gaps = [r["sync/logp_diff_mean"] for r in rows]
    print(f"sync/logp_diff_mean per step ({'fp32' if lacks else 'bf16'}): {gaps}")
    assert all((g < 1e-4) if lacks else (1e-4 < g < 0.05) for g in gaps), gaps


def test_end_to_end_torchrun_2_ranks(tmp_path):
    """Also the token-budget path through the real update_policy: with a budget of 56 real tokens the ranks pack
    different numbers of micro-batches in most steps (how many depends on the sampled lengths: 4 steps, so that
    some step has them), and the one with fewer runs zero-weight padding micro-batches, whose empty log-probs
    the sync gap's statistics must skip. --carry-surplus: a group
    carried to the next step keeps its tokens on the rank that generated it until it is trained. Then the 2
    ranks' checkpoint resumes in 1 process, as load_checkpoint's docstring claims, its carried surplus too."""
    carry = ["--carry-surplus", "--gen-batch-size", "48"]   # more than N = 16 pass of 48: a surplus each step
    out = _torchrun(2, "dapo.py", *E2E_ARGS, "--steps", "4", "--micro-batch-tokens", "56", *carry,
                    "--out-dir", str(tmp_path), timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    _check_run(str(tmp_path), out.stdout, steps=4, stderr=out.stderr)
    padding = [json.loads(line)["update/padding_micro_batches"] for line in open(tmp_path / "metrics.jsonl")]
    print(f"padding micro-batches per step (both ranks): {padding}")
    assert sum(padding) > 0
    # the checkpoint 2 ranks saved resumes in 1 process (each reads what it needs of the sharded state), run
    # through main() as a library calls it: then main tears vLLM's engine down itself (dapo.py's end skips it)
    library = ("import sys, dapo\ndapo.main(sys.argv[1:])\n"
               "from vllm.distributed.parallel_state import model_parallel_is_initialized\n"
               "assert not model_parallel_is_initialized()  # vLLM's groups are gone\n"
               "dapo.exit_now(0)  # the interpreter's own teardown is not under test\n")
    saved = json.load(open(tmp_path / "checkpoints" / "step_000004" / "state.json"))["carried"]
    out = _run([sys.executable, "-c", library, *E2E_ARGS, "--steps", "5", "--micro-batch-tokens", "56", "--resume",
                *carry, "--out-dir", str(tmp_path)], timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "resumed from" in out.stdout and "step 4" in out.stdout
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and rows[-1]["sync/logp_diff_max"] < 1e-4
    print(f"carried groups per step: {[r['filter/carried'] for r in rows]}; in step 4's checkpoint: {len(saved)}")
    assert sum(r["filter/carried"] for r in rows) > 0                        # the buffer worked across steps
    assert rows[4]["filter/carried"] == len(saved) <= 8                      # and the resume took step 4's (N/2 at most)


def test_end_to_end_torchrun_tensor_parallel_2(tmp_path):
    """Two ranks forming one vLLM TP=2 group: identical responses on both, exact weight sync. dapo.py's own
    end tears down vLLM's groups (not its engine: the exit frees it) with nothing left behind to warn about,
    such as the group's shared-memory queue, its IPC sockets (own_ipc_dir), or the /dev/shm files of vLLM's CPU
    TP group, whose names are the same in every run: one left behind stops the next TP run (unlink_group_shm).
    Only this run's files count: its temporary directory is its own (TMPDIR), and the /dev/shm names are compared
    with those there before it (another job's run on the machine is not this test's business)."""
    import glob
    import tempfile
    shm = lambda: set(glob.glob("/dev/shm/-tp:*-cpushm_*"))   # noqa: E731  (external_launcher's CPU TP group)
    before = shm()
    own_tmp = tempfile.mkdtemp(prefix="tp")   # short: a unix socket's path holds 107 bytes
    try:
        out = _torchrun(2, "dapo.py", *E2E_ARGS, "--steps", "2", "--tp-size", "2", "--out-dir", str(tmp_path), timeout=900,
                        env={"TORCHINDUCTOR_CACHE_DIR": _inductor_cache(), **os.environ, "TMPDIR": own_tmp})
        left = _left_in_tmp(own_tmp)
    finally:
        shutil.rmtree(own_tmp, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-4000:]
    _check_run(str(tmp_path), out.stdout, steps=2, stderr=out.stderr)
    assert "leaked" not in out.stderr and "Exception ignored" not in out.stderr, out.stderr[-4000:]
    assert not shm() - before, shm() - before
    assert not left, left


# -----------------------------------------------------------------------------------------
# Helpers

def _check_run(out_dir, stdout, steps=3, stderr=None):
    from safetensors.torch import load_file
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["sync/tp_mismatch"] == 0 for r in rows)       # TP ranks sampled identical responses
    for r in rows:
        for k, v in r.items():
            assert math.isfinite(v), (k, v)
        for k in ("reward/mean", "acc/mean", "filter/kept_frac", "filter/gen_batches", "clip/low_frac",
                  "clip/high_frac", "entropy", "approx_kl", "len/mean", "len/max", "len/truncated_frac",
                  "grad_norm", "lr", "time/rollout", "time/reward", "time/update", "time/sync", "tokens/s",
                  "sync/logp_diff_mean", "sync/logp_diff_p99", "nonfinite/skipped", "entropy/generated",
                  "batch/effective_groups", "gen/responses"):
            assert k in r, k
    # weight sync is exact: vLLM's log-probs of the sampled tokens equal the trainer's (steps 2, 3
    # are generated by weights that were pushed into vLLM after an optimizer step)
    sync = [r["sync/logp_diff_max"] for r in rows]
    # ... and the weights moved far more than that, so stale weights in vLLM would show
    base = load_file(os.path.join(out_dir, "base_model", "model.safetensors"))
    final_dir = os.path.join(out_dir, "checkpoints", f"step_{steps:06d}", "model")
    final = _dcp_model(os.path.dirname(final_dir))   # the fp32 resume state
    moved = max((base[k] - final[k]).abs().max().item() for k in base)
    change = _logprob_change(os.path.join(out_dir, "base_model"), final_dir)   # transformers loads it
    print(f"sync/logp_diff_max per step {sync}; weights moved up to {moved:.2e}; "
          f"log-probs moved up to {change:.2e}")
    assert max(sync) < 1e-4
    assert moved > 1e-3 and change > 1e-2
    # a log file, not a terminal: one plain line a step, no progress bar's carriage returns
    assert len(re.findall(r"^step +\d+  acc ", stdout, re.M)) == steps and "\r" not in stdout + (stderr or "")
    last = stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"held-out accuracy: before \d\.\d\d -> after \d\.\d\d", last), last
    # the evaluations before and after are in metrics.jsonl too, one object per step: "before" in the first row
    # under its own prefix, "after" in the last
    before = re.search(r"^eval \(before\): eval/avg@2 (\S+)", stdout, re.M).group(1)
    after = re.search(r"^eval \(after\): eval/avg@2 (\S+)", stdout, re.M).group(1)
    assert f"{rows[0]['eval_before/avg@2']:.3f}" == before and f"{rows[-1]['eval/avg@2']:.3f}" == after
    # samples.jsonl: every key on every line (null where there is none)
    keys = {frozenset(json.loads(x)) for x in open(os.path.join(out_dir, "samples.jsonl"))}
    assert len(keys) == 1 and {"answer", "failed", "truth"} <= next(iter(keys)), keys


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("straight")
    return out_dir, _dapo(*STRAIGHT, "--out-dir", str(out_dir))


def _inductor_cache():
    """torch inductor's cache of compiled kernels, where it keeps it by default (under the temporary directory):
    a run given a TMPDIR of its own still reuses it."""
    import getpass
    import tempfile
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")


def _left_in_tmp(folder):
    """What a TP run may leave in its temporary directory: vLLM's IPC sockets (uuid4 names) and dapo's own
    directories for them (own_ipc_dir)."""
    import stat
    out = set()
    for e in os.scandir(folder):
        with contextlib.suppress(OSError):   # gone since the scan, or a dangling link
            st = os.lstat(e.path)
            if (stat.S_ISSOCK(st.st_mode) and re.fullmatch(r"[0-9a-f-]{36}", e.name)) or \
                    (stat.S_ISDIR(st.st_mode) and re.fullmatch(r"dapo-[a-z0-9_]{8}", e.name)):
                out.add(e.path)
    return out
