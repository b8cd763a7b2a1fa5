#!/usr/bin/env bash
# Where does the served TTFT go? Triton gRPC at concurrency 256 over 1,024 prompts (fresh seed), with the
# client's per-request timings (--save-requests) and the engine server's own TTFT histogram (arrival at the
# engine server to its first token there) scraped before and after. Run after device_stack_bench.sh on the
# GPU box (it reuses its model and carried packages).
PROBE=ttft-where
# shellcheck source=device_probe_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_probe_env.sh"
export METRICS_HTTP_PORT=8722
start_stack
scrape() { python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8722/metrics').read().decode())" | grep '^llmserve_time_to_first_token_seconds' >"$OUT/$1.prom"; }
sleep 1; scrape before
bench_grpc client 1024 256 21 --num-warmups 8 --save-requests
sleep 1.5; scrape after
timeout 60 ./stop_server.sh >/dev/null 2>&1
python3 - "$OUT" <<'PY'
import json, re, sys
from pathlib import Path
out = Path(sys.argv[1])
def buckets(name):
    b = {}
    for line in (out / f"{name}.prom").read_text().splitlines():
        m = re.match(r'llmserve_time_to_first_token_seconds_bucket\{le="([^"]+)"\} (\S+)', line)
        if m:
            b[float(m.group(1))] = float(m.group(2))
    return b
before, after = buckets("before"), buckets("after")
server = {le: after[le] - before.get(le, 0.0) for le in after}
total = server[float("inf")]
run = json.loads((out / "client.json").read_text())["runs"][0]
ttfts = sorted(r["ttft"] for r in run.get("requests", []) if r.get("success"))
print(f"requests: server saw {total:.0f}, client timed {len(ttfts)}; client TTFT p50 {run['ttft_ms']['median']:.1f} ms")
print(f"{'TTFT <=':>10} {'server share':>13} {'client share':>13}")
for le in sorted(server):
    if le == float("inf"):
        continue
    c = sum(t <= le for t in ttfts) / max(1, len(ttfts))
    print(f"{le:>9.3f}s {server[le] / max(1, total):>13.3f} {c:>13.3f}")
PY
