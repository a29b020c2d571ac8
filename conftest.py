"""pytest's set-up for test_dapo.py and tests/: Python's bytecode cache, and the `gpu` marker. `pytest -m gpu` runs
the tests that need CUDA and, without it, lists each one it skips with the reason."""
import os
import sys

# The README's test set-up installs with `pip install --no-compile`: pip would compile all ~22k files of the
# packages on one core (~90 s). The tests start Python dozens of times; the first start that imports a module
# writes its bytecode (~4k modules), also where PYTHONDONTWRITEBYTECODE is set, and later starts reuse it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu(gpus=1, vllm=False): needs CUDA (and N GPUs, or vLLM's CUDA build)")
    if "gpu" in (config.getoption("markexpr") or "") and "s" not in config.option.reportchars:
        config.option.reportchars += "s"  # name every skipped GPU test in the summary
