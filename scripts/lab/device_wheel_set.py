"""The wheels a GPU box needs, derived from pyproject.toml (scripts/lab/device_wheels.sh downloads them; Python 3.11+).

The roots are what `pip install .[serve]` installs, plus pytest (scripts/device_gpu_tests.sh). Their
closure is resolved from the installed distributions' metadata (Requires-Dist, with the extras asked
for and the markers evaluated for the box: CPython PY_VERSION on Linux x86_64), at the versions this
interpreter has (what the tests ran with). What the box's image already has is left out (BOX: its
package list, KINDS.md, read 2026-11-17), except where a newer version is needed (CARRY_ANYWAY); a
few are never carried (NOT_CARRIED, each with why).

  python scripts/lab/device_wheel_set.py [--python 3.12]          name==version, one a line
  python scripts/lab/device_wheel_set.py --why                     also what was left out, and why
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import sys
from pathlib import Path

import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = ("serve",)
ALSO = ("pytest",)  # scripts/device_gpu_tests.sh

# The GPU image's packages (/work/.library/device/KINDS.md, "Python packages already there", 2026-11-17).
BOX = set(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp""".split()
)
# On the box, but at a version older than the stack needs (seen there; the hand-written list carried them).
CARRY_ANYWAY = {
    "grpcio": "tritonclient 2.73 needs grpcio >= 1.81.1 (CARRY_GRPCIO=0 trusts the box's)",
    "protobuf": "tritonclient's generated gRPC code needs the protobuf it was built with",
    "typing-extensions": "pydantic 2.1x needs a newer one",
    "uvloop": "uvicorn[standard]'s event loop, at the version the tests ran with",
    "pytest": "scripts/device_gpu_tests.sh, at the version the tests ran with",
    "pluggy": "pytest's, at its version",
    "iniconfig": "pytest's, at its version",
}
NOT_CARRIED = {
    "paddlepaddle": "the Paddle runner (CPU): a GPU box serves with the torch runner; 100+ MB, over the 64-MiB carry",
    "nvidia-pytriton": "carried cut down (pytriton-min.tar.xz: tritonserver and what it loads)",
    "numpy": "the box's numpy 2 serves the engine; the Triton stub gets numpy<2 of its own (stub-numpy.tar.xz)",
}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def roots(pyproject: Path) -> list[Requirement]:
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in EXTRAS:
        reqs += project["optional-dependencies"][extra]
    return [Requirement(r) for r in reqs] + [Requirement(a) for a in ALSO]


def closure(reqs: list[Requirement], python: str) -> dict[str, str]:
    """Every distribution `reqs` need on the box, transitively: canonical name -> installed version. The
    needs of one on the box, or never carried, are not followed."""
    env = default_environment()
    env.update(python_version=python, python_full_version=f"{python}.0", sys_platform="linux")
    env.update(platform_system="Linux", platform_machine="x86_64", implementation_name="cpython")
    env["platform_python_implementation"] = "CPython"
    seen: dict[str, str] = {}
    todo = [(r, "") for r in reqs]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({**env, "extra": extra}):
            continue
        name = canonical(req.name)
        key = f"{name}[{','.join(sorted(req.extras))}]"
        if key in seen:
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            sys.exit(f"device_wheel_set: {req.name} (needed: {req}) is not installed for {sys.executable}")
        seen[key] = dist.version
        if name in NOT_CARRIED or (name in BOX and name not in CARRY_ANYWAY):
            continue  # what it needs is the box's (its image is whole) or comes with it (cut down)
        for sub in dist.requires or []:
            r = Requirement(sub)
            for e in req.extras or {""}:
                todo.append((r, e))
            if req.extras:
                todo.append((r, ""))
    out: dict[str, str] = {}
    for key, version in seen.items():
        out[key.split("[")[0]] = version
    return out


def wheel_set(python: str) -> tuple[dict[str, str], dict[str, str]]:
    """(carried: name -> version, left out: name -> why)."""
    carried, left = {}, {}
    for name, version in sorted(closure(roots(ROOT / "pyproject.toml"), python).items()):
        if name in NOT_CARRIED:
            left[name] = NOT_CARRIED[name]
        elif name in BOX and name not in CARRY_ANYWAY:
            left[name] = "on the box"
        else:
            carried[name] = version
    return carried, left


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", default="3.12", help="the box's Python (markers are evaluated for it)")
    ap.add_argument("--why", action="store_true", help="also list what is left out, and why")
    args = ap.parse_args()
    carried, left = wheel_set(args.python)
    for name, version in carried.items():
        print(f"{name}=={version}")
    if args.why:
        for name, why in left.items():
            print(f"# not carried: {name}: {why}", file=sys.stderr)


if __name__ == "__main__":
    main()
