#!/usr/bin/env bash
# Prepare .whl/: what an offline GPU box needs to run the whole stack (start_server.sh: supervisor,
# tritonserver with our Python-backend model, the engine with the torch runner, the FastAPI front end)
# and `llmserve bench` (native, openai-completions, triton-grpc, engine), and pytest for
# scripts/lab/device_gpu_tests.sh, beyond what its image has.
#
# The box (docs/gpu.md, /work/.library/device/KINDS.md): Python 3.12 with torch, numpy 2, transformers,
# tokenizers, safetensors, jinja2, grpcio, protobuf, msgpack, prometheus-client, aiohttp, ... and no
# network. Written here (about 45 MB together; the device tool carries at most 64 MiB with the tree):
#   .whl/*.whl                  pip install --no-index --no-deps --target /tmp/site .whl/*.whl
#   .whl/pytriton-min.tar.xz    nvidia-pytriton cut down to tritonserver, libtritonserver and the
#                               libraries they load, the Python backend and the cp312 stub (24 MiB
#                               instead of 55): unpack into /tmp/site beside the wheels
#   .whl/stub-numpy.tar.xz      numpy<2 for the Triton stub alone (Triton 2.51's stub misreads numpy 2
#                               arrays): unpack into a directory named by LLMSERVE_TRITON_STUB_PYTHONPATH
# scripts/lab/device_stack_bench.sh installs all three. Versions are those of this checkout's .venv (what
# the tests ran with; PY=... names another interpreter that has the stack installed).
#
#   scripts/lab/device_wheels.sh                 # into .whl/ (PY_VERSION=3.12)
#   DEST=/tmp/w PY_VERSION=3.11 scripts/lab/device_wheels.sh   # the same for another Python (to test here)
#   CARRY_GRPCIO=0 scripts/lab/device_wheels.sh  # trust the box's grpcio (tritonclient 2.73 needs >= 1.81.1)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$HERE"
DEST="${DEST:-$HERE/.whl}"
PY_VERSION="${PY_VERSION:-3.12}"
CARRY_GRPCIO="${CARRY_GRPCIO:-1}"
PY="${PY:-$HERE/.venv/bin/python}"
[[ -x "$PY" ]] || PY="$(command -v python3)"

# The wheel set is derived from pyproject.toml (scripts/lab/device_wheel_set.py: the closure of what
# `pip install .[serve]` installs, plus pytest, at this .venv's versions, less what the box's image
# has): a GPU box gets every runtime dependency a pip install would (llguidance was once missing
# from a hand-written list: every structured-output request failed there).
#   "$PY" scripts/lab/device_wheel_set.py --why   # the set, and what is left out and why
mapfile -t specs < <("$PY" "$HERE/scripts/lab/device_wheel_set.py" --python "$PY_VERSION")
[[ "${#specs[@]}" -gt 0 ]] || { echo "device_wheel_set.py gave no wheels" >&2; exit 1; }
[[ "$CARRY_GRPCIO" == 1 ]] || mapfile -t specs < <(printf '%s\n' "${specs[@]}" | grep -v '^grpcio==')
declare -A FALLBACK=([nvidia-pytriton]=0.7.0 [numpy]=1.26.4)  # the two carried cut down, when the .venv lacks them
ts() { echo "[$(date +%H:%M:%S)] $*"; }
version_of() {  # the .venv's version of a distribution, else the fallback pin
  "$PY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: print('')" "$1" 2>/dev/null | grep . || echo "${FALLBACK[$1]}"
}
PLATFORMS=()
for p in manylinux_2_17 manylinux_2_24 manylinux_2_26 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35 manylinux2014 manylinux1; do
  PLATFORMS+=(--platform "${p}_x86_64")
done
download() {  # download NAME==VERSION ... into $1
  local d="$1"
  shift
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    "${PLATFORMS[@]}" -d "$d" "$@" 2>&1 | grep -v "^WARNING: Location" || true
}

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$DEST"
ts "wheels: ${specs[*]}"
download "$TMP/w" "${specs[@]}"
n=$(ls "$TMP"/w/*.whl | wc -l)
[[ "$n" -eq "${#specs[@]}" ]] || { echo "expected ${#specs[@]} wheels, got $n" >&2; exit 1; }
for w in "$TMP"/w/*.whl; do  # replace other versions of the same packages (only those: .whl may hold others)
  b="$(basename "$w")"
  rm -f "$DEST/${b%%-*}"-*.whl
  mv "$w" "$DEST/"
done
PYTRITON="nvidia-pytriton==$(version_of nvidia-pytriton)"
NUMPY1="numpy==$(version_of numpy)"
case "$NUMPY1" in numpy==1.*) ;; *) NUMPY1="numpy==${FALLBACK[numpy]}" ;; esac
ts "downloading $PYTRITON and $NUMPY1 (for the stub) to cut down"
download "$TMP/dl" "$PYTRITON" "$NUMPY1"

# Unpack, keep what is used, and pack with xz (binaries shrink to about 2/3 of their zip size).
"$PY" - "$TMP" "$PY_VERSION" <<'PY'
import os, shutil, subprocess, sys, zipfile
from pathlib import Path

tmp, pyver = Path(sys.argv[1]), sys.argv[2]
(whl,) = (tmp / "dl").glob("nvidia_pytriton-*.whl")
src = tmp / "pytriton-full"
zipfile.ZipFile(whl).extractall(src)
for f in src.rglob("*"):  # zipfile drops the mode bits
    if f.is_file() and (f.suffix == ".so" or ".so." in f.name or f.parent.name == "bin" or f.name.endswith("_stub")):
        f.chmod(0o755)
ts = src / "pytriton" / "tritonserver"
keep = [
    ts / "bin" / "tritonserver",
    ts / "backends" / "python" / "libtriton_python.so",
    ts / "backends" / "python" / "triton_python_backend_utils.py",
    ts / "python_backend_stubs" / pyver / "triton_python_backend_stub",
]
for k in keep:
    assert k.is_file(), f"{k} is not in {whl.name}"
# The bundled libraries these load, transitively (RPATH points into nvidia_pytriton.libs).
libs_dir = src / "nvidia_pytriton.libs"
env = dict(os.environ, LD_LIBRARY_PATH=str(libs_dir))
needed, todo = set(), [k for k in keep if not k.name.endswith(".py")]
while todo:
    out = subprocess.run(["ldd", str(todo.pop())], capture_output=True, text=True, env=env).stdout
    for line in out.splitlines():
        parts = line.split("=>")
        if len(parts) != 2 or not parts[1].strip().startswith("/"):
            continue
        path = Path(parts[1].split("(")[0].strip()).resolve()  # found through LD_LIBRARY_PATH or an RPATH
        if path.parent == libs_dir.resolve():
            name = path.name
            if name not in needed:
                needed.add(name)
                todo.append(libs_dir / name)
assert any(n.startswith("libtritonserver") for n in needed), needed
dst = tmp / "pytriton-min"
for k in keep + [libs_dir / n for n in sorted(needed)]:
    t = dst / k.relative_to(src)
    t.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(k, t)
(dst / "pytriton" / "__init__.py").write_text(
    '"""nvidia-pytriton cut down by scripts/lab/device_wheels.sh: tritonserver, its libraries, the Python backend."""\n'
)
print(f"pytriton-min: {len(keep)} files + {len(needed)} libraries, "
      f"{sum(f.stat().st_size for f in dst.rglob('*') if f.is_file()) / 2**20:.0f} MiB unpacked")

# numpy<2 for the stub: drop tests, headers, f2py/distutils, type stubs; keep the libraries.
(whl,) = (tmp / "dl").glob("numpy-*.whl")
np_dst = tmp / "stub-numpy"
zipfile.ZipFile(whl).extractall(np_dst)
for f in np_dst.rglob("*"):
    if f.is_file() and (f.suffix == ".so" or ".so." in f.name):
        f.chmod(0o755)
drop = ["numpy/f2py", "numpy/distutils", "numpy/_pyinstaller", "numpy/core/include", "numpy/core/lib",
        "numpy/random/lib", "numpy/random/_examples", "numpy/array_api", "numpy/typing/tests"]
for d in drop:
    shutil.rmtree(np_dst / d, ignore_errors=True)
for f in list(np_dst.rglob("*")):
    if f.is_dir() and f.name == "tests":
        shutil.rmtree(f, ignore_errors=True)
    elif f.is_file() and (f.suffix in (".pyi", ".pxd") or f.name.startswith("_simd.")):
        f.unlink()
print(f"stub-numpy: {sum(f.stat().st_size for f in np_dst.rglob('*') if f.is_file()) / 2**20:.0f} MiB unpacked")
PY

ts "packing (xz -9, a minute or two)"
(cd "$TMP/pytriton-min" && tar -cf - pytriton nvidia_pytriton.libs | xz -9 -T0 >"$DEST/pytriton-min.tar.xz")
(cd "$TMP/stub-numpy" && tar -cf - numpy numpy.libs numpy-*.dist-info | xz -9 -T0 >"$DEST/stub-numpy.tar.xz")

# .whl/ stays out of git (and so travels only when named in the device tool's `carry`).
EXCLUDE="$(git rev-parse --git-common-dir 2>/dev/null)/info/exclude" || true
if [[ -n "${EXCLUDE%/info/exclude}" && "$DEST" == "$HERE/.whl" ]]; then
  mkdir -p "$(dirname "$EXCLUDE")"
  grep -qxF "/.whl/" "$EXCLUDE" 2>/dev/null || echo "/.whl/" >>"$EXCLUDE"
fi

ts "carried files:"
ls -l "$DEST"/*.whl "$DEST"/*.tar.xz | awk '{n = split($9, a, "/"); printf "  %8.2f MiB  %s\n", $5 / 1048576, a[n]}'
total=$(du -cb "$DEST"/*.whl "$DEST"/*.tar.xz | tail -1 | cut -f1)
tree=$({ git ls-files -z | xargs -0 du -cb 2>/dev/null || true; } | tail -1 | cut -f1)
awk -v t="$total" -v r="$tree" 'BEGIN { printf "total %.1f MiB (+ %.1f MiB of tracked files; the device tool carries at most 64 MiB)\n", t / 1048576, r / 1048576 }'
[[ "$total" -lt $((58 * 1048576)) ]] || { echo "too large for the device tool" >&2; exit 1; }
