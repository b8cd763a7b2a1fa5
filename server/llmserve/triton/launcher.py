"""Start the real `tritonserver` that ships inside the `nvidia-pytriton` wheel.

The wheel holds the binary, libtritonserver (and its bundled libraries) and
the Python backend, with one stub per Python version. Triton looks for the
stub next to `libtriton_python.so`, so we assemble a backend directory with
the stub that matches the running interpreter. The stub embeds libpython:
the running Python's shared library goes on LD_LIBRARY_PATH, and the venv's
`bin/` on PATH so that the embedded interpreter finds the venv (and imports
our package) like the process that started it.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

MODEL_NAME = "model"
REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"


class TritonNotFound(RuntimeError):
    pass


def pytriton_root() -> Path:
    try:
        import pytriton
    except ImportError as e:
        raise TritonNotFound("nvidia-pytriton is not installed: `pip install 'nvidia-pytriton>=0.6,<0.8'`") from e
    return Path(pytriton.__file__).resolve().parent


def _python_tag() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def build_backend_dir(dest: Path) -> Path:
    """Copy the Python backend with the stub of this interpreter to dest/python; returns dest."""
    root = pytriton_root() / "tritonserver"
    stub = root / "python_backend_stubs" / _python_tag() / "triton_python_backend_stub"
    if not stub.exists():
        have = sorted(p.name for p in (root / "python_backend_stubs").iterdir())
        raise TritonNotFound(f"no Python-backend stub for Python {_python_tag()} in nvidia-pytriton (it has {have})")
    py = dest / "python"
    py.mkdir(parents=True, exist_ok=True)
    for src in (
        root / "backends" / "python" / "libtriton_python.so",
        root / "backends/python/triton_python_backend_utils.py",
        stub,
    ):
        dst = py / src.name
        # Copy only when changed: a running server may have the old file mapped.
        if not dst.exists() or dst.stat().st_size != src.stat().st_size or dst.stat().st_mtime < src.stat().st_mtime:
            tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")  # stacks may start side by side
            shutil.copy2(src, tmp)
            os.replace(tmp, dst)
    return dest


def shm_prefix(grpc_port: int) -> str:
    """The name prefix of the Python backend's /dev/shm regions for the Triton on grpc_port."""
    return f"llmserve_{grpc_port}_"


@dataclass
class TritonLaunch:
    argv: list[str]
    env: dict[str, str]
    shm_prefix: str  # Python-backend shared-memory regions under /dev/shm start with it


def triton_command(
    *,
    grpc_port: int,
    metrics_port: int,
    work_dir: Path,
    model_repository: Path = DEFAULT_MODEL_REPOSITORY,
    http_port: int = -1,
    host: str = "127.0.0.1",
    log_verbose: int = 0,
    extra_env: dict[str, str] | None = None,
) -> TritonLaunch:
    """Command line and environment for tritonserver serving `model_repository`.

    `metrics_port` is Triton's own (internal) metrics endpoint; our metrics
    server re-exports it. `http_port` -1 turns Triton's HTTP endpoint off.
    """
    # A Triton image brings its own server and backends (TRITONSERVER_BIN, TRITON_BACKEND_DIR);
    # elsewhere both come from the nvidia-pytriton wheel.
    own_bin, own_backends = os.environ.get("TRITONSERVER_BIN"), os.environ.get("TRITON_BACKEND_DIR")
    if own_bin:
        binary, libs = Path(own_bin), None
    else:
        root = pytriton_root()
        binary, libs = root / "tritonserver" / "bin" / "tritonserver", root.parent / "nvidia_pytriton.libs"
    if not binary.exists():
        raise TritonNotFound(f"tritonserver binary missing at {binary}" + (" (TRITONSERVER_BIN)" if own_bin else ""))
    backends = Path(own_backends) if own_backends else build_backend_dir(Path(work_dir) / "backends")
    if not (backends / "python").is_dir():
        raise TritonNotFound(f"no python backend in {backends}" + (" (TRITON_BACKEND_DIR)" if own_backends else ""))
    prefix = shm_prefix(grpc_port)
    argv = [
        str(binary),
        f"--model-repository={model_repository}",
        f"--backend-directory={backends}",
        f"--grpc-address={host}",
        f"--grpc-port={grpc_port}",
        f"--metrics-address={host}",
        f"--metrics-port={metrics_port}",
        "--allow-metrics=true",
        "--allow-gpu-metrics=false",
        "--allow-cpu-metrics=true",
        f"--log-verbose={log_verbose}",
        "--exit-on-error=true",
        "--strict-readiness=true",
        "--exit-timeout-secs=5",
        f"--backend-config=python,shm-region-prefix-name={prefix}",
        # Small shm regions: our tensors are one JSON string each.
        "--backend-config=python,shm-default-byte-size=1048576",
        "--backend-config=python,shm-growth-byte-size=1048576",
    ]
    if http_port > 0:
        argv += [f"--http-address={host}", f"--http-port={http_port}", "--allow-http=true"]
    else:
        argv += ["--allow-http=false"]

    env = dict(os.environ)
    env.update(extra_env or {})
    pylib = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (pylib, str(libs or ""), env.get("LD_LIBRARY_PATH", "")) if p)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    # The stub's embedded interpreter must see the same package as we do.
    env["PYTHONPATH"] = ":".join(p for p in (str(REPO_ROOT / "server"), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return TritonLaunch(argv=argv, env=env, shm_prefix=prefix)
