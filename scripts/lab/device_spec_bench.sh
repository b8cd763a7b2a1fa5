#!/usr/bin/env bash
# Issue 14's GPU measurements in one device call (scripts/bench_spec.py does the measuring):
#   ORACLE=1 (default): the 8B-shaped random-weight model with an oracle proposer (ORACLE_BATCHES,
#   default 1,16,64,256; batch 1 adds a profile of a plain and a verification step);
#   TRAINED=1: trains the reference target (+MTP) and draft on the stdlib (scripts/train_models.sh,
#   TARGET_SECONDS / DRAFT_SECONDS), then acceptance per method and k and decode tokens/s.
# Carry .whl (scripts/lab/device_wheels.sh: pyzmq, pytest, ...) and, for TRAINED=1, .corpus (this machine's
# stdlib sources: the GPU box's Python has fewer files); results land in $OUT.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN || true
export PYTHONPATH="$PWD/server:/tmp/site" PYTHONUNBUFFERED=1
if [[ "${ORACLE:-1}" == 1 ]]; then
  python scripts/bench_spec.py --oracle --batches "${ORACLE_BATCHES:-1,16,64,256}" --out "$OUT/spec_oracle.json" 2>&1 | grep -v Warn
fi
if [[ "${TRAINED:-0}" == 1 ]]; then
  mkdir -p /tmp/stdlib && tar xJf .corpus/stdlib.tar.xz -C /tmp/stdlib
  MODELS=/tmp/models EXTRA_ARGS="--corpus /tmp/stdlib" TARGET_SECONDS="${TARGET_SECONDS:-180}" \
    DRAFT_SECONDS="${DRAFT_SECONDS:-60}" DEADLINE_S=330 PY=python scripts/train_models.sh 2>&1 | tail -6
  cp /tmp/models/summary.json "$OUT/train_summary.json" || true
  python scripts/bench_spec.py --trained /tmp/models --corpus /tmp/stdlib --out "$OUT/spec_trained.json" ${SPEC_ARGS:-} 2>&1 | grep -v Warn
fi
