"""The DeepSeek-V2/V3 parts of a model config: multi-head latent attention (MLA) and the mixture of experts.

Read from config.json as transformers 5.x writes it (`rope_parameters`) or as DeepSeek's own checkpoints do
(`rope_scaling`, `scoring_func`, `topk_method`, `moe_layer_freq`). Every field that changes the math is read;
a value we do not implement is refused by name (`ValueError`) at start, never approximated:

- routing: V3 scores with a sigmoid and picks experts by the bias-corrected scores within the best groups
  (`noaux_tc`); V2 with a softmax, greedily or within the best groups by their top expert
  (`group_limited_greedy`). Those are the combinations both DeepSeek's reference and transformers define.
- V2 with `norm_topk_prob` is refused: DeepSeek's reference normalises (and then skips the scaling),
  transformers' does neither; the published V2 checkpoints leave it off.
- `moe_layer_freq` other than 1 is refused: transformers ignores it (every layer from
  `first_k_dense_replace` on is MoE); every published checkpoint has 1.
"""

from __future__ import annotations

from dataclasses import dataclass

DEEPSEEK_ARCHITECTURES = {"DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV2ForCausalLM": "deepseek_v2"}
TOPK_METHODS = {"deepseek_v3": ("noaux_tc",), "deepseek_v2": ("greedy", "group_limited_greedy")}
SCORING = {"deepseek_v3": "sigmoid", "deepseek_v2": "softmax"}
NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: their fixed eps in both references (not rms_norm_eps)


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int | None  # None: a plain q_proj (V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rotary over adjacent pairs (x0, x1), (x2, x3)... (V2 always, V3 by default)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """A cached token of a layer: its normed latent, then its rotated rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str  # "sigmoid" | "softmax"
    topk_method: str  # "noaux_tc" | "greedy" | "group_limited_greedy"
    n_group: int  # 1: no group limit
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace


def _refuse(arch: str, field: str, value: object, why: str) -> ValueError:
    return ValueError(f"{arch}: config.json {field}={value!r} is not supported ({why})")


def parse_mla(d: dict, arch: str) -> MLAConfig:
    need = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    for f in need:
        if not isinstance(d.get(f), int) or d[f] <= 0:
            raise _refuse(arch, f, d.get(f), "a positive integer is required")
    q_lora = d.get("q_lora_rank")
    if q_lora is not None and (not isinstance(q_lora, int) or q_lora <= 0):
        raise _refuse(arch, "q_lora_rank", q_lora, "a positive integer, or null for a plain q_proj")
    if d["qk_rope_head_dim"] % 2:
        raise _refuse(arch, "qk_rope_head_dim", d["qk_rope_head_dim"], "rotary needs an even width")
    interleave = True if arch == "deepseek_v2" else bool(d.get("rope_interleave", True))
    return MLAConfig(q_lora, *(d[f] for f in need), rope_interleave=interleave)


def parse_moe(d: dict, arch: str) -> MoEConfig:
    def get(field: str, default: object) -> object:
        v = d.get(field)
        return default if v is None else v

    experts, top_k = d.get("n_routed_experts"), d.get("num_experts_per_tok")
    if not isinstance(experts, int) or experts <= 0:
        raise _refuse(arch, "n_routed_experts", experts, "a positive integer is required")
    if not isinstance(top_k, int) or not 0 < top_k <= experts:
        raise _refuse(arch, "num_experts_per_tok", top_k, f"1 to n_routed_experts={experts}")
    scoring = get("scoring_func", SCORING[arch])
    if scoring != SCORING[arch]:
        raise _refuse(arch, "scoring_func", scoring, f"{arch} routes with {SCORING[arch]!r}")
    method = get("topk_method", TOPK_METHODS[arch][0])
    if method not in TOPK_METHODS[arch]:
        raise _refuse(arch, "topk_method", method, f"supported: {', '.join(TOPK_METHODS[arch])}")
    if get("moe_layer_freq", 1) != 1:
        raise _refuse(arch, "moe_layer_freq", d["moe_layer_freq"], "only 1: every layer from first_k_dense_replace")
    norm = bool(get("norm_topk_prob", arch == "deepseek_v3"))
    if norm and arch == "deepseek_v2":
        raise _refuse(arch, "norm_topk_prob", True, "DeepSeek's V2 reference and transformers disagree on it")
    if norm and top_k == 1:
        raise _refuse(
            arch, "norm_topk_prob", True, "with num_experts_per_tok=1 the references disagree (1 or the score)"
        )
    groups, topk_group = int(get("n_group", 1)), int(get("topk_group", 1))
    if method == "greedy":
        groups = topk_group = 1
    if groups <= 0 or experts % groups:
        raise _refuse(arch, "n_group", groups, f"must divide n_routed_experts={experts}")
    if not 0 < topk_group <= groups:
        raise _refuse(arch, "topk_group", topk_group, f"1 to n_group={groups}")
    if method == "noaux_tc" and experts // groups < 2:
        raise _refuse(arch, "n_group", groups, "noaux_tc ranks a group by its two best experts: 2+ per group")
    if top_k > topk_group * (experts // groups):
        raise _refuse(arch, "num_experts_per_tok", top_k, "more than the chosen groups hold")
    if d.get("mlp_bias"):
        raise _refuse(arch, "mlp_bias", True, "no published checkpoint has MLP biases")
    return MoEConfig(
        n_routed_experts=experts,
        n_shared_experts=int(get("n_shared_experts", 0)),
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(d["moe_intermediate_size"]),
        scoring_func=scoring,
        topk_method=method,
        n_group=groups,
        topk_group=topk_group,
        norm_topk_prob=norm,
        routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
        first_k_dense_replace=int(get("first_k_dense_replace", 3 if arch == "deepseek_v3" else 0)),
    )


def deepseek_fields(d: dict, arch: str) -> dict:
    """ModelConfig's fields of a DeepSeek config.json (model_config.py builds the config). The cache's heads
    and width: one latent "head" of kv_lora_rank + qk_rope_head_dim, as decode's absorbed form attends it."""
    if d.get("hidden_act", "silu") != "silu":
        raise _refuse(arch, "hidden_act", d["hidden_act"], "only silu")
    mla = parse_mla(d, arch)
    mtp = d.get("num_nextn_predict_layers", d.get("num_mtp_layers")) or 0
    if not isinstance(mtp, int) or mtp < 0:
        raise _refuse(arch, "num_nextn_predict_layers", mtp, "a count >= 0")
    return dict(
        intermediate_size=d["intermediate_size"],
        num_key_value_heads=1,
        head_dim=mla.cache_dim,
        mla=mla,
        moe=parse_moe(d, arch),
        num_nextn_predict_layers=mtp,
    )
