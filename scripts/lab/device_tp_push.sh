#!/usr/bin/env bash
# Issue 17 on several GPUs: the GEMV's and the fused sum's GPU tests, then scripts/bench_tp.py's batch-1
# decode, profiled, once per entry of RUNS (each its own process): NAME:MPS, where a NAME holding "nopush"
# sets the kernel switch tp_gemv_push=0 (bench_tp.py --no-push) and one holding "nofuse" gemv_fuse=0
# (LLMSERVE_KERNEL_SWITCHES=gemv_fuse=0); MPS the MP_NUM values beside 1 (one process takes symmetric memory
# for one group only: MP_NUM=4 in its own run);
# a NAME holding "check" runs the correctness check only (greedy tokens against MP_NUM=1).
# Results in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/tp-push-out}"
mkdir -p "$OUT"
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH="$PWD/server:$PWD/scripts:$PWD/tests:/tmp/site" NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
if [[ "${TESTS:-1}" == 1 ]]; then
  timeout 300 python -m pytest -q -p no:cacheprovider tests/test_sum_norm_gpu.py tests/test_gemv.py -m gpu \
    > "$OUT/gpu_tests.log" 2>&1
  echo "tests rc $?"; tail -3 "$OUT/gpu_tests.log"
fi
for entry in ${RUNS:-push:2 nopush:2 push2:2}; do
  run=${entry%%:*} mps=${entry#*:} flag="" fuse=1 skip=check,allreduce
  [[ $run == *nopush* ]] && flag=--no-push
  [[ $run == *check* ]] && skip=decode,allreduce
  [[ $run == *nofuse* ]] && fuse=0
  # shellcheck disable=SC2086
  LLMSERVE_KERNEL_SWITCHES=gemv_fuse=$fuse timeout "${RUN_TIMEOUT:-170}" python scripts/bench_tp.py --mp "$mps" --skip "$skip" \
    --profile $flag --out "$OUT/tp_$run.json" > "$OUT/tp_$run.log" 2>&1
  echo "$run rc $?"
  grep -E "^(decode|check) MP_NUM" "$OUT/tp_$run.log" | cut -c1-400
done
# one file back for the runs (the device tool returns a few files a call)
(cd "$OUT" && tar czf tp_runs.tgz tp_*.json tp_*.log && rm -f tp_*.json tp_*.log)
