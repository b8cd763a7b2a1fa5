"""Quantized weights of the torch runner: formats, loaders and the methods that run them.

A checkpoint's `quantization_config` (GPTQ, AWQ, FP8) or the QUANT_TYPE setting (online
weight-only int8/int4 from a bf16 checkpoint) picks one method per model; every linear layer then
holds its weight in that method's canonical form below, whatever the checkpoint's own layout was.
Converting a layout happens once, at load (formats.py); the GEMM kernels (kernels/quant_gemm.py,
kernels/fp8_gemm.py) read only the canonical forms. Torch's weight convention throughout: a linear
maps x [M, K] to y = x @ W.T [M, N], W [N, K].

Canonical forms:

- w8 (weight-only int8, per output channel, symmetric):
    qweight int8 [N, K], scale float32 [N];  W[n, k] = qweight[n, k] * scale[n]
- w4 (weight-only 4-bit, group-wise along K, asymmetric; GPTQ's packing):
    qweight int32 [K // 8, N]: bits 4j .. 4j+3 of qweight[r, n] hold q[8r + j, n] in 0..15
    scales float [K // G, N] (the checkpoint's dtype, fp16 or bf16; fp32 online)
    zeros float32 [K // G, N]: the integer zero point of each group, as a float
    W[n, k] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n];  K % G == 0, K % 8 == 0
    A GPTQ checkpoint with desc_act (act-order) has its rows sorted by group at load; the layer
    then also holds `perm` int64 [K] and multiplies x[:, perm] (one gather of the activations).
- fp8 (E4M3 weights):
    weight float8_e4m3fn [N, K] and either
      scale float32 [N]                        per output channel:  W[n, k] = weight[n, k] * scale[n]
      scale float32 [ceil(N/B), ceil(K/B)]     B x B blocks (B = 128, DeepSeek-V3's `weight_scale_inv`):
                                               W[n, k] = weight[n, k] * scale[n // B, k // B]
"""
