"""The paged KV cache's storage: K and V of every layer in one tensor, plus per-token scales when quantized.

`data` is `[layers, 2, num_blocks, KVH, block_size, D]` in the storage dtype: fp16 for a bf16 model (see
kernels/attention.py), the model's dtype otherwise, or int8 / fp8 E4M3 when quantized. A quantized cache
adds `scales`, float32 `[layers, 2, num_blocks, KVH, block_size]`: one per token and KV head, written with
the values by kernels/rotary.py and read by kernels/attention.py.

MLA (DeepSeek, `latent_dim` > 0) caches one row a token and layer, `[latent | rope key]`, which is the key of
decode's absorbed attention, and whose first `latent_dim` features are also its value: `data` then has one
plane, `[layers, 1, num_blocks, 1, block_size, latent + rope]`, and a layer's v is a view of its k's leading
features (layers/mla.py). The block manager, prefix cache and preemption see blocks, whatever they hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.kernels.rotary import QUANT_MAX

QUANT_DTYPES = {"": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
LayerKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]  # (k, v, k_scale, v_scale)


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype  # storage: float16 / bfloat16 / float32, or int8 / float8_e4m3fn (quantized)
    latent_dim: int = 0  # MLA: V is the first latent_dim features of K, stored once (module doc)

    @property
    def planes(self) -> int:
        """Tensors a token keeps per layer and KV head: K and V, or MLA's one row."""
        return 1 if self.latent_dim else 2

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANT_MAX

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: K and V (MLA: its row) of all layers, values plus scales."""
        per_token = self.head_dim * self.dtype.itemsize + (4 if self.quantized else 0)
        return self.planes * self.num_layers * self.num_kv_heads * self.block_size * per_token

    def allocate(self, num_blocks: int, device: torch.device | str) -> KVCache:
        shape = (self.num_layers, self.planes, num_blocks, self.num_kv_heads, self.block_size)
        data = torch.zeros(*shape, self.head_dim, dtype=self.dtype, device=device)
        scales = torch.zeros(shape, dtype=torch.float32, device=device) if self.quantized else None
        return KVCache(self, data, scales)


@dataclass
class KVCache:
    spec: KVCacheSpec
    data: torch.Tensor  # [layers, planes, num_blocks, KVH, block_size, D]
    scales: torch.Tensor | None  # [layers, 2, num_blocks, KVH, block_size] float32, when quantized

    def __post_init__(self) -> None:
        # Each layer's views, made once: every step of every layer reads them (the per-token hot path).
        s, latent = self.scales, self.spec.latent_dim
        self._layers = [
            (self.data[i, 0], self.data[i, 0, ..., :latent], None, None)
            if latent
            else (self.data[i, 0], self.data[i, 1], None if s is None else s[i, 0], None if s is None else s[i, 1])
            for i in range(self.data.shape[0])
        ]

    def layer(self, i: int) -> LayerKV:
        """(k, v, k_scale, v_scale) of layer i, contiguous views, as rope_and_cache and paged_attention take them
        (MLA: k its rows, v a view of their latent features)."""
        return self._layers[i]


def kv_spec_for(
    quant: str,
    model_dtype: torch.dtype,
    num_layers: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    latent_dim: int = 0,
) -> KVCacheSpec:
    """quant: "" (fp16 for a bf16 model, the model's dtype otherwise), "int8" or "fp8" (E4M3). `latent_dim`:
    MLA's (ModelConfig.kv_latent_dim; module doc)."""
    if quant not in QUANT_DTYPES:
        raise ValueError(f"KV cache quantization {quant!r}: expected one of '', 'int8', 'fp8'")
    if quant and latent_dim:
        raise ValueError(f"KV_CACHE_DTYPE={quant} (or USE_CACHE_KV_INT8): not supported with MLA (DeepSeek) models yet")
    dtype = QUANT_DTYPES[quant] or (torch.float16 if model_dtype == torch.bfloat16 else model_dtype)
    return KVCacheSpec(num_layers, num_kv_heads, block_size, head_dim, dtype, latent_dim)
