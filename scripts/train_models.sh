#!/usr/bin/env bash
# Train the reference models on the Python standard library (docs/models.md), in one go on a GPU box:
#  1. the shared byte-level BPE tokenizer (8192 ids) on the training split -> $MODELS/tokenizer
#  2. target (+ its MTP module) for $TARGET_SECONDS of training                -> $MODELS/target
#  3. draft for $DRAFT_SECONDS                                                  -> $MODELS/draft
#  4. DEMO=1: the first demo (demo-cpu) on the CPU (2 threads, its fixed step count; ~8 min) -> $MODELS/demo
# then prints each model's held-out perplexity and writes $MODELS/summary.json.
#
#   scripts/train_models.sh                         # from the repository root
#   TARGET_SECONDS=60 DRAFT_SECONDS=30 scripts/train_models.sh    # a quick smoke run
#
# Settings (env): MODELS ($OUT/models when the device tool's $OUT is set, else /tmp/llmserve-models),
# PY (python3), SEED (0), TARGET_SECONDS (240), DRAFT_SECONDS (90), DEMO (0), DEADLINE_S (570: no step
# starts a run that would pass it; the training budgets exclude tokenizing and evaluation), EXTRA_ARGS
# (added to every `llmserve train`, e.g. "--max-files 60 --device cpu" to try the script on a laptop).
# Needs torch, transformers, tokenizers, safetensors, numpy (tqdm optional: plain log lines without it).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export PYTHONUNBUFFERED=1 PYTHONPATH="$REPO/server${PYTHONPATH:+:$PYTHONPATH}"
PY="${PY:-python3}"
SEED="${SEED:-0}"
TARGET_SECONDS="${TARGET_SECONDS:-240}"
DRAFT_SECONDS="${DRAFT_SECONDS:-90}"
DEMO="${DEMO:-0}"
DEADLINE_S="${DEADLINE_S:-570}"
if [[ -n "${OUT:-}" ]]; then MODELS="${MODELS:-$OUT/models}"; else MODELS="${MODELS:-/tmp/llmserve-models}"; fi
mkdir -p "$MODELS"
CACHE="$MODELS/cache"

step() {  # step NAME BUDGET_S ARGS...: one `llmserve train` run, bounded by the deadline
  local name="$1" budget="$2" left=$((DEADLINE_S - SECONDS))
  shift 2
  if ((left < budget)); then
    echo "[$(date +%T)] skip $name: needs ~${budget} s, ${left} s left before the deadline" >&2
    return 0
  fi
  echo "[$(date +%T)] $name" >&2
  timeout "$left" "$PY" -m llmserve.cli train --seed "$SEED" --cache-dir "$CACHE" --out "$MODELS/$name" "$@" ${EXTRA_ARGS:-}
}

"$PY" -c "import torch, transformers, tokenizers, safetensors, numpy; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
step tokenizer 60 --tokenizer-only --preset target
step target $((TARGET_SECONDS + 60)) --preset target --mtp --tokenizer "$MODELS/tokenizer" --max-seconds "$TARGET_SECONDS"
step draft $((DRAFT_SECONDS + 30)) --preset draft --tokenizer "$MODELS/tokenizer" --max-seconds "$DRAFT_SECONDS"
if [[ "$DEMO" == 1 ]]; then
  step demo 660 --preset demo-cpu --device cpu --tokenizer "$MODELS/tokenizer"
fi

"$PY" - "$MODELS" <<'EOF'
import json, sys
from pathlib import Path

models = Path(sys.argv[1])
summary = {}
for name in ("target", "draft", "demo"):
    f = models / name / "train_metrics.json"
    if f.exists():
        m = json.loads(f.read_text())
        summary[name] = {k: m.get(k) for k in (
            "heldout_ppl", "heldout_top1", "mtp_heldout_ppl", "mtp_top1", "mtp_agrees_with_trunk", "params",
            "mtp_params", "steps", "tokens_seen", "train_seconds", "device_name", "final_train_loss")}
(models / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(f"{'model':8} {'params':>12} {'steps':>6} {'train s':>8} {'held-out ppl':>13} {'MTP ppl (t+2)':>14}")
for name, m in summary.items():
    mtp = f"{m['mtp_heldout_ppl']:.3f}" if m.get("mtp_heldout_ppl") else "-"
    print(f"{name:8} {m['params']:>12,} {m['steps']:>6} {m['train_seconds']:>8.0f} {m['heldout_ppl']:>13.3f} {mtp:>14}")
EOF
