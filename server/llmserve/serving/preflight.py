"""Optional packages, checked when the server starts (the engine server, before it loads anything).

A package the configuration needs (torch for the torch runner, paddle for the Paddle runner and the
demo, triton-lang for the CUDA kernels, fastapi and uvicorn for the HTTP front end) is checked
first: when one is missing the engine refuses to start with one line naming the package and the
setting that needs it (start_server.sh prints it and exits non-zero). A package only some requests
need (llguidance: structured output and tool-call grammars) is not a reason to refuse; the start
logs which features are off, and such a request gets 501 naming the package (`request_error`).

"Installed" means importable here: a broken install, or one hidden from this interpreter, counts as
missing, as it would at the import.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from llmserve.config import Config, parse_kernel_switches

NOT_IMPLEMENTED = 501  # a request for a feature whose package is not installed here


@dataclass(frozen=True)
class Package:
    module: str  # what is imported
    dist: str  # what `pip install` takes (pyproject.toml's name)
    feature: str  # what it is for, in words


TORCH = Package("torch", "torch", "the torch runner")
PADDLE = Package("paddle", "paddlepaddle", "the Paddle runner (and the demo model's export)")
TRITON = Package("triton", "triton", "the torch runner's CUDA kernels")
FASTAPI = Package("fastapi", "fastapi", "the HTTP front end")
UVICORN = Package("uvicorn", "uvicorn", "the HTTP front end")
LLGUIDANCE = Package("llguidance", "llguidance", "structured output (response_format, guided_*) and tool-call grammars")
REQUEST_PACKAGES = {p.module: p for p in (LLGUIDANCE,)}  # needed by some requests only


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that fails to import, or a module hidden (sys.modules[m] = None)
        return False


def _cuda_here(cfg: Config) -> bool:
    """Whether the torch runner will run on CUDA, without importing torch (seconds, in this process)."""
    return cfg.device == "cuda" or (cfg.device == "auto" and Path("/dev/nvidiactl").exists())


def runner_kind(cfg: Config) -> str | None:
    """The runner the engine will pick (serving/compose.py's rule), None when the directory decides and
    cannot be read yet (the loader names what is wrong with it)."""
    if cfg.runner != "auto":
        return cfg.runner
    d = cfg.model_dir
    if not d or (d.rstrip("/") == "/models" and not Path(d).is_dir()):
        return "paddle"  # the demo model: a Paddle export
    from llmserve.models.layout import ModelFormatError, detect_model_format

    try:
        return "paddle" if detect_model_format(d) == "paddle" else "torch"
    except ModelFormatError:
        return None


def needed(cfg: Config) -> list[tuple[Package, str]]:
    """The packages this configuration needs, each with the setting that needs it."""
    kind = runner_kind(cfg)
    where = f"LLMSERVE_RUNNER={cfg.runner}" if cfg.runner != "auto" else f"MODEL_DIR={cfg.model_dir or '(the demo)'}"
    out: list[tuple[Package, str]] = []
    if kind == "paddle":
        out.append((PADDLE, where))
    if kind == "torch":
        out.append((TORCH, where))
        if _cuda_here(cfg) and not parse_kernel_switches(cfg.kernel_switches).get("ref"):
            device = f"LLMSERVE_DEVICE={cfg.device}" + (" (a GPU is present)" if cfg.device == "auto" else "")
            out.append((TRITON, f"{where} with {device} (and no ref=1 in LLMSERVE_KERNEL_SWITCHES)"))
    if cfg.mp_num > 1 and kind != "torch":  # the ranks talk through torch.distributed
        out.append((Package("torch", "torch", "tensor parallelism (torch.distributed)"), f"MP_NUM={cfg.mp_num}"))
    if cfg.service_http_port != -1:  # the front end (supervisor.http_frontend_enabled)
        out += [
            (FASTAPI, f"SERVICE_HTTP_PORT={cfg.service_http_port}"),
            (UVICORN, f"SERVICE_HTTP_PORT={cfg.service_http_port}"),
        ]
    return out


def problems(cfg: Config) -> list[str]:
    """One line per missing package the configuration needs."""
    return [
        f"{setting} needs the package {p.dist} ({p.feature}), which is not installed for {_python()}: "
        f"pip install {p.dist}, or change {setting.split('=')[0]}"
        for p, setting in needed(cfg)
        if not installed(p.module)
    ]


def features_off() -> list[str]:
    """One line per request feature that is off here, for the start's log."""
    return [
        f"{p.feature} is off: the package {p.dist} is not installed (pip install {p.dist}); "
        f"such requests get {NOT_IMPLEMENTED}"
        for p in REQUEST_PACKAGES.values()
        if not installed(p.module)
    ]


def request_error(e: ImportError) -> str | None:
    """The message a request gets when it needed a package that is missing here; None when `e` is
    about no such package (a bug, answered as one)."""
    name = (getattr(e, "name", None) or "").split(".")[0]
    p = REQUEST_PACKAGES.get(name)
    if p is None:
        return None
    return f"{p.feature} needs the package {p.dist}, which is not installed on this server (pip install {p.dist})"


def _python() -> str:
    import sys

    return sys.executable
