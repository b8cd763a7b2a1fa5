#!/usr/bin/env bash
# Issue 14 on one GPU: kernels/skinny.py's GPU tests (PART=tests), scripts/lab/sweep_skinny.py (PART=sweep: the kernel
# against cuBLAS and the one-row GEMV on the 8B projections), and the batch-1 oracle (PART=spec: bench_spec.py
# --oracle --batches 1, the verification step against a plain one) with the kernel switch skinny
# (LLMSERVE_KERNEL_SWITCHES=skinny=...) at each of SPEC_SKINNY, one process each (default "1 0 1 0": alternated,
# as two processes of the same code differ by ~2%).
#   OUT=$OUT PART=tests,sweep,spec SWEEP_ARGS="--rows 2,5,16" SPEC_SKINNY="1 0 1 0" SPEC_BATCHES=1,16 scripts/lab/device_skinny.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/skinny-out}"
mkdir -p "$OUT"
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH="$PWD/server:$PWD/scripts:$PWD/tests:/tmp/site"
PARTS="${PART:-tests,sweep,spec}"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
if [[ $PARTS == *tests* ]]; then
  # shellcheck disable=SC2086
  timeout "${TEST_TIMEOUT:-200}" python -m pytest -q -p no:cacheprovider ${TEST_FILES:-tests/test_skinny.py} -m gpu \
    > "$OUT/gpu_tests.log" 2>&1
  echo "tests rc $?"; tail -5 "$OUT/gpu_tests.log"
fi
if [[ $PARTS == *sweep* ]]; then
  # shellcheck disable=SC2086
  timeout "${SWEEP_TIMEOUT:-300}" python scripts/lab/sweep_skinny.py --out "$OUT/sweep.json" ${SWEEP_ARGS:-} > "$OUT/sweep.log" 2>&1
  echo "sweep rc $?"; grep -E "layer|skinny best" "$OUT/sweep.log" | cut -c1-400 | tail -30
fi
if [[ $PARTS == *spec* ]]; then
  i=0  # each process its own files: the setting alternates (SPEC_SKINNY="1 0 1 0"), its runs are compared
  for on in ${SPEC_SKINNY:-1 0 1 0}; do
    i=$((i + 1))
    LLMSERVE_KERNEL_SWITCHES=skinny=$on timeout "${SPEC_TIMEOUT:-170}" python scripts/bench_spec.py --oracle --batches "${SPEC_BATCHES:-1}" \
      --out "$OUT/spec_skinny${on}_$i.json" > "$OUT/spec_skinny${on}_$i.log" 2>&1
    echo "spec skinny=$on (run $i) rc $?"
    python - "$OUT/spec_skinny${on}_$i.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d.get("oracle", []):
    ks = " ".join(f"{k} {r[k]['ms_per_step']:.2f}ms {r[k]['speedup']:.2f}x" for k in ("k1", "k2", "k3", "k4", "k5", "adaptive") if k in r)
    print(f"  b{r['batch']}: plain {r['plain_ms_per_step']:.3f} ms; {ks}")
print("  verify k4 / plain:", d.get("oracle_verify_step_vs_plain_b1_k4"))
PY
  done
fi
cd "$OUT" && tar czf skinny_out.tgz ./*.json ./*.log ./*.txt 2>/dev/null; ls "$OUT"
