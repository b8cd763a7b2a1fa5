#!/usr/bin/env bash
# Start the serving stack: Triton (gRPC, model "model"), the engine process,
# health probes and metrics; waits until ready and prints the endpoints.
#   ./start_server.sh              serve MODEL_DIR (the demo model when none)
#   ./start_server.sh <model_name> download <model_name> into MODEL_DIR first
# Settings: environment variables (docs/serving.md; `llmserve config` prints
# them), legacy names included. A bad one is named, exit code 2, before anything
# starts. Each start moves the last one's logs aside (LOG_DIR/*.log -> *.log.1).
# Stop with ./stop_server.sh.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# The venv next to this script when there is one; else the python on PATH.
if [[ -x "$HERE/.venv/bin/python" ]]; then
  PY="$HERE/.venv/bin/python"
  export PATH="$HERE/.venv/bin:$PATH"
else
  PY="$(command -v python3)"
fi
export PYTHONPATH="$HERE/server${PYTHONPATH:+:$PYTHONPATH}"

model_name="${1:-${model_name:-}}"
if [[ -n "$model_name" ]]; then
  # Bad settings are named (exit code 2) before a download that could take hours.
  "$PY" -m llmserve.serving.control check
  export MODEL_DIR="${MODEL_DIR:-/models}"
  echo "downloading $model_name into $MODEL_DIR"
  "$PY" "$HERE/download_model.py" --model_name "$model_name" --dir "$MODEL_DIR" \
    --nnodes "${MP_NNODE:-1}" --mode "${DOWNLOAD_MODE:-master}"
fi

exec "$PY" -m llmserve.serving.control start
