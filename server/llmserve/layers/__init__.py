"""Layers the models are built of: linear (+ quantization methods), attention, rotary, norms, sampler."""
