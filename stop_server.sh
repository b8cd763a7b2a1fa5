#!/usr/bin/env bash
# Stop the stack started by start_server.sh (same LOG_DIR): graceful first,
# then whatever is left; removes its /dev/shm regions.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ -x "$HERE/.venv/bin/python" ]]; then PY="$HERE/.venv/bin/python"; else PY="$(command -v python3)"; fi
export PYTHONPATH="$HERE/server${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m llmserve.serving.control stop
