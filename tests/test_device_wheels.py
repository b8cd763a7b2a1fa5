"""The GPU box's wheel set (scripts/lab/device_wheel_set.py, which scripts/lab/device_wheels.sh downloads) is
derived from pyproject.toml: every runtime dependency a `pip install .[serve]` brings, transitively,
is carried, on the box, or left out with its reason. (Nothing is downloaded here.)"""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys

import tomllib
from packaging.requirements import Requirement

from llmserve.serving.testing import ROOT

SCRIPT = ROOT / "scripts" / "lab" / "device_wheel_set.py"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def run() -> tuple[dict[str, str], dict[str, str]]:
    r = subprocess.run([sys.executable, str(SCRIPT), "--why"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    carried = dict(line.split("==") for line in r.stdout.splitlines())
    left = {}
    for line in r.stderr.splitlines():
        name, why = line.removeprefix("# not carried: ").split(": ", 1)
        left[name] = why
    return carried, left


def test_every_runtime_dependency_is_carried_on_the_box_or_left_out_with_a_reason():
    carried, left = run()
    assert not set(carried) & set(left)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for spec in project["dependencies"] + project["optional-dependencies"]["serve"]:
        name = canonical(Requirement(spec).name)
        assert name in carried or name in left, f"{name} ({spec}) is neither carried nor left out"
    # What the hand-written list lacked, and what only the closure brings (pydantic's core, fastapi's starlette,
    # uvicorn[standard]'s extras), at this interpreter's versions.
    for name in ("llguidance", "pydantic-core", "starlette", "httptools", "watchfiles", "pyzmq", "tritonclient"):
        assert carried.get(name) == md.version(name), (name, carried.get(name))
    # A package on the box, or never carried, says why; its own needs are not followed.
    assert left["paddlepaddle"].startswith("the Paddle runner") and left["jinja2"] == "on the box"
    assert "opt-einsum" not in carried  # paddlepaddle's, which the box's torch image has anyway


def test_device_wheels_sh_downloads_the_derived_set():
    script = (ROOT / "scripts" / "lab" / "device_wheels.sh").read_text()
    assert "device_wheel_set.py" in script and "PACKAGES=(" not in script
    r = subprocess.run(
        ["bash", "-n", str(ROOT / "scripts" / "lab" / "device_wheels.sh")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
