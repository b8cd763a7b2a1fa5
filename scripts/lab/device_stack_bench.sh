#!/usr/bin/env bash
# The whole serving stack on a GPU box, benchmarked against the in-process engine, in one command.
#
#   scripts/lab/device_wheels.sh               # beforehand, on a machine with pip: .whl/ (carry it along)
#   scripts/lab/device_stack_bench.sh          # on the GPU box, from the repository root
#   SMALL=1 scripts/lab/device_stack_bench.sh  # a ~1B-shaped model and fewer prompts: a quick smoke test
#
# Steps, each bounded in time, with timestamps:
#  1. install .whl/ (if present): wheels into $SITE, the cut-down nvidia-pytriton beside them, numpy<2
#     for the Triton stub into $STUB_SITE (LLMSERVE_TRITON_STUB_PYTHONPATH); check imports and libraries;
#  2. build a random-weight Llama-3-8B-shaped bf16 HF checkpoint in /dev/shm (models/random_model.py;
#     SMALL: Llama-3.2-1B-shaped) with a byte-level BPE tokenizer of the model's vocabulary size;
#  3. phase "stack": start_server.sh on it (BATCH_SIZE=256, PUSH_MODE_HTTP_WORKERS=4), then
#     `llmserve bench` for each of $BACKENDS (native, openai-completions, triton-grpc), then stop it;
#  4. phase "engine": `llmserve bench --backend engine` (in-process; after the stack is stopped, as one
#     8B model at a time leaves the KV cache the same room);
#  5. phase "gpu" (RUN_BENCH_GPU=1): scripts/bench_gpu.py (single-stream decode vs the bandwidth floor,
#     offline throughput; BENCH_GPU_ARGS, default --skip-hf);
#  6. $OUT/stack_bench.json (every result, the settings, versions, step times, and each served bench's
#     intake hops: LLMSERVE_INTAKE_TRACE, scripts/lab/intake_report.py), $OUT/logs.tar.gz (server
#     and bench logs) and, last on stdout, a table: backend, concurrency, prompts, output tok/s, ratio to
#     the engine, TPOT p50, TTFT p50, its difference to the engine's, and (HTTP backends) TTFT p50 counted
#     from when the client wrote the request.
#
# Workload: --workload random --input-len 512 --output-len 256 --range-ratio 0, greedy; RUNS lists
# "prompts:concurrency[,concurrency]" sets (default "256:64,256 1024:256"; SMALL "64:16,64 128:64").
# Other settings (env): PHASES (stack,engine), BACKENDS, INPUT_LEN, OUTPUT_LEN, NUM_WARMUPS (1),
# CLIENT_PROCESSES (1: `llmserve bench --client-processes` of the served backends), BENCH_ARGS (more
# `llmserve bench` arguments for every bench, e.g. --save-requests),
# BATCH_SIZE, PUSH_MODE_HTTP_WORKERS, REPEATS (1: run every bench this many times, the engine's too; the
# table then adds each row's median over its runs, against the engine's median), MODEL_DIR (serve this model, build none), DEADLINE_S (540: no
# step runs past it, so that a 600 s limit leaves time to stop the stack and write the files),
# PY (python3), WHL (.whl), SITE (/tmp/site), STUB_SITE (/tmp/stub-site), SKIP_INSTALL=1,
# WORK (/tmp/llmserve-stack-bench), OUT (the device tool's), FRESH=1 (forget earlier results), and any
# llmserve setting (ports, KV cache, ...). CLIENT_CPUS / SERVER_CPUS (taskset lists, e.g. 12-15 / 0-11): pin
# the served benches' clients and the stack (and the in-process engine) to separate CPUs, as clients on
# other machines would be; unset: all share every CPU. CORE_CPUS (a taskset list inside SERVER_CPUS' complement,
# e.g. 0 with SERVER_CPUS=1-9): the served engine core's process, once started, moves there alone (every thread), so
# the stack's other processes never take its CPU. STEP_TRACE=1: LLMSERVE_STEP_TRACE of the served engine core into
# $OUT/steps-stack.txt and of the in-process engine into $OUT/steps-engine.txt (one line a step, docs/engine.md). Without a GPU (MODEL_DIR=<demo model>, tiny RUNS) it runs
# the same way on the CPU, which is how it is tested.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
export PYTHONUNBUFFERED=1
T_START=$SECONDS
DEADLINE_S="${DEADLINE_S:-540}"
SMALL="${SMALL:-0}"
PY="${PY:-$(command -v python3)}"
SITE="${SITE:-/tmp/site}"
STUB_SITE="${STUB_SITE:-/tmp/stub-site}"
WHL="${WHL:-$REPO/.whl}"
WORK="${WORK:-/tmp/llmserve-stack-bench}"
OUT="${OUT:-$WORK/out}"
PHASES="${PHASES:-stack,engine}"
[[ "${RUN_BENCH_GPU:-0}" == 1 ]] && PHASES="$PHASES,gpu"
BACKENDS="${BACKENDS:-native,openai-completions,triton-grpc}"
INPUT_LEN="${INPUT_LEN:-512}"
OUTPUT_LEN="${OUTPUT_LEN:-256}"
NUM_WARMUPS="${NUM_WARMUPS:-1}"
export BATCH_SIZE="${BATCH_SIZE:-256}"
export PUSH_MODE_HTTP_WORKERS="${PUSH_MODE_HTTP_WORKERS:-4}"
if [[ "$SMALL" == 1 ]]; then
  SHAPE="${SHAPE:-llama3-1b}"
  RUNS="${RUNS:-64:16,64 128:64}"
else
  SHAPE="${SHAPE:-llama3-8b}"
  RUNS="${RUNS:-256:64,256 1024:256}"
fi
export LOG_DIR="${LOG_DIR:-$WORK/log}"
export LLMSERVE_START_TIMEOUT="${LLMSERVE_START_TIMEOUT:-420}"
rm -rf "$WORK/bench-logs"
mkdir -p "$WORK/bench-logs" "$OUT"
STEPS="$WORK/steps.tsv"
RES="$WORK/results/none"  # set once the model is known
: >"$STEPS"
cat >"$WORK/summary.py" <<'EOF'
import json, os, re, statistics, sys, time
from pathlib import Path
res, out, pre, steps = (Path(a) for a in sys.argv[1:5])
table = sys.argv[5:] == ["--table"]
results = {p.stem: json.loads(p.read_text()) for p in sorted(res.glob("*.json"))}
keys = ("SMALL", "SHAPE", "MODEL_DIR", "RUNS", "BACKENDS", "PHASES", "INPUT_LEN", "OUTPUT_LEN", "NUM_WARMUPS",
        "BATCH_SIZE", "PUSH_MODE_HTTP_WORKERS", "CLIENT_CPUS", "SERVER_CPUS", "REPEATS", "BLOCK_BS", "MAX_SEQ_LEN", "KV_CACHE_MEMORY_FRACTION")
bundle = {
    "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
    "settings": {k: os.environ.get(k) for k in keys if os.environ.get(k) is not None},
    "preflight": json.loads(pre.read_text()) if pre.is_file() and pre.read_text().strip() else None,
    "steps": [dict(zip(("step", "rc", "seconds"), line.split("\t"))) for line in steps.read_text().splitlines()],
    "results": results,
    "intake": {p.stem: json.loads(p.read_text()) for p in sorted((res.parents[1] / "intake").glob("*.json"))},
}
out.write_text(json.dumps(bundle, indent=1) + "\n")
if not table:
    sys.exit(0)
rows = []
for name, r in results.items():
    backend = r["config"]["backend"]
    w = re.search(r"-w(\d+)(?:-r\d+)?$", name)
    for run in r["runs"]:
        rows.append((backend + (f"/w{w.group(1)}" if w else ""), run["max_concurrency"], run["num_requests"], run))
# The baseline of a workload: the in-process engine's run, or with REPEATS the median of its runs
runs_of: dict = {}
for b, c, n, run in rows:
    runs_of.setdefault((b, c, n), []).append(run)
engine = {}
for (b, c, n), runs in runs_of.items():
    if b == "engine":
        engine[(c, n)] = {"output_throughput": statistics.median(x["output_throughput"] for x in runs),
                          "ttft_ms": {"median": statistics.median(x["ttft_ms"]["median"] for x in runs)}}
order = {"engine": 0, "native": 1, "openai-completions": 2, "openai-chat": 3, "triton-grpc": 4}
print("backend/wN: served through the stack with PUSH_MODE_HTTP_WORKERS=N")
print(f"{'backend':<22}{'conc':>5}{'prompts':>8}{'out tok/s':>11}{'vs engine':>10}{'TPOT p50':>10}"
      f"{'TTFT p50':>10}{'Δ engine':>10}{'from send':>10}{'failed':>7}")
for b, c, n, run in sorted(rows, key=lambda x: (x[2], x[1] or 0, order.get(x[0].split("/")[0], 9), x[0])):
    e = engine.get((c, n))
    tps, tpot, ttft = run["output_throughput"], run["tpot_ms"]["median"], run["ttft_ms"]["median"]
    ratio = f"{tps / e['output_throughput']:.3f}" if e and e["output_throughput"] else "-"
    delta = f"{ttft - e['ttft_ms']['median']:+.1f}" if e else "-"
    bad = run["failed"] + run.get("output_len_mismatch", 0)
    sent = f"{run['ttft_after_send_ms']['median']:.1f}" if "ttft_after_send_ms" in run else "-"
    print(f"{b:<22}{c or 'inf':>5}{n:>8}{tps:>11.1f}{ratio:>10}{tpot:>10.2f}{ttft:>10.1f}{delta:>10}{sent:>10}{bad:>7}")
if any(len(v) > 1 for v in runs_of.values()):
    print("medians over the repeats (each row against the engine's median):")
    for (b, c, n), runs in sorted(runs_of.items(), key=lambda x: (x[0][2], x[0][1] or 0, order.get(x[0][0].split("/")[0], 9))):
        e = engine.get((c, n))
        if len(runs) < 2 or not e:
            continue
        ratios = [x["output_throughput"] / e["output_throughput"] for x in runs if e["output_throughput"]]
        deltas = sorted(x["ttft_ms"]["median"] - e["ttft_ms"]["median"] for x in runs)
        print(f"  {b:<22}{c or 'inf':>5}{n:>8}  {len(runs)} runs: tok/s vs engine {statistics.median(ratios):.3f}, "
              f"TTFT p50 \u0394 engine {statistics.median(deltas):+.1f} ms (runs {', '.join(f'{d:+.1f}' for d in deltas)})")
print("(ms; 'from send': TTFT p50 counted from when the client wrote the request (HTTP backends); 'failed'")
print(" counts failed requests and outputs of the wrong length; all results in", out, ")")
EOF

log() { printf '[%s +%4ds] %s\n' "$(date +%H:%M:%S)" "$((SECONDS - T_START))" "$*"; }
left() { echo $((DEADLINE_S - (SECONDS - T_START))); }
step() {  # step NAME MIN_SECONDS CMD...: run CMD under the time left (skipped below MIN_SECONDS), record it
  local name="$1" min="$2" t0=$SECONDS rc
  shift 2
  local budget
  budget=$(left)
  if ((budget < min)); then
    log "SKIP $name: ${budget}s left, needs ${min}s"
    printf '%s\tskipped\t0\n' "$name" >>"$STEPS"
    return 99
  fi
  log "START $name (limit ${budget}s)"
  timeout -k 15 "$budget" "$@"
  rc=$?
  log "END $name: rc=$rc in $((SECONDS - t0))s"
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >>"$STEPS"
  return $rc
}
has_phase() { [[ ",$PHASES," == *",$1,"* ]]; }
REPEATS="${REPEATS:-1}"
rep_tag() { ((REPEATS > 1)) && echo "$1"; }  # a bench's name ends in -rN only when benches repeat

# ---- 1. install ------------------------------------------------------------------------------
export PYTHONPATH="$REPO/server${PYTHONPATH:+:$PYTHONPATH}"
if [[ "${SKIP_INSTALL:-0}" != 1 && -d "$WHL" ]]; then
  step install 30 bash scripts/lab/device_install.sh "$SITE" "$STUB_SITE" "$WHL" "$PY" ||
    log "install failed: the steps below may fail too"
fi
[[ -d "$SITE" ]] && export PYTHONPATH="$PYTHONPATH:$SITE"
[[ -d "$STUB_SITE/numpy" ]] && export LLMSERVE_TRITON_STUB_PYTHONPATH="$STUB_SITE"
if [[ -f "$LOG_DIR/llmserve.run.json" ]]; then  # a stack left by an earlier call (it runs in its own session)
  log "stopping a stack left running by an earlier call"
  timeout -k 10 60 ./stop_server.sh
fi
rm -rf "$LOG_DIR"
mkdir -p "$LOG_DIR"

# Versions, imports, and whether tritonserver and the stub find every library they load.
STACK_OK=1
"$PY" - >"$WORK/preflight.json" <<'EOF' || STACK_OK=0
import importlib, json, os, subprocess, sys, sysconfig
from pathlib import Path
info = {"python": sys.version.split()[0], "executable": sys.executable, "problems": []}
for mod in ("torch", "numpy", "tokenizers", "zmq", "msgpack", "fastapi", "starlette", "uvicorn", "httptools",
            "pydantic", "tritonclient.grpc.aio", "grpc", "google.protobuf", "aiohttp", "prometheus_client",
            "jinja2", "safetensors"):
    try:
        m = importlib.import_module(mod)
        info[mod] = getattr(m, "__version__", "ok")
    except Exception as e:  # noqa: BLE001
        info[mod] = f"MISSING: {e!r}"[:200]
        if mod != "torch":
            info["problems"].append(f"import {mod}: {e!r}"[:300])
try:  # not a problem if missing: uvicorn then runs asyncio's own loop, at more CPU a request
    import uvloop
    info["uvloop"] = uvloop.__version__
except ImportError:
    info["uvloop"] = "MISSING: the HTTP front end runs asyncio's own event loop"
try:
    import torch
    info["cuda"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
except Exception:  # noqa: BLE001
    info["cuda"] = None
try:
    from llmserve.serving import tritonserver as launcher
    root = launcher.pytriton_root()
    libs = str(root.parent / "nvidia_pytriton.libs")
    pylib = sysconfig.get_config_var("LIBDIR") or ""
    env = dict(os.environ, LD_LIBRARY_PATH=":".join(p for p in (pylib, libs, os.environ.get("LD_LIBRARY_PATH", "")) if p))
    stub = root / "tritonserver/python_backend_stubs" / f"{sys.version_info[0]}.{sys.version_info[1]}" / "triton_python_backend_stub"
    for f in (root / "tritonserver/bin/tritonserver", root / "tritonserver/backends/python/libtriton_python.so", stub):
        out = subprocess.run(["ldd", str(f)], capture_output=True, text=True, env=env).stdout
        missing = [line.strip() for line in out.splitlines() if "not found" in line]
        if missing or not f.exists():
            info["problems"].append(f"{f.name}: {'missing' if not f.exists() else missing}")
    info["stub_reads_numpy2"] = launcher.stub_reads_numpy2(stub)
    sp = [p for p in os.environ.get(launcher.STUB_PYTHONPATH_ENV, "").split(os.pathsep) if p]
    launcher.check_stub_numpy(stub, sp)
    if sp:
        r = subprocess.run([sys.executable, "-c", "import numpy; print(numpy.__version__)"], capture_output=True,
                           text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sp)))
        info["stub_numpy"] = (r.stdout.strip() or r.stderr.strip()[-300:])
except Exception as e:  # noqa: BLE001
    info["problems"].append(f"triton: {e}"[:600])
print(json.dumps(info, indent=1))
sys.exit(1 if info["problems"] else 0)
EOF
log "preflight: $(tr -d '\n' <"$WORK/preflight.json" | tr -s ' ')"
((STACK_OK)) || log "the stack cannot start here (problems above): its phase is skipped"

# ---- 2. model --------------------------------------------------------------------------------
if [[ -z "${MODEL_DIR:-}" ]]; then
  ROOT_DIR=/dev/shm
  [[ -d /dev/shm && -w /dev/shm ]] || ROOT_DIR=/tmp
  export MODEL_DIR="$ROOT_DIR/llmserve-random-v3-$SHAPE"
  step build_model 60 "$PY" - "$MODEL_DIR" "$SHAPE" <<'EOF' || { log "no model: stopping"; exit 1; }
import sys, time
from pathlib import Path
import torch
from llmserve.models.demo_tokenizer import train_demo_tokenizer
from llmserve.models.random_model import SHAPES, write_random_checkpoint
path, shape = Path(sys.argv[1]), sys.argv[2]
# Llama-3.2-1B: 1.24 B parameters (untied head here: 1.50 B), 3.0 GB in bf16
SHAPES.setdefault("llama3-1b", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                    num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0))
cuda = torch.cuda.is_available()
t = time.time()
write_random_checkpoint(path, shape, device="cuda" if cuda else "cpu", dtype=torch.bfloat16 if cuda else torch.float32)
if not (path / "tokenizer.json").exists():  # a random model needs a tokenizer covering its whole vocabulary
    train_demo_tokenizer(path, vocab_size=SHAPES[shape]["vocab_size"])
print(f"model {path} ready in {time.time() - t:.1f}s")
EOF
fi
log "model: $MODEL_DIR"
# Results of one model and workload are kept (on a machine that stays up) until FRESH=1, so that
# `PHASES=stack` and then `PHASES=engine` in two calls give one table.
RES="$WORK/results/$(basename "$MODEL_DIR")-i$INPUT_LEN-o$OUTPUT_LEN-b$BATCH_SIZE"
[[ "${FRESH:-0}" == 1 ]] && rm -rf "$RES" "$WORK/intake"
mkdir -p "$RES"

# Each `llmserve bench` gets prompts of its own (--seed SEED, counted up): the stack keeps its prefix
# cache from one bench to the next, and a backend that found the prompts of the one before it in the
# cache (triton-grpc sends native's token ids) would skip their prefill, while the in-process engine
# starts empty every time. Both levels of one bench share its prompts, on every path alike.
SEED=0
bench() {  # bench BACKEND PROMPTS CONCURRENCY-LIST [REPEAT]
  local b="$1" p="$2" c="$3" name="$1-p$2-c${3//,/_}" rc
  SEED=$((SEED + 1))
  local extra=(--model "$MODEL_DIR")
  [[ "$b" == engine ]] || name="$name-w$PUSH_MODE_HTTP_WORKERS"
  [[ -n "${4:-}" ]] && name="$name-r$4"
  [[ "$b" == engine ]] || extra+=(--client-processes "${CLIENT_PROCESSES:-1}")
  local pin=()  # the in-process engine is the server's side; a served bench's client is the client's
  if [[ "$b" == engine && -n "${SERVER_CPUS:-}" ]]; then pin=(taskset -c "$SERVER_CPUS"); fi
  if [[ "$b" == engine && "${STEP_TRACE:-0}" == 1 ]]; then pin=(env LLMSERVE_STEP_TRACE="$OUT/steps-engine.txt" "${pin[@]}"); fi
  if [[ "$b" != engine && -n "${CLIENT_CPUS:-}" ]]; then pin=(taskset -c "$CLIENT_CPUS"); fi
  log "bench $name: output in $WORK/bench-logs/$name.log"
  : >"$WORK/intake.txt"  # this bench's marks only
  step "bench $name" 30 "${pin[@]}" "$PY" -m llmserve.cli bench --backend "$b" "${extra[@]}" --workload random \
    --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --range-ratio 0 --temperature 0 --seed "$SEED" \
    --num-prompts "$p" --max-concurrency "$c" --num-warmups "$NUM_WARMUPS" --timeout 300 \
    --no-plots --no-progress --out-dir "$RES" --result-name "$name" ${BENCH_ARGS:-} >"$WORK/bench-logs/$name.log" 2>&1
  rc=$?
  grep -E "^\[.*(END|SKIP)" "$WORK/bench-logs/$name.log"
  if [[ -f "$RES/$name.json" ]]; then
    "$PY" - "$RES/$name.json" <<'EOF'
import json, sys
for r in json.load(open(sys.argv[1]))["runs"]:
    print(f"    c={r['max_concurrency']}: {r['completed']}/{r['num_requests']} ok, {r['output_throughput']:.1f} out tok/s, "
          f"TTFT p50 {r['ttft_ms']['median']:.1f} ms, TPOT p50 {r['tpot_ms']['median']:.2f} ms, failures {r['failures']}")
EOF
  else
    tail -n 15 "$WORK/bench-logs/$name.log"
  fi
  if [[ "$b" != engine && -s "$WORK/intake.txt" ]]; then
    mkdir -p "$WORK/intake"
    "$PY" scripts/lab/intake_report.py "$WORK/intake.txt" --json "$WORK/intake/$name.json" | sed 's/^/    /'
  fi
  "$PY" "$WORK/summary.py" "$RES" "$OUT/stack_bench.json" "$WORK/preflight.json" "$STEPS"  # files so far
  return $rc
}

STACK_UP=0
stop_stack() {
  if ((STACK_UP)); then
    log "stopping the stack"
    timeout -k 10 60 ./stop_server.sh || log "stop_server.sh failed"
    STACK_UP=0
  fi
}

summarize() {
  log "summary"
  "$PY" "$WORK/summary.py" "$RES" "$OUT/stack_bench.json" "$WORK/preflight.json" "$STEPS" --table
}

finish() {
  stop_stack
  tar -czf "$OUT/logs.tar.gz" -C "$WORK" log bench-logs preflight.json steps.tsv 2>/dev/null
  summarize
  log "done in $((SECONDS - T_START))s; files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
}
trap finish EXIT
trap 'exit 130' INT TERM

# ---- 3. the stack ----------------------------------------------------------------------------
if has_phase stack && ((STACK_OK)); then
  STACK_UP=1  # from here on stop it at the end, started or not (a start cut short leaves it running)
  # Every process of the stack marks when it took in each request (serving/intake_trace.py); each
  # bench's marks become its hops' delays (scripts/lab/intake_report.py) in stack_bench.json's "intake".
  server_pin=()
  [[ -n "${SERVER_CPUS:-}" ]] && server_pin=(taskset -c "$SERVER_CPUS")
  [[ "${STEP_TRACE:-0}" == 1 ]] && export LLMSERVE_STEP_TRACE="$OUT/steps-stack.txt"
  if LLMSERVE_INTAKE_TRACE="$WORK/intake.txt" step start_server 120 "${server_pin[@]}" ./start_server.sh; then
    unset LLMSERVE_STEP_TRACE
    if [[ -n "${CORE_CPUS:-}" ]]; then  # the core alone on its CPUs (every thread of it)
      for pid in $(pgrep -f "llmserve.serving.engine_core"); do
        taskset -apc "$CORE_CPUS" "$pid" >/dev/null && log "engine core $pid pinned to CPUs $CORE_CPUS"
      done
    fi
    for rep in $(seq 1 "$REPEATS"); do  # every backend on one workload before the next workload
      for run in $RUNS; do
        for b in ${BACKENDS//,/ }; do bench "$b" "${run%%:*}" "${run#*:}" "$(rep_tag "$rep")"; done
      done
    done
  else
    log "the stack did not start; last lines of its logs:"
    for f in "$LOG_DIR"/*.log; do [[ -f "$f" ]] && { echo "--- $f"; tail -n 20 "$f"; }; done
  fi
  stop_stack
fi

# ---- 4. the engine in-process (the baseline) ---------------------------------------------------
if has_phase engine; then
  for rep in $(seq 1 "$REPEATS"); do
    for run in $RUNS; do bench engine "${run%%:*}" "${run#*:}" "$(rep_tag "$rep")"; done
  done
fi

# ---- 5. scripts/bench_gpu.py -------------------------------------------------------------------
if has_phase gpu; then
  # shellcheck disable=SC2086
  step bench_gpu 120 "$PY" scripts/bench_gpu.py --out "$OUT/bench_gpu.json" --model-dir "$MODEL_DIR" \
    ${BENCH_GPU_ARGS:---skip-hf} 2>&1 | tail -n 40
fi
