#!/usr/bin/env bash
# Stop the stack started by start_server.sh (same LOG_DIR): graceful first,
# then, after LLMSERVE_STOP_TIMEOUT seconds, whatever is left; removes its
# /dev/shm regions. A bad setting is named (exit code 2), and the stack is
# stopped all the same, with the default in its place.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ -x "$HERE/.venv/bin/python" ]]; then PY="$HERE/.venv/bin/python"; else PY="$(command -v python3)"; fi
export PYTHONPATH="$HERE/server${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m llmserve.serving.control stop
