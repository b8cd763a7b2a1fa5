#!/usr/bin/env bash
# The demo model's recipe on the GPU box (docs/models.md): the trunk, then its MTP module on the frozen trunk,
# then transformers' greedy completions of the everyday prompts under the repetition rule; the checkpoint comes
# back under $OUT as demo.tar.part* (cat them | tar -x). The corpus is Python 3.11.7's stdlib, carried as a
# tarball of its .py files (STDLIB_TGZ, default .dev/stdlib.tgz), so every machine trains on the same text.
# Wheels the box lacks (pyzmq, pydantic, llguidance for py3.12) come from WHEELS (default .whl/).
set -uo pipefail
export PYTHONUNBUFFERED=1
STDLIB_TGZ="${STDLIB_TGZ:-.dev/stdlib.tgz}"
WHEELS="${WHEELS:-.whl}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 1
mkdir -p /tmp/stdlib && tar -xzf "$STDLIB_TGZ" -C /tmp/stdlib
export PYTHONPATH=$PWD/server:/tmp/site
T=/tmp/trunk
D=/tmp/demo
common=(--preset demo --corpus /tmp/stdlib --cache-dir /tmp/cache --seed 0)
(time timeout 300 python3 -m llmserve.cli train "${common[@]}" --tokenizer server/llmserve/models/demo_model --out $T) > "$OUT/train.log" 2>&1
(time timeout 150 python3 -m llmserve.cli train "${common[@]}" --init-from $T --mtp --out $D) >> "$OUT/train.log" 2>&1
tail -c 3000 "$OUT/train.log" | tr '\r' '\n' | grep -v "step/s" | tail -12
timeout 60 python3 -m llmserve.train.samples $D > "$OUT/samples.txt" 2>&1
tail -1 "$OUT/samples.txt"
[ -f $D/model.safetensors ] && tar -cf - -C /tmp demo | split -b 15M - "$OUT/demo.tar.part"
