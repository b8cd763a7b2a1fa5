"""Training reference models on the Python standard library (docs/models.md).

corpus     the stdlib's .py files, split by file, tokenized into cached token streams
tokenizer  the byte-level BPE trained on the training split (the demo tokenizer's conventions)
presets    model shapes and training settings: tiny (tests), demo (the default model), demo-cpu (the first demo), draft, target
mtp        DeepSeek-V3's multi-token prediction module over a Llama trunk
checkpoint the Hugging Face directory (config.json, model.safetensors, generation_config.json)
trainer    the loop: seeded windows, AdamW + cosine, progress bar, loss log, held-out perplexity
evaluate   the forward pass and the held-out evaluation (trunk and MTP)
attach     `--init-from DIR --mtp`: an MTP module trained onto a trained, frozen trunk
samples    the demo's everyday prompts and the rule for degenerate repetition
cli        `llmserve train`
"""
