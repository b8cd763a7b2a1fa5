# Sourced by the device probe scripts (device_client_split.sh, device_ttft_where.sh): the stack's settings
# on the GPU box after device_stack_bench.sh (its model in /dev/shm, its carried packages), Triton gRPC only.
#   PROBE=name; source scripts/lab/device_probe_env.sh   -> $REPO (cwd), $OUT, start_stack, bench_grpc
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
OUT="${OUT:-/tmp/llmserve-$PROBE}"
mkdir -p "$OUT"
export PYTHONPATH="$REPO/server:${SITE:-/tmp/site}" LLMSERVE_TRITON_STUB_PYTHONPATH="${STUB_SITE:-/tmp/stub-site}"
export MODEL_DIR="${MODEL_DIR:-/dev/shm/llmserve-random-v3-llama3-8b}" BATCH_SIZE=256 MAX_CACHED_TASK_NUM=2048
export SERVICE_HTTP_PORT=-1 LOG_DIR="/tmp/llmserve-$PROBE/log"

start_stack() {  # start_stack: start_server.sh, or print its log and exit
  timeout 300 ./start_server.sh >"$OUT/start.log" 2>&1 || { tail -20 "$OUT/start.log"; exit 1; }
}

bench_grpc() {  # bench_grpc NAME PROMPTS CONCURRENCY SEED [more llmserve bench flags]: the issue's workload
  local name="$1" prompts="$2" conc="$3" seed="$4"
  shift 4
  timeout 240 python3 -m llmserve.cli bench --backend triton-grpc --model "$MODEL_DIR" --workload random \
    --input-len 512 --output-len 256 --range-ratio 0 --temperature 0 --num-prompts "$prompts" \
    --max-concurrency "$conc" --seed "$seed" --no-plots --no-progress --out-dir "$OUT" --result-name "$name" \
    "$@" >"$OUT/$name.log" 2>&1
}
