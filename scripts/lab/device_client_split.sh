#!/usr/bin/env bash
# Is the benchmark client the bound on TTFT at high concurrency? Triton gRPC at concurrency 256 from one
# client process, then the same load split over CLIENTS client processes (default 4, 256 / CLIENTS each),
# on a running-stack-free GPU box after device_stack_bench.sh (reuses its model, wheels and settings).
# Fresh seeds: no prefix hits. Each report has the client's CPU / wall time (near 1: the client paces).
PROBE=client-split
# shellcheck source=device_probe_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_probe_env.sh"
bench() { bench_grpc "$@" --num-warmups 4; }  # bench NAME PROMPTS CONCURRENCY SEED
start_stack
CLIENTS="${CLIENTS:-4}"
bench one-client 1024 256 11
for ((i = 0; i < CLIENTS; i++)); do
  bench "clients$CLIENTS-$i" $((1024 / CLIENTS)) $((256 / CLIENTS)) $((12 + i)) &
done
wait
timeout 60 ./stop_server.sh >/dev/null 2>&1
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
for f in sorted(Path(sys.argv[1]).glob("*client*.json")):
    r = json.loads(f.read_text())["runs"][0]
    print(f"{f.stem:<16} c={r['max_concurrency']:<4} {r['completed']}/{r['num_requests']} ok  "
          f"{r['output_throughput']:8.1f} out tok/s  TTFT p50 {r['ttft_ms']['median']:7.1f} ms  "
          f"p90 {r['ttft_ms']['p90']:7.1f}  TPOT p50 {r['tpot_ms']['median']:6.2f} ms  "
          f"ITL p50 {r['itl_ms']['median']:6.2f} ms  client CPU {r.get('client_cpu_share', 0):.2f}")
PY
