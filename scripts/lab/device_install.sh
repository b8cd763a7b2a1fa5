#!/usr/bin/env bash
# Install what scripts/lab/device_wheels.sh packed into .whl/ on the GPU box:
#   scripts/lab/device_install.sh SITE STUB_SITE WHL [PY]
# the wheels into SITE (pip --target, offline), the cut-down nvidia-pytriton into SITE beside them, and
# numpy<2 for the Triton stub into STUB_SITE (LLMSERVE_TRITON_STUB_PYTHONPATH). Used by
# device_stack_bench.sh and device_gpu_tests.sh.
set -euo pipefail
SITE="$1" STUB_SITE="$2" WHL="$3" PY="${4:-python3}"
if compgen -G "$WHL/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHL"/*.whl
  echo "installed $(ls "$WHL"/*.whl | wc -l) wheels into $SITE"
fi
"$PY" - "$SITE" "$STUB_SITE" "$WHL" <<'PY'
import sys, tarfile
from pathlib import Path
for name, dest in (("pytriton-min.tar.xz", sys.argv[1]), ("stub-numpy.tar.xz", sys.argv[2])):
    p = Path(sys.argv[3]) / name
    if p.is_file():
        with tarfile.open(p) as t:
            t.extractall(dest, **({"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}))
        print(f"unpacked {name} into {dest}")
PY
