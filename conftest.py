"""pytest's set-up for test_dapo.py: the `gpu` marker. `pytest -m gpu` runs the tests that need CUDA and,
without it, lists each one it skips with the reason."""


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu(gpus=1, vllm=False): needs CUDA (and N GPUs, or vLLM's CUDA build)")
    if "gpu" in (config.getoption("markexpr") or "") and "s" not in config.option.reportchars:
        config.option.reportchars += "s"  # name every skipped GPU test in the summary
