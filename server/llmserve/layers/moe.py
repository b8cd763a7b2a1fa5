"""DeepSeek's mixture of experts: the router, the routed experts and the shared ones; and the dense SwiGLU MLP.

Routing (`route`), in float32 as both references compute it, exactly as the config says (deepseek_config.py):
scores are the router logits' sigmoid (V3) or softmax (V2); with groups, a token first keeps its `topk_group`
best groups of experts, ranked by the sum of their two best bias-corrected scores (`noaux_tc`) or their best
score (`group_limited_greedy`), then its `num_experts_per_tok` best experts among those (by the corrected
scores; the bias only chooses, it never weighs). The weights are the chosen experts' uncorrected scores,
normalised to sum 1 with `norm_topk_prob`, times `routed_scaling_factor`.

Experts are `Linear`s of the checkpoint's format (gate/up fused, then down). Where every expert is dense
(bf16/fp16/fp32) or FP8 with 128 x 128 block scales, `stack_experts` copies them once at load into stacked
tensors, gate_up [E, 2I, H] and down [E, H, I] (+ scales), and makes each expert's tensors views of those (one
copy in memory; `nbytes` counts each expert once, as before). The routed sum then runs on
kernels/fused_moe.py's grouped GEMMs (Triton: on CUDA, or under TRITON_INTERPRET=1; not with the `ref`
switch): no host sync, CUDA-graph capturable. The reference, and the path of every other format and of the
CPU, runs expert by expert over the tokens that chose it (`_routed_loop`: a host sync for the counts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.kernels import use_triton
from llmserve.kernels.activation import swiglu
from llmserve.kernels.fused_moe import SCALE_BLOCK, fused_moe
from llmserve.layers.deepseek_config import MoEConfig
from llmserve.layers.linear import Linear
from llmserve.layers.parallel import Shard
from llmserve.layers.quant.methods import FP8, LinearMethod, load_linear
from llmserve.layers.weights import WeightReader


def route(logits: torch.Tensor, cfg: MoEConfig, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (float32) -> (weights [T, k] float32, expert ids [T, k]) (module doc)."""
    T, E = logits.shape
    scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(dim=-1)
    choice = scores + bias if bias is not None else scores
    if cfg.n_group > 1:
        grouped = choice.view(T, cfg.n_group, E // cfg.n_group)
        if cfg.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(cfg.topk_group, dim=-1).indices, True)
        # masked experts: never chosen (-inf); V2's reference zeroes them, the same choice for softmax scores > 0
        choice = choice.masked_fill(~keep.repeat_interleave(E // cfg.n_group, dim=1), float("-inf"))
    ids = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


@dataclass
class MLP:
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused."""

    gate_up: Linear
    down: Linear

    @classmethod
    def load(cls, r: WeightReader, p: str, method: LinearMethod, rows: tuple[int, int] | None = None) -> MLP:
        """`rows`: only these intermediate features (a tensor-parallel rank's: gate/up's rows, down's columns)."""
        col, row = ((0, *rows), (1, *rows)) if rows is not None else (None, None)
        gate_up = load_linear(method, r, (p + "gate_proj.", col), (p + "up_proj.", col))
        return cls(gate_up, load_linear(method, r, (p + "down_proj.", row)))

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return self.down(swiglu(self.gate_up(x, torch.float32), x.dtype), out_dtype)

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


@dataclass
class Stacked:
    """The routed experts' weights, stacked for kernels/fused_moe.py (scales: FP8 blocks only)."""

    w1: torch.Tensor  # [E, 2I, H] gate_up
    w2: torch.Tensor  # [E, H, I] down
    s1: torch.Tensor | None  # [E, 2I/128, H/128] float32
    s2: torch.Tensor | None


def _stackable(linears: list[Linear]) -> bool:
    """Every one a single dense float matrix, or every one E4M3 with 128 x 128 block scales, of one shape."""
    first = linears[0]
    if any(lin.parts is not None or lin.perm is not None or lin.bias is not None for lin in linears):
        return False
    if any(
        type(lin.method) is not type(first.method) or lin.w["weight"].shape != first.w["weight"].shape
        for lin in linears
    ):
        return False
    if type(first.method) is LinearMethod:
        return first.w["weight"].dtype in (torch.bfloat16, torch.float16, torch.float32)
    return isinstance(first.method, FP8) and first.method.block == SCALE_BLOCK and first.w["scale"].dim() == 2


def _stack(linears: list[Linear], key: str) -> torch.Tensor:
    """One tensor [E, ...] of the Linears' `key`, each Linear's then a view of it; copied expert by expert so that
    each expert's own tensor is freed as its copy lands (the peak: one layer's stack plus one expert)."""
    t = linears[0].w[key]
    out = torch.empty((len(linears), *t.shape), dtype=t.dtype, device=t.device)
    for e, lin in enumerate(linears):
        out[e].copy_(lin.w[key])
        lin.w[key] = out[e]
    return out


def stack_experts(experts: list[MLP]) -> Stacked | None:
    """The experts' weights stacked (module doc), or None for a format the fused kernels do not take."""
    gate_up, down = [m.gate_up for m in experts], [m.down for m in experts]
    if not (_stackable(gate_up) and _stackable(down)) or type(gate_up[0].method) is not type(down[0].method):
        return None
    fp8 = isinstance(gate_up[0].method, FP8)
    s1, s2 = (_stack(gate_up, "scale"), _stack(down, "scale")) if fp8 else (None, None)
    return Stacked(_stack(gate_up, "weight"), _stack(down, "weight"), s1, s2)


@dataclass
class MoE:
    cfg: MoEConfig
    gate: torch.Tensor  # [E, hidden] float32 (both references keep the router in float32)
    bias: torch.Tensor | None  # [E] float32: e_score_correction_bias (noaux_tc)
    experts: list[MLP]
    shared: MLP | None
    stacked: Stacked | None = None  # set by load (stack_experts): the fused path's weights

    @classmethod
    def load(cls, r: WeightReader, p: str, method: LinearMethod, cfg: MoEConfig, shard: Shard | None = None) -> MoE:
        """The experts of the layer whose MLP is under `p` (e.g. "model.layers.3.mlp."), named as DeepSeek's
        and transformers' checkpoints name them (experts.{e}.gate_proj...). With a `shard` of several ranks,
        this rank's share of every expert's intermediate features (its output is a partial sum)."""
        rows = shard.mlp_rows if shard is not None else lambda width: None

        if r.has(p + "experts.gate_up_proj"):
            raise ValueError(f"{p}experts.gate_up_proj: fused expert tensors; expected experts.{{e}}.gate_proj etc.")
        bias = r.raw(p + "gate.e_score_correction_bias").float() if cfg.topk_method == "noaux_tc" else None
        inter = cfg.moe_intermediate_size
        experts = [MLP.load(r, f"{p}experts.{e}.", method, rows(inter)) for e in range(cfg.n_routed_experts)]
        shared_inter = inter * cfg.n_shared_experts
        shared = MLP.load(r, p + "shared_experts.", method, rows(shared_inter)) if cfg.n_shared_experts else None
        return cls(cfg, r.raw(p + "gate.weight").float(), bias, experts, shared, stack_experts(experts))

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """Normed hidden states x [T, hidden] -> the routed experts' weighted sum plus the shared experts' [T, hidden]."""
        weights, ids = route(x.float() @ self.gate.T, self.cfg, self.bias)
        if self.stacked is not None and use_triton(x):
            s = self.stacked
            out = fused_moe(x, weights, ids, s.w1, s.w2, s.s1, s.s2)
        else:
            out = self._routed_loop(x, weights, ids)
        if self.shared is not None:
            out += self.shared(x, torch.float32)
        return out.to(out_dtype)

    def _routed_loop(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The reference routed sum, fp32 [T, hidden]: expert by expert over the tokens that chose it."""
        k = ids.shape[1]
        flat = ids.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs, expert after expert
        counts = torch.bincount(flat, minlength=self.cfg.n_routed_experts).tolist()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start : start + n]
            tokens = pairs // k
            y = self.experts[e](x[tokens], torch.float32) * weights.flatten()[pairs, None]
            out.index_add_(0, tokens, y)
            start += n
        return out

    @property
    def nbytes(self) -> int:
        n = sum(m.nbytes for m in self.experts) + (self.shared.nbytes if self.shared is not None else 0)
        return n + self.gate.numel() * 4
