"""The fixtures the test files in tests/ share: the demo's tiny model, and the CUDA device of a GPU test."""
import pytest
import torch

import tests.shared  # noqa: F401  (the checkout on the path, the test run's model cache)
from lib import demo_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The demo's model and tokenizer, random init (a zero target: no warm-start steps)."""
    path = str(tmp_path_factory.mktemp("tiny") / "model")
    demo_model.build(path, demo_model.demo_task(0)[0], demo_model.DEMO_TOKENS, seed=0, sft_target=0.0)
    return path


@pytest.fixture
def cuda(request):
    """The test's CUDA device, or a skip naming the test and what it lacks (gpus=N, vllm=True: see @gpu)."""
    want = request.node.get_closest_marker("gpu")
    gpus, needs_vllm = want.kwargs.get("gpus", 1), want.kwargs.get("vllm", False)
    name = request.node.name
    if not torch.cuda.is_available():
        pytest.skip(f"{name}: no CUDA GPU (torch.cuda.is_available() is False)")
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"{name}: needs {gpus} GPUs, found {torch.cuda.device_count()}")
    if needs_vllm and __import__("importlib.util").util.find_spec("vllm") is None:
        pytest.skip(f"{name}: needs vLLM's CUDA build (pip install -r requirements.txt)")
    return torch.device("cuda", 0)
