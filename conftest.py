"""pytest's set-up for test_dapo.py and tests/: Python's bytecode cache, no network, a thread per test worker, and the
`gpu` marker. `pytest -m gpu` runs the tests that need CUDA and, without it, lists each one it skips with the
reason."""
import os
import sys

# The README's test set-up installs with `pip install --no-compile`: pip would compile all ~22k files of the
# packages on one core (~90 s). The tests start Python dozens of times; the first start that imports a module
# writes its bytecode (~4k modules), also where PYTHONDONTWRITEBYTECODE is set, and later starts reuse it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# Nothing is downloaded: a test that names a hub model must fail at once, not retry the network. Set before anything
# imports huggingface_hub, which reads it once (a test's own setenv would come too late).
os.environ["HF_HUB_OFFLINE"] = "1"
# The README's test command runs two pytest-xdist workers on 2 cores: with torch's default of a thread per core in
# each worker and in every process its tests start, OpenMP's spinning threads would share the cores four ways and
# slow every test several-fold. One thread each (read by torch at import) keeps both cores busy, one test a core.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"


def pytest_report_header(config):
    """The sandbox's isolation here (lib/sandbox.py), at the head of every run's log, CI's included (pytest-xdist
    prints the controller's header once)."""
    from lib import sandbox
    return sandbox.isolation(say=False)["line"]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu(gpus=1, vllm=False): needs CUDA (and N GPUs, or vLLM's CUDA build)")
    if "gpu" in (config.getoption("markexpr") or "") and "s" not in config.option.reportchars:
        config.option.reportchars += "s"  # name every skipped GPU test in the summary
