#!/usr/bin/env bash
# Is the benchmark client the bound on TTFT at high concurrency? Triton gRPC at concurrency 256 from one
# client process, then the same load split over two client processes (128 each), on a running-stack-free
# GPU box after device_stack_bench.sh (reuses its model, wheels and settings). Fresh seeds: no prefix hits.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
OUT="${OUT:-/tmp/llmserve-client-split}"
mkdir -p "$OUT/split"
export PYTHONPATH="$REPO/server:${SITE:-/tmp/site}" LLMSERVE_TRITON_STUB_PYTHONPATH="${STUB_SITE:-/tmp/stub-site}"
export MODEL_DIR="${MODEL_DIR:-/dev/shm/llmserve-random-v3-llama3-8b}" BATCH_SIZE=256 MAX_CACHED_TASK_NUM=2048
export SERVICE_HTTP_PORT=-1 LOG_DIR=/tmp/llmserve-client-split/log
bench() {  # bench NAME PROMPTS CONCURRENCY SEED
  timeout 200 python3 -m llmserve.cli bench --backend triton-grpc --model "$MODEL_DIR" --workload random \
    --input-len 512 --output-len 256 --range-ratio 0 --temperature 0 --num-prompts "$2" --max-concurrency "$3" \
    --seed "$4" --num-warmups 4 --no-plots --no-progress --out-dir "$OUT/split" --result-name "$1" >"$OUT/split/$1.log" 2>&1
}
timeout 300 ./start_server.sh >"$OUT/split/start.log" 2>&1 || { tail -20 "$OUT/split/start.log"; exit 1; }
bench one-client 1024 256 11
bench two-clients-a 512 128 12 &
bench two-clients-b 512 128 13 &
wait
timeout 60 ./stop_server.sh >/dev/null 2>&1
python3 - "$OUT/split" <<'PY'
import json, sys
from pathlib import Path
for f in sorted(Path(sys.argv[1]).glob("*.json")):
    r = json.loads(f.read_text())["runs"][0]
    print(f"{f.stem:<16} c={r['max_concurrency']:<4} {r['completed']}/{r['num_requests']} ok  "
          f"{r['output_throughput']:8.1f} out tok/s  TTFT p50 {r['ttft_ms']['median']:7.1f} ms  "
          f"p90 {r['ttft_ms']['p90']:7.1f}  TPOT p50 {r['tpot_ms']['median']:6.2f} ms")
PY
