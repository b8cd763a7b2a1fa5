"""Deployability: what a GPU box without Paddle (or with numpy 2) needs from us.

- The torch path (HF safetensors checkpoint -> `load_model` -> TorchRunner -> generate)
  imports no Paddle: run in a subprocess where `import paddle` fails.
- The Triton model file finds `llmserve` from its own location when it is not installed.
- Triton 2.51's stub misreads numpy 2 arrays: the launcher refuses it with numpy 2, unless
  LLMSERVE_TRITON_STUB_PYTHONPATH gives the stub a numpy<2, which then goes first on its path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

NO_PADDLE = """
import json, sys
sys.modules["paddle"] = None  # `import paddle` (and any paddle.x) now raises ImportError
from llmserve.config import Config
from llmserve.offline import LLM
from llmserve.engine.sampling_params import SamplingParams
llm = LLM(config=Config(model_dir=sys.argv[1], block_size=4, max_seq_len=64, batch_size=4, runner="auto"))
out = llm.generate([[5, 6, 7], "hello"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
llm.shutdown()
loaded = sorted(m for m, mod in sys.modules.items() if mod is not None and m.split(".")[0] in ("paddle", "paddlenlp"))
ours = sorted(m for m in sys.modules if m.startswith(("llmserve.runners.paddle", "llmserve.runners.paddle.export",
                                                       "llmserve.runners.paddle.graph")))
print(json.dumps({"runner": type(llm.engine.runner).__name__, "tokens": [len(r.token_ids) for r in out],
                  "paddle_modules": loaded, "paddle_side_of_llmserve": ours}))
"""


def test_torch_path_imports_no_paddle(tiny_hf_dir):
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "server"), os.environ.get("PYTHONPATH")) if p)
    )
    r = subprocess.run(
        [sys.executable, "-c", NO_PADDLE, str(tiny_hf_dir)], capture_output=True, text=True, timeout=300, env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["runner"] == "TorchRunner"
    assert res["tokens"] == [4, 4]
    assert res["paddle_modules"] == [] and res["paddle_side_of_llmserve"] == []


def test_triton_model_file_finds_llmserve_without_install(tmp_path):
    """model_repository/model/1/model.py puts <repo>/server on sys.path when `llmserve` is not importable."""
    code = f"""
import importlib.abc, importlib.util, sys, types
sys.path = [p for p in sys.path if not p.rstrip("/").endswith("server")]

class Hide(importlib.abc.MetaPathFinder):  # llmserve is "not installed" until <repo>/server is on sys.path
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "llmserve" and {str(ROOT / "server")!r} not in sys.path:
            raise ImportError("hidden")
        return None

sys.meta_path.insert(0, Hide())
pb = types.ModuleType("triton_python_backend_utils")  # what the stub provides
pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
sys.modules["triton_python_backend_utils"] = pb
spec = importlib.util.spec_from_file_location("model", {str(ROOT / "model_repository/model/1/model.py")!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
print(mod.TritonPythonModel.__module__)
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "llmserve.triton.model"


def test_old_stub_with_numpy2_is_refused_unless_the_stub_gets_numpy1(tmp_path, monkeypatch):
    """Triton 2.51's stub (pybind11 2.10) misreads numpy 2 arrays: refuse it, or give it numpy<2 first on its path."""
    from llmserve.serving import tritonserver as launcher

    old, new = tmp_path / "old_stub", tmp_path / "new_stub"
    old.write_bytes(b"\x7fELF ... numpy.core.multiarray ...")
    new.write_bytes(b"\x7fELF ... numpy._core ... numpy.core ...")
    np1, np2 = tmp_path / "np1", tmp_path / "np2"
    (np1 / "numpy-1.26.4.dist-info").mkdir(parents=True)
    (np2 / "numpy-2.5.2.dist-info").mkdir(parents=True)
    assert not launcher.stub_reads_numpy2(old) and launcher.stub_reads_numpy2(new)
    with pytest.raises(launcher.TritonNotFound, match="LLMSERVE_TRITON_STUB_PYTHONPATH"):
        launcher.check_stub_numpy(old, [str(np2), str(np1)])  # the first numpy on the path counts
    launcher.check_stub_numpy(old, [str(np1), str(np2)])
    launcher.check_stub_numpy(new, [str(np2)])
    monkeypatch.setattr(launcher.importlib.metadata, "version", lambda name: "2.5.2")  # this environment's numpy
    with pytest.raises(launcher.TritonNotFound, match="numpy 2 \\(this environment\\)"):
        launcher.check_stub_numpy(old, [])


def test_stub_pythonpath_goes_first_for_the_stub(tmp_path, monkeypatch):
    pytest.importorskip("pytriton")
    from llmserve.serving import tritonserver as launcher

    real_stub = launcher.pytriton_root() / "tritonserver/python_backend_stubs/3.12/triton_python_backend_stub"
    if real_stub.exists():  # nvidia-pytriton 0.7.0 ships Triton 2.51: the reason for all this
        assert not launcher.stub_reads_numpy2(real_stub)
    np1 = tmp_path / "np1"
    (np1 / "numpy-1.26.4.dist-info").mkdir(parents=True)
    monkeypatch.setenv("LLMSERVE_TRITON_STUB_PYTHONPATH", str(np1))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    launch = launcher.triton_command(grpc_port=1, metrics_port=2, work_dir=tmp_path / "w")
    assert launch.env["PYTHONPATH"].split(os.pathsep) == [str(np1), str(ROOT / "server"), "/elsewhere"]


def test_adapter_instances_get_their_own_config(tmp_path):
    """ADAPTER_INSTANCES=N: Triton serves a copy of config.pbtxt with N instances beside a link to
    the model's code; one instance is the repository as it is. The default is one per 64 streams."""
    from llmserve.config import Config, ConfigError
    from llmserve.serving import tritonserver as launcher

    repo = launcher.DEFAULT_MODEL_REPOSITORY
    assert launcher.with_instances(repo, 1, tmp_path) == repo
    out = launcher.with_instances(repo, 3, tmp_path)
    config = (out / "model" / "config.pbtxt").read_text()
    assert "count: 3" in config and "count: 1" not in config
    assert config.replace("count: 3", "count: 1") == (repo / "model" / "config.pbtxt").read_text()
    assert (out / "model" / "1" / "model.py").resolve() == (repo / "model" / "1" / "model.py").resolve()
    assert launcher.with_instances(repo, 3, tmp_path) == out  # again: the same, rewritten in place
    assert Config(batch_size=50).triton_instances == 1 and Config(batch_size=256).triton_instances == 4
    assert Config(batch_size=256, adapter_instances=2).triton_instances == 2
    with pytest.raises(ConfigError, match="ADAPTER_INSTANCES=9"):
        Config(adapter_instances=9).validate()
