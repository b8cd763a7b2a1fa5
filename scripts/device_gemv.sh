#!/usr/bin/env bash
# Issue 15/17 on one GPU: kernels/gemv.py's GPU tests, then the 8B batch-1 decode with the GEMV on and off
# (bench_quant.py speed, one process each, kernels profiled), then (PART=sweep) scripts/sweep_gemv.py, then
# (PART=spec) issue 14's batch-1 oracle (bench_spec.py --oracle) with LLMSERVE_GEMV at each of SPEC_GEMV.
#   PART=tests,speed (default) | sweep | spec   FORMATS=",weight_only_int8,fp8"   SWEEP_ARGS="--formats bf16"
#   SPEC_GEMV="5 1"
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gemv-out}"
mkdir -p "$OUT"
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH="$PWD/server:$PWD/scripts:$PWD/tests:/tmp/site"
PARTS="${PART:-tests,speed}"
FORMATS="${FORMATS:-,weight_only_int8,fp8}"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
if [[ $PARTS == *tests* ]]; then
  # shellcheck disable=SC2086
  timeout 240 python -m pytest -q -p no:cacheprovider ${TEST_FILES:-tests/test_gemv.py tests/test_quant_gemm.py \
    tests/test_fp8_gemm.py} -m gpu > "$OUT/gpu_tests.log" 2>&1
  echo "tests rc $?"; tail -4 "$OUT/gpu_tests.log"
fi
if [[ $PARTS == *speed* ]]; then
  for name in on off; do
    [[ $name == on ]] && gemv=1 || gemv=0
    LLMSERVE_GEMV=$gemv timeout 200 python scripts/bench_quant.py speed --formats "$FORMATS" --skip-kv --profile \
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
  timeout "${SWEEP_TIMEOUT:-500}" python scripts/sweep_gemv.py --out "$OUT/sweep.json" ${SWEEP_ARGS:-} > "$OUT/sweep.log" 2>&1
  echo "sweep rc $?"; grep -v "^check" "$OUT/sweep.log" | tail -16 | cut -c1-700
fi
if [[ $PARTS == *spec* ]]; then
  for rows in ${SPEC_GEMV:-5 1}; do
    LLMSERVE_GEMV=$rows timeout "${SPEC_TIMEOUT:-170}" python scripts/bench_spec.py --oracle --batches 1 \
      --out "$OUT/spec_gemv$rows.json" > "$OUT/spec_gemv$rows.log" 2>&1
    echo "spec LLMSERVE_GEMV=$rows rc $?"
    python - "$OUT/spec_gemv$rows.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d.get("oracle", []):
    ks = " ".join(f"{k} {r[k]['ms_per_step']:.2f}ms {r[k]['speedup']:.2f}x" for k in ("k1", "k2", "k3", "k4", "k5", "adaptive") if k in r)
    print(f"  b{r['batch']}: plain {r['plain_ms_per_step']:.3f} ms; {ks}")
print("  verify k4 / plain:", d.get("oracle_verify_step_vs_plain_b1_k4"))
PY
  done
fi
