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


def new_seed(request: pytest.FixtureRequest, bits: int = 30) -> int:
    """A new random seed, kept on the fixture's node so that a failing test's report names it."""
    seed = random.SystemRandom().randrange(1 << bits)
    node = request.node
    node.random_seeds = [*getattr(node, "random_seeds", []), f"{request.fixturename}={seed}"]
    return seed


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        seeds = [s for node in item.listchain() for s in getattr(node, "random_seeds", [])]
        if seeds:
            report.sections.append(("random seeds", " ".join(seeds)))
    return report


@pytest.fixture(autouse=True)
def default_kernel_switches():
    """After each test the kernel switches (kernels/switches.py) are the defaults again: a runner applies its
    config's to the whole process."""
    yield
    if (switches := sys.modules.get("llmserve.kernels.switches")) is not None:
        vars(switches.current).update(vars(switches.Switches()))


@pytest.fixture
def fresh_seed(request) -> int:
    """A new seed each run; a failure's report names it (section "random seeds")."""
    return new_seed(request)


@pytest.fixture(scope="session")
def demo_dir() -> str:
    """The demo model, built once into the test cache (in a subprocess: Paddle stays out of pytest)."""
    if importlib.util.find_spec("paddle") is None:  # CI has it; a GPU box may not
        pytest.skip("the demo model is a Paddle export, and paddle is not installed")
    r = subprocess.run(
        [sys.executable, "-c", "from llmserve.runners.model_dir import ensure_demo_model; print(ensure_demo_model())"],
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
    from llmserve.models.random_model import SHAPES, write_random_checkpoint

    path = tmp_path_factory.mktemp("tiny-hf")
    write_random_checkpoint(path, "tiny", device="cpu", dtype=torch.float32, max_positions=256)
    train_demo_tokenizer(path, vocab_size=SHAPES["tiny"]["vocab_size"])
    return path
