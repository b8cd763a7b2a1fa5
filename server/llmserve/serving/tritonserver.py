"""Start the real `tritonserver` that ships inside the `nvidia-pytriton` wheel.

The wheel holds the binary, libtritonserver (and its bundled libraries) and
the Python backend, with one stub per Python version. Triton looks for the
stub next to `libtriton_python.so`, so we assemble a backend directory with
the stub that matches the running interpreter. The stub embeds libpython:
the running Python's shared library goes on LD_LIBRARY_PATH, and the venv's
`bin/` on PATH so that the embedded interpreter finds the venv (and imports
our package) like the process that started it.

The stub starts Python isolated: it ignores PYTHONPATH, so our model file
(model_repository/model/1/model.py) puts PYTHONPATH's entries first itself.

numpy 2: Triton 2.51's stub is built with pybind11 2.10, which reads numpy's
dtype struct at its numpy-1 layout. Under numpy 2 it sees every item size as
0, so string tensors arrive as the first byte repeated (the request cannot be
parsed and the stub dies: "unpack_from requires a buffer of at least ...")
and go out empty. Nothing in Python can undo that, so the stub needs numpy<2:
the environment's (pyproject pins it), or a directory holding numpy<2 named
by LLMSERVE_TRITON_STUB_PYTHONPATH, which goes first on the stub's path only
(the engine and the front end keep the environment's numpy 2). With numpy 2
and neither, `triton_command` refuses to start with that explanation.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from llmserve.config import Config

MODEL_NAME = "model"
REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
STUB_PYTHONPATH_ENV = "LLMSERVE_TRITON_STUB_PYTHONPATH"  # directories first on the stub's path (numpy<2)


class TritonNotFound(RuntimeError):
    pass


def pytriton_root() -> Path:
    """The `pytriton` package directory, found without importing it (we need its files, not its code)."""
    try:
        spec = importlib.util.find_spec("pytriton")
    except ImportError:  # a broken or hidden install counts as missing
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise TritonNotFound("nvidia-pytriton is not installed: `pip install 'nvidia-pytriton>=0.6,<0.8'`")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


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


def stub_reads_numpy2(stub: Path) -> bool:
    """Whether a Python-backend stub understands numpy 2 (pybind11 >= 2.12 names `numpy._core`; 2.10 does not)."""
    return b"numpy._core" in stub.read_bytes()


def _numpy_major(dirs: list[str]) -> tuple[int, str] | None:
    """(major version, where) of the numpy the stub imports: the first of `dirs` that holds one, else ours."""
    for d in dirs:
        found = sorted(Path(d).glob("numpy-*.dist-info"))
        if found:
            m = re.match(r"numpy-(\d+)\.", found[0].name)
            return (int(m.group(1)), d) if m else None
        if (Path(d) / "numpy").is_dir():
            return None  # a numpy without metadata: trust it
    try:
        return int(importlib.metadata.version("numpy").split(".")[0]), "this environment"
    except importlib.metadata.PackageNotFoundError:
        return None


def check_stub_numpy(stub: Path, stub_path: list[str]) -> None:
    """Refuse a stub that misreads numpy 2 arrays (Triton 2.51's) when the numpy it would import is numpy 2."""
    if not stub.is_file() or stub_reads_numpy2(stub):
        return
    found = _numpy_major(stub_path)
    if found and found[0] >= 2:
        raise TritonNotFound(
            f"the Triton Python-backend stub {stub} (Triton 2.51, pybind11 2.10) misreads numpy 2 arrays, "
            f"and the numpy it would import is numpy {found[0]} ({found[1]}): string tensors would arrive "
            f"corrupted. Install numpy<2 in this environment, or give the stub its own: "
            f"`pip install --target DIR 'numpy<2'` and {STUB_PYTHONPATH_ENV}=DIR (only the stub uses it)."
        )


def shm_prefix(grpc_port: int) -> str:
    """The name prefix of the Python backend's /dev/shm regions for the Triton on grpc_port."""
    return f"llmserve_{grpc_port}_"


@dataclass
class TritonLaunch:
    argv: list[str]
    env: dict[str, str]
    shm_prefix: str  # Python-backend shared-memory regions under /dev/shm start with it


def with_instances(repository: Path, count: int, work_dir: Path) -> Path:
    """`repository` with its model served by `count` instances: itself for one (config.pbtxt's count),
    else a copy of the config beside a link to the model's code, under `work_dir`. One stub sends
    about 6,000 responses a second (each send waits for tritonserver to take it), so a batch of 256
    streams at 16 ms steps needs four."""
    if count == 1:
        return repository
    out = work_dir / f"model_repository-x{count}"
    model = out / "model"
    model.mkdir(parents=True, exist_ok=True)
    config = (repository / "model" / "config.pbtxt").read_text()
    tmp = model / f"config.pbtxt.{os.getpid()}"
    tmp.write_text(re.sub(r"count: \d+", f"count: {count}", config, count=1))
    tmp.replace(model / "config.pbtxt")  # atomic: a stack starting beside this one reads a whole file
    code = model / "1"
    if not code.is_symlink() or code.resolve() != (repository / "model" / "1").resolve():
        link = model / f"1.{os.getpid()}"
        link.unlink(missing_ok=True)
        link.symlink_to((repository / "model" / "1").resolve(), target_is_directory=True)
        link.replace(code)
    return out


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
    config: Config | None = None,
) -> TritonLaunch:
    """Command line and environment for tritonserver serving `model_repository`.

    `metrics_port` is Triton's own metrics endpoint (TRITON_METRICS_PORT, on `host`; -1: off); our
    metrics server re-exports it. `http_port` -1 turns Triton's HTTP endpoint off. TRITONSERVER_BIN,
    TRITON_BACKEND_DIR and LLMSERVE_TRITON_STUB_PYTHONPATH come from `config` (default: the environment's).
    """
    cfg = config or Config.from_env()
    # A Triton image brings its own server and backends (TRITONSERVER_BIN, TRITON_BACKEND_DIR);
    # elsewhere both come from the nvidia-pytriton wheel.
    own_bin, own_backends = cfg.tritonserver_bin, cfg.triton_backend_dir
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
    stub_path = [p for p in cfg.triton_stub_pythonpath.split(os.pathsep) if p]
    check_stub_numpy(backends / "python" / "triton_python_backend_stub", stub_path)
    prefix = shm_prefix(grpc_port)
    if model_repository == DEFAULT_MODEL_REPOSITORY:
        model_repository = with_instances(model_repository, cfg.triton_instances, Path(work_dir))
    argv = [
        str(binary),
        f"--model-repository={model_repository}",
        f"--backend-directory={backends}",
        f"--grpc-address={host}",
        f"--grpc-port={grpc_port}",
        f"--log-verbose={log_verbose}",
        # No pinned host memory pool: it serves GPU<->host copies of tensors, and ours are one JSON
        # string on the CPU. Without a GPU, allocating it fails with a warning at every start.
        "--pinned-memory-pool-byte-size=0",
        # config.pbtxt is complete: without this, the Python backend first runs a throwaway stub to ask
        # the model for its config (a second or more of every start, and a stub that comes and goes).
        "--disable-auto-complete-config",
        "--exit-on-error=true",
        "--strict-readiness=true",
        # Triton takes about 1.2 s to unload each instance of the model, one after the other.
        f"--exit-timeout-secs={5 + 2 * cfg.triton_instances}",
        f"--backend-config=python,shm-region-prefix-name={prefix}",
        # Small shm regions: our tensors are one JSON string each.
        "--backend-config=python,shm-default-byte-size=1048576",
        "--backend-config=python,shm-growth-byte-size=1048576",
    ]
    if metrics_port > 0:
        argv += [
            f"--metrics-address={host}",
            f"--metrics-port={metrics_port}",
            "--allow-metrics=true",
            "--allow-gpu-metrics=false",
            "--allow-cpu-metrics=true",
            # The CPU poller's period: tritonserver's exit joins it, so the default 2 s cost every stop
            # up to 2 s (1 s on average); two /proc reads 4 times a second cost nothing.
            "--metrics-interval-ms=250",
        ]
    else:
        argv += ["--allow-metrics=false"]
    if http_port > 0:
        argv += [f"--http-address={host}", f"--http-port={http_port}", "--allow-http=true"]
    else:
        argv += ["--allow-http=false"]

    env = dict(os.environ)
    env.update(extra_env or {})
    pylib = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (pylib, str(libs or ""), env.get("LD_LIBRARY_PATH", "")) if p)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    # The stub's embedded interpreter must see the same package as we do (our model file puts
    # PYTHONPATH first on its sys.path: the stub itself ignores it), and numpy<2 before all.
    pythonpath = [*stub_path, str(REPO_ROOT / "server"), *env.get("PYTHONPATH", "").split(os.pathsep)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in pythonpath if p))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return TritonLaunch(argv=argv, env=env, shm_prefix=prefix)
