#!/usr/bin/env bash
# Issue 15/17 on one GPU: kernels/gemv.py's GPU tests, then the 8B batch-1 decode with the GEMV on and off
# (bench_quant.py speed, one process each, kernels profiled; or another kernel switch: SPEED_SWITCH), then
# (PART=sweep) scripts/lab/sweep_gemv.py.
#   PART=tests,speed (default) | sweep   FORMATS=",weight_only_int8,fp8"   SWEEP_ARGS="--formats bf16"
#   SPEED_SWITCH=gemv_fuse SPEED_VALUES="1 0": the speed runs' kernel switch (LLMSERVE_KERNEL_SWITCHES) and its
#   values (default gemv, 1 0)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/gemv-out}"
mkdir -p "$OUT"
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH="$PWD/server:$PWD/scripts:$PWD/tests:/tmp/site"
PARTS="${PART:-tests,speed}"
FORMATS="${FORMATS:-,weight_only_int8,fp8}"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
if [[ $PARTS == *tests* ]]; then
  timeout 240 python -m pytest -q -p no:cacheprovider tests/test_gemv.py tests/test_quant_gemm.py \
    tests/test_fp8_gemm.py -m gpu > "$OUT/gpu_tests.log" 2>&1
  echo "tests rc $?"; tail -4 "$OUT/gpu_tests.log"
fi
if [[ $PARTS == *speed* ]]; then
  var="${SPEED_SWITCH:-gemv}"
  for val in ${SPEED_VALUES:-1 0}; do
    name="$var$val"
    LLMSERVE_KERNEL_SWITCHES="$var=$val" timeout 200 python scripts/bench_quant.py speed --formats "$FORMATS" --skip-kv --profile \
      --batches "${BATCHES:-}" --out "$OUT/speed_$name.json" > "$OUT/speed_$name.log" 2>&1
    echo "speed $name rc $?"
    python - "$OUT/speed_$name.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for f, r in d.get("weights", {}).items():
    top = ", ".join(f"{k[:28]} {n:g}x {us:g}" for k, n, us in r.get("b1_kernels_us_per_step", [])[:6])
    print(f"  {f}: b1 {r.get('b1_ms_per_step', 0):.3f} ms = {r.get('b1_vs_floor', 0):.3f}x floor {r.get('b1_floor_ms', 0):.3f}; {top}")
PY
  done
fi
if [[ $PARTS == *sweep* ]]; then
  # shellcheck disable=SC2086
  timeout "${SWEEP_TIMEOUT:-500}" python scripts/lab/sweep_gemv.py --out "$OUT/sweep.json" ${SWEEP_ARGS:-} > "$OUT/sweep.log" 2>&1
  echo "sweep rc $?"; grep -v "^check" "$OUT/sweep.log" | tail -16 | cut -c1-700
fi
