import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

# Tests never touch the user's cache or the network.
os.environ.setdefault("LLMSERVE_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "test"))


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def fresh_seed() -> int:
    """A new seed each run (printed on failure by pytest's -ra through the test id's locals)."""
    return random.SystemRandom().randrange(1 << 30)


@pytest.fixture(scope="session")
def demo_dir() -> str:
    """The demo model, built once into the test cache (in a subprocess: Paddle stays out of pytest)."""
    if importlib.util.find_spec("paddle") is None:  # CI has it; a GPU box may not
        pytest.skip("the demo model is a Paddle export, and paddle is not installed")
    r = subprocess.run(
        [sys.executable, "-c", "from llmserve.engine.loader import ensure_demo_model; print(ensure_demo_model())"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return r.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory) -> Path:
    """A random tiny Llama HF checkpoint (sharded safetensors + index) with a byte-level BPE tokenizer."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from llmserve.models.demo_tokenizer import train_demo_tokenizer
    from llmserve.runners.torch.random_model import SHAPES, write_random_checkpoint

    path = tmp_path_factory.mktemp("tiny-hf")
    write_random_checkpoint(path, "tiny", device="cpu", dtype=torch.float32, max_positions=256)
    train_demo_tokenizer(path, vocab_size=SHAPES["tiny"]["vocab_size"])
    return path
