# The Triton model: our adapter, llmserve.triton.model.
# Triton's stub starts Python isolated (it ignores PYTHONPATH): put PYTHONPATH's entries first, as
# python does (the launcher lists the repo's server/ and the stub's own numpy<2 there). When
# `llmserve` is still not importable, take it from this repository: <repo>/model_repository/model/1/model.py.
import os
import sys
from pathlib import Path

sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
try:
    import llmserve  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "server"))

from llmserve.triton.model import TritonPythonModel  # noqa: E402, F401
