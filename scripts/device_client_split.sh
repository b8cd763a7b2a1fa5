#!/usr/bin/env bash
# Is the benchmark client the bound on TTFT at high concurrency? Triton gRPC at concurrency 256 from one
# client process, then the same load split over two client processes (128 each), on a running-stack-free
# GPU box after device_stack_bench.sh (reuses its model, wheels and settings). Fresh seeds: no prefix hits.
PROBE=client-split
# shellcheck source=device_probe_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_probe_env.sh"
bench() { bench_grpc "$@" --num-warmups 4; }  # bench NAME PROMPTS CONCURRENCY SEED
start_stack
bench one-client 1024 256 11
bench two-clients-a 512 128 12 &
bench two-clients-b 512 128 13 &
wait
timeout 60 ./stop_server.sh >/dev/null 2>&1
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
for f in sorted(Path(sys.argv[1]).glob("*client*.json")):
    r = json.loads(f.read_text())["runs"][0]
    print(f"{f.stem:<16} c={r['max_concurrency']:<4} {r['completed']}/{r['num_requests']} ok  "
          f"{r['output_throughput']:8.1f} out tok/s  TTFT p50 {r['ttft_ms']['median']:7.1f} ms  "
          f"p90 {r['ttft_ms']['p90']:7.1f}  TPOT p50 {r['tpot_ms']['median']:6.2f} ms")
PY
