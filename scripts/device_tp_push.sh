#!/usr/bin/env bash
# Issue 17 on several GPUs: the fused-sum GPU test (two GPUs), then scripts/bench_tp.py's batch-1 decode with
# the row-parallel GEMVs pushing their rows (LLMSERVE_TP_GEMV_PUSH, the default), without, and with again
# (each its own process, profiled; MPS="2,4" on four GPUs). Results in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/tp-push-out}"
mkdir -p "$OUT"
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH="$PWD/server:$PWD/scripts:$PWD/tests:/tmp/site" NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
if [[ "${TESTS:-1}" == 1 ]]; then
  timeout 200 python -m pytest -q -p no:cacheprovider tests/test_sum_norm_gpu.py > "$OUT/sum_norm_test.log" 2>&1
  echo "test rc $?"; tail -3 "$OUT/sum_norm_test.log"
fi
for run in ${RUNS:-push nopush push2}; do
  flag=""
  [[ $run == nopush* ]] && flag=--no-push
  # shellcheck disable=SC2086
  timeout "${RUN_TIMEOUT:-170}" python scripts/bench_tp.py --mp "${MPS:-2}" --skip check,allreduce --profile $flag \
    --out "$OUT/tp_$run.json" > "$OUT/tp_$run.log" 2>&1
  echo "$run rc $?"
  grep -E "^decode MP_NUM" "$OUT/tp_$run.log" | cut -c1-400
done
