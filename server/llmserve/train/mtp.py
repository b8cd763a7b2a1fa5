"""DeepSeek-V3's multi-token prediction (MTP) module, depth 1, over a Llama or DeepSeek-V3 trunk.

At position i it takes the trunk's last hidden state h_i (after the final norm, as vLLM and
SGLang hand it over) and the embedding of the next token t_{i+1}, and predicts t_{i+2}:

    x = eh_proj(cat(enorm(embed(t_{i+1})), hnorm(h_i)))      embedding first, as DeepSeek-V3
    y = decoder_layer(x)                                     one Llama layer, causal, RoPE at i
    logits = lm_head(shared_head.norm(y))                    the trunk's embedding and LM head

The embedding at position 0 is zeroed, as vLLM's and SGLang's DeepSeek MTP layers do at
inference. The module is the trunk family's decoder layer (`LlamaDecoderLayer`, or
`DeepseekV3DecoderLayer`: MLA, and experts as layer N has them) with the MTP's extra weights beside the
layer's own, so its state dict holds the names DeepSeek-V3 checkpoints use under
`model.layers.{num_hidden_layers}.` (see `checkpoint_tensors`). `mtp_layer(config)` builds the one of
config's family.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm


class SharedHead(nn.Module):
    """DeepSeek-V3's `shared_head`: its own norm; `head` is the trunk's LM head (a copy in the checkpoint)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class MTPLayer:
    """The MTP's weights and forward over a decoder layer class (the second base of LlamaMTPLayer /
    DeepseekMTPLayer)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config, layer_idx=config.num_hidden_layers)
        h = config.hidden_size
        self.enorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.hnorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(config)
        # as the trunk's matrices (nn.Linear's default is kaiming-uniform; transformers' stacked experts and
        # router start empty / zero): every matrix normal(0, initializer_range)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, config.initializer_range)

    def hidden(self, trunk: PreTrainedModel, last_hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """MTP hidden states [B, S-1, H] (after shared_head.norm): row i predicts input_ids[:, i + 2]."""
        emb = trunk.model.embed_tokens(input_ids[:, 1:])
        emb = torch.cat([torch.zeros_like(emb[:, :1]), emb[:, 1:]], dim=1)  # position 0 masked
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(last_hidden[:, :-1])], dim=-1))
        positions = torch.arange(x.shape[1], device=x.device)[None]
        rope = trunk.model.rotary_emb(x, positions)
        if self.self_attn.config._attn_implementation not in ("sdpa", "flash_attention_2"):
            raise ValueError("the MTP layer passes no attention mask: build the trunk with attn_implementation='sdpa'")
        out = super().forward(x, attention_mask=None, position_ids=positions, position_embeddings=rope)
        return self.shared_head.norm(out[0] if isinstance(out, tuple) else out)


class LlamaMTPLayer(MTPLayer, LlamaDecoderLayer):
    pass


class DeepseekMTPLayer(MTPLayer, DeepseekV3DecoderLayer):
    pass


def mtp_layer(config: PretrainedConfig) -> MTPLayer:
    """A fresh MTP module over config's family's decoder layer."""
    return (DeepseekMTPLayer if config.model_type == "deepseek_v3" else LlamaMTPLayer)(config)


def checkpoint_tensors(mtp: MTPLayer, trunk: PreTrainedModel, copies: bool = True) -> dict[str, torch.Tensor]:
    """The MTP weights under DeepSeek-V3's names: `model.layers.{L}.` + the module's state dict
    (enorm, hnorm, eh_proj, self_attn.*, mlp.*, input/post_attention_layernorm, shared_head.norm),
    plus (`copies`) copies of the shared embedding and LM head (`embed_tokens`, `shared_head.head`),
    which DeepSeek-V3's checkpoint also stores in the MTP layer and vLLM's loader reads from there
    (the torch runner and `load_mtp` use the trunk's own: without them the file is smaller)."""
    p = f"model.layers.{trunk.config.num_hidden_layers}."
    out = {p + k: v for k, v in mtp.state_dict().items()}
    if copies:
        out[p + "embed_tokens.weight"] = trunk.model.embed_tokens.weight
        out[p + "shared_head.head.weight"] = trunk.lm_head.weight
    return out


def load_mtp(config: PretrainedConfig, tensors: dict[str, torch.Tensor]) -> MTPLayer:
    """An MTP module from checkpoint tensors (the inverse of `checkpoint_tensors`; a Llama trunk's)."""
    p = f"model.layers.{config.num_hidden_layers}."
    mtp = mtp_layer(config)
    own = {k[len(p) :]: v for k, v in tensors.items() if k.startswith(p)}
    own.pop("embed_tokens.weight", None)
    own.pop("shared_head.head.weight", None)
    mtp.load_state_dict(own, strict=True)
    return mtp
