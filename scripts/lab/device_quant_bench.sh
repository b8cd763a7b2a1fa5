#!/usr/bin/env bash
# Issue 15 (quantization) on the GPU box, in one call: the kernels' GPU tests, the GEMM benchmark,
# the 8B speed table and (PART=fidelity) the fidelity table. Results under $OUT.
#   PART=tests,gemm,speed (default) | any comma list of tests, gemm, speed, fidelity
# Carries .whl (scripts/lab/device_wheels.sh: pytest, pyzmq, ... for Python 3.12).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/quant-out}"
mkdir -p "$OUT"
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH="$PWD/server:/tmp/site"
PARTS="${PART:-tests,gemm,speed}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if [[ $PARTS == *tests* ]]; then
  TESTS="${TESTS:-tests/test_quant_gemm.py tests/test_fp8_gemm.py tests/test_kv_quant.py tests/test_torch_runner.py tests/test_quant_model.py}"
  # shellcheck disable=SC2086
  timeout 420 python -m pytest -q -p no:cacheprovider $TESTS -k "gpu or GPU or cuda or graph or match" \
    > "$OUT/gpu_tests.log" 2>&1
  echo "tests rc $?" | tee -a "$OUT/gpu_tests.log"
  tail -25 "$OUT/gpu_tests.log"
fi
if [[ $PARTS == *gemm* ]]; then
  timeout 300 python scripts/lab/bench_quant_gemm.py --out "$OUT/gemm.json" > "$OUT/gemm.log" 2>&1
  echo "gemm rc $?"; tail -40 "$OUT/gemm.log"
  timeout 120 python scripts/lab/bench_fp8_gemm.py > "$OUT/fp8_gemm.log" 2>&1
  echo "fp8 rc $?"; tail -20 "$OUT/fp8_gemm.log"
fi
if [[ $PARTS == *speed* ]]; then
  timeout "${SPEED_TIMEOUT:-480}" python scripts/bench_quant.py speed --out "$OUT/speed.json" > "$OUT/speed.log" 2>&1
  echo "speed rc $?"; grep -v "^\s*$" "$OUT/speed.log" | tail -20
fi
if [[ $PARTS == *fidelity* ]]; then
  timeout 400 python scripts/bench_quant.py fidelity --out "$OUT/fidelity.json" > "$OUT/fidelity.log" 2>&1
  echo "fidelity rc $?"; tail -12 "$OUT/fidelity.log"
fi
