import os
import random
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
