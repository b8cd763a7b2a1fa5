#!/usr/bin/env bash
# The tests that only a GPU runs, on the GPU box, in one call (CI has no GPU: they are skipped there).
#
#   scripts/lab/device_wheels.sh          # beforehand, on a machine with pip: .whl/ (pytest and pyzmq among them)
#   scripts/lab/device_gpu_tests.sh       # on the GPU box, from the repository root; carry .whl
#
# Runs every test file that has GPU tests (the kernels against their references, the runner's
# CUDA-graph and parity tests, quantized models, speculative decoding on the device, ...) with the
# 8B-shaped parity test on (LLMSERVE_GPU_BIG=1: 40 GB of GPU memory); their CPU tests run too. Writes
# $OUT/gpu_tests.log and $OUT/gpu_tests.xml (JUnit) and prints the summary. TESTS (the files), TIMEOUT
# (540 s) and PY (python3) override.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/gpu-tests}"
PY="${PY:-python3}"
mkdir -p "$OUT"
# The whole-stack tests need tritonserver (the cut-down nvidia-pytriton) and numpy<2 for its stub.
[[ -d .whl ]] && bash scripts/lab/device_install.sh /tmp/site /tmp/stub-site .whl "$PY"
[[ -d /tmp/stub-site/numpy ]] && export LLMSERVE_TRITON_STUB_PYTHONPATH=/tmp/stub-site
export PYTHONPATH="$PWD/server:/tmp/site" LLMSERVE_GPU_BIG="${LLMSERVE_GPU_BIG:-1}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
TESTS="${TESTS:-$(grep -lE "HAS_CUDA|cuda.is_available|mark.gpu" tests/test_*.py | tr '\n' ' ')}"
echo "files: $TESTS"
# shellcheck disable=SC2086
timeout "${TIMEOUT:-540}" "$PY" -m pytest -q -p no:cacheprovider -rfE --junitxml "$OUT/gpu_tests.xml" $TESTS \
  >"$OUT/gpu_tests.log" 2>&1
rc=$?
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -30
echo "pytest rc $rc"
exit $rc
