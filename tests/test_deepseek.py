"""DeepSeek-V3 / V2 (MLA + MoE) on the torch runner, CPU fp32, against transformers' own models.

Tiny random checkpoints (models/random_model.py `write_random_deepseek`): V3 with every feature (q LoRA,
sigmoid routing with the score-correction bias, groups, norm_topk_prob, routed_scaling_factor 2.5, a dense
first layer, a shared expert, YaRN with mscale, an MTP layer: tests/test_deepseek_mtp.py serves it) and V2 (softmax routing,
no q LoRA, greedy and group-limited top-k). References are built independently: transformers'
DeepseekV3ForCausalLM / DeepseekV2ForCausalLM from the same files, a per-token Python router, and greedy
tokens of HF generate for the paged runs (prefix-cache hits, chunked prefill, preemption).
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from llmserve.config import Config, ConfigError
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.request import Request
from llmserve.engine.sampling_params import SamplingParams
from llmserve.kernels.attention import AttnMeta
from llmserve.layers.deepseek_config import MoEConfig
from llmserve.layers.kv_cache import kv_spec_for
from llmserve.layers.model_config import ModelConfig
from llmserve.layers.moe import route
from llmserve.layers.parallel import check_shardable
from llmserve.models.random_model import DEEPSEEK_SHAPES, write_random_deepseek
from tests.test_torch_runner import Driver, make_runner

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="fp32 parity on the CPU (the GPU computes in bf16)")

VARIANTS = {
    "v3": ("v3", {}),
    "v2": ("v2", {}),
    "v2-group-limited": ("v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2)),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    version, overrides = VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    write_random_deepseek(path, version, seed=random.randrange(1 << 20), **overrides)
    return path


def hf_model(path):
    cfg = json.loads((path / "config.json").read_text())
    cls = (
        transformers.DeepseekV3ForCausalLM if cfg["model_type"] == "deepseek_v3" else transformers.DeepseekV2ForCausalLM
    )
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def test_full_sequence_logits_match_transformers(checkpoint):
    """One prefill over the paged cache, in the expanded and in the absorbed form: max |diff| <= 1e-4."""
    from llmserve.models.deepseek import DeepseekModel

    mc = ModelConfig.from_file(checkpoint / "config.json")
    model = DeepseekModel(mc, checkpoint, torch.device("cpu"), torch.float32, 512)
    T, bs = 45, 4
    ids = torch.randint(0, mc.vocab_size, (T,))
    spec = kv_spec_for("", torch.float32, mc.num_hidden_layers, 1, bs, mc.head_dim, mc.kv_latent_dim)
    blocks = torch.randperm(16)[: -(-T // bs)]  # non-contiguous blocks
    slots = blocks.repeat_interleave(bs)[:T] * bs + torch.arange(T) % bs
    meta = AttnMeta(torch.tensor([0, T]), torch.tensor([T]), blocks[None], None, None, 0)
    with torch.inference_mode():
        ref = hf_model(checkpoint)(ids[None]).logits[0]
        for absorb_max_q in (0, T):  # every chunk expanded / absorbed
            for lw in model.layers:
                lw.attn.absorb_max_q = absorb_max_q
            ours = model.logits(model.forward(ids, torch.arange(T), slots, meta, spec.allocate(16, "cpu")))
            err = (ours - ref).abs().max().item()
            assert err <= 1e-4, (absorb_max_q, err)


def test_greedy_tokens_and_step_logits_match_transformers(checkpoint, fresh_seed):
    """Through TorchRunner (chunked prefill beside decodes, shuffled blocks): each step's logits against HF's
    full forward of the same tokens, and 16 greedy tokens against HF generate."""
    runner = make_runner(checkpoint, block_bs=4)
    assert runner.kv_spec.latent_dim == runner.model_config.mla.kv_lora_rank
    rng = np.random.default_rng(fresh_seed)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (1, 6, 23)]
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=16, temperature=0.0)) for i, p in enumerate(prompts)]
    seen: dict[str, list[torch.Tensor]] = {r.req_id: [] for r in reqs}

    def record(batch, logits):
        for c, row in zip([c for c in batch.chunks if c.sample], logits):
            seen[c.request.req_id].append(row.float())

    Driver(runner, chunk=5, seed=fresh_seed).run(reqs, on_logits=record)
    hf = hf_model(checkpoint)
    with torch.inference_mode():
        for r, p in zip(reqs, prompts):
            ref = hf(torch.tensor([r.all_token_ids[:-1]])).logits[0, len(p) - 1 :]
            err = (torch.stack(seen[r.req_id]) - ref).abs().max().item()
            assert err <= 1e-4, (r.req_id, err)
            want = hf.generate(
                torch.tensor([p]),
                max_new_tokens=16,
                do_sample=False,
                attention_mask=torch.ones(1, len(p)),
                pad_token_id=0,
            )[0, len(p) :].tolist()
            assert r.output_token_ids == want, r.req_id


# ---------------------------------------------------------------- paged MLA through the engine
def run_engine(path, prompts, params, arrive_at=None, **overrides):
    from llmserve.runners.torch.runner import TorchRunner

    kw = dict(block_size=4, max_seq_len=128, batch_size=8, block_bs=4, max_num_batched_tokens=64)
    kw.update(overrides)
    cfg = Config(**kw)
    engine = LLMEngine(cfg, TorchRunner(str(path), cfg))
    arrive_at = arrive_at or [0] * len(prompts)
    outs = {i: [] for i in range(len(prompts))}
    done, step = set(), 0
    while len(done) < len(prompts):
        for i, t in enumerate(arrive_at):
            if t == step:
                engine.add_request(f"r{i}", prompts[i], params)
        for o in engine.step():
            outs[int(o.req_id[1:])] += o.new_token_ids
            if o.finished:
                done.add(int(o.req_id[1:]))
        step += 1
        assert step < 5000
    bm = engine.block_manager
    assert bm.num_free == bm.num_blocks
    return outs, engine.stats()


def test_paged_mla_prefix_hits_chunked_prefill_preemption_equal_dense(tmp_path, fresh_seed):
    path = write_random_deepseek(tmp_path, "v3", seed=fresh_seed)
    rng = random.Random(fresh_seed)
    prefix = [rng.randrange(256) for _ in range(24)]
    # 25-32 tokens: any two fit the preemption run's 16 blocks together, and their ends (37+ tokens each) do not
    prompts = [prefix + [rng.randrange(256) for _ in range(rng.randint(1, 8))] for _ in range(4)]
    prompts.append(prefix + [5, 6, 7, 8] * 3)  # a repeat, where n-gram speculation proposes
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    hf = hf_model(path)
    with torch.inference_mode():
        dense = {
            i: hf.generate(
                torch.tensor([p]),
                max_new_tokens=12,
                do_sample=False,
                attention_mask=torch.ones(1, len(p)),
                pad_token_id=0,
            )[0, len(p) :].tolist()
            for i, p in enumerate(prompts)
        }
    # the first request fills the prefix cache; the others arrive after its prefill and hit it
    cached, stats = run_engine(path, prompts, params, arrive_at=[0] + [4] * 4)
    assert stats.prefix_cache_hits >= 4 * 24
    assert cached == dense
    # prompts split into chunks of at most 8 tokens, beside the decodes
    chunked, _ = run_engine(path, prompts, params, max_num_batched_tokens=8, enable_prefix_caching=False)
    assert chunked == dense
    # 16 blocks of 4 tokens for 5 requests of ~50 tokens: requests are preempted and recomputed
    small, stats = run_engine(
        path, prompts, params, max_seq_len=64, block_bs=1, block_ratio=1.0, enable_prefix_caching=False
    )
    assert stats.preemptions > 0
    assert small == dense
    # n-gram speculation: verification chunks of several tokens attend in the absorbed form
    spec, stats = run_engine(path, prompts, params, speculate_method="ngram", speculate_max_draft_tokens=4)
    assert stats.spec_verified > 0
    assert spec == dense


# ---------------------------------------------------------------- routing
def reference_route(logits: list[float], bias: list[float] | None, c: MoEConfig) -> dict[int, float]:
    """One token's experts -> weights, in float64 Python, from the routing's definition (DeepSeek's papers)."""
    E = len(logits)
    if c.scoring_func == "sigmoid":
        scores = [1 / (1 + math.exp(-x)) for x in logits]
    else:
        z = sum(math.exp(x) for x in logits)
        scores = [math.exp(x) / z for x in logits]
    choice = [s + (bias[e] if bias else 0.0) for e, s in enumerate(scores)]
    size = E // c.n_group
    if c.topk_method == "noaux_tc":
        rank = [sum(sorted(choice[g * size : (g + 1) * size])[-2:]) for g in range(c.n_group)]
    else:
        rank = [max(choice[g * size : (g + 1) * size]) for g in range(c.n_group)]
    groups = sorted(range(c.n_group), key=lambda g: -rank[g])[: c.topk_group]
    chosen = sorted((e for e in range(E) if e // size in groups), key=lambda e: -choice[e])[: c.num_experts_per_tok]
    w = [scores[e] for e in chosen]
    total = sum(w) if c.norm_topk_prob else 1.0
    return {e: x / total * c.routed_scaling_factor for e, x in zip(chosen, w)}


ROUTINGS = {
    "v3-noaux-tc": ("v3", {}),
    "v2-greedy": ("v2", dict(routed_scaling_factor=1.5)),
    "v2-group-limited": ("v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2)),
}


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_routing_matches_reference(name, fresh_seed):
    version, overrides = ROUTINGS[name]
    d = {**DEEPSEEK_SHAPES[version], **overrides}
    cfg = ModelConfig.from_dict(d).moe
    g = torch.Generator().manual_seed(fresh_seed)
    logits = torch.randn(64, cfg.n_routed_experts, generator=g) * 2
    bias = torch.randn(cfg.n_routed_experts, generator=g) * 0.5 if cfg.topk_method == "noaux_tc" else None
    weights, ids = route(logits, cfg, bias)
    for t in range(logits.shape[0]):
        want = reference_route(logits[t].tolist(), None if bias is None else bias.tolist(), cfg)
        got = dict(zip(ids[t].tolist(), weights[t].tolist()))
        assert set(got) == set(want), t
        assert all(abs(got[e] - want[e]) <= 1e-5 for e in want), t
    if bias is not None:  # the bias chooses: without it some token picks other experts
        assert not torch.equal(ids.sort(1).values, route(logits, cfg, None)[1].sort(1).values)


# ---------------------------------------------------------------- config, rope, cache, refusals
REFUSED = [
    ("v3", "scoring_func", "softmax"),
    ("v3", "topk_method", "greedy"),
    ("v2", "topk_method", "noaux_tc"),
    ("v2", "scoring_func", "sigmoid"),
    ("v3", "moe_layer_freq", 2),
    ("v2", "norm_topk_prob", True),
    ("v3", "hidden_act", "gelu"),
    ("v3", "n_group", 3),
    ("v3", "topk_group", 5),
    ("v3", "num_experts_per_tok", 99),
    ("v3", "kv_lora_rank", None),
    ("v3", "qk_rope_head_dim", 7),
    ("v2", "mlp_bias", True),
    ("v3", "rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
]


def test_fp8_block_checkpoint_matches_its_dequantized_model(tmp_path, fresh_seed):
    """DeepSeek-V3's own FP8 layout (every MLA and expert projection E4M3 with 128 x 128 `weight_scale_inv`,
    `quantization_config` fp8) loads as it is; its logits are transformers' over the dequantized weights."""
    from tests import quant_checkpoints as qc
    from tests.test_quant_model import check_close, dense_copy, our_logits

    src, dst, ref = tmp_path / "src", tmp_path / "fp8", tmp_path / "ref"
    write_random_deepseek(src, "v3", seed=fresh_seed % 1000)
    deq = qc.write_fp8_block(src, dst, linear=qc.DEEPSEEK_LINEAR)
    assert any(".experts." in k for k in deq) and any("kv_b_proj" in k for k in deq)
    dense_copy(src, ref, deq)
    prompts = [np.random.default_rng(fresh_seed).integers(0, 256, n).tolist() for n in (3, 29)]
    hf = hf_model(ref)
    with torch.inference_mode():
        want = [hf(torch.tensor([p])).logits[0].float() for p in prompts]
    check_close(our_logits(dst, prompts), want, 1e-4)


@pytest.mark.parametrize("version,field,value", REFUSED)
def test_unsupported_field_refused_by_name(version, field, value):
    d = {**DEEPSEEK_SHAPES[version], "hidden_act": "silu", field: value}
    name = "rope_scaling" if field == "rope_parameters" else field
    with pytest.raises(ValueError, match=name):
        ModelConfig.from_dict(d)


def test_settings_refused_by_name(tmp_path):
    path = write_random_deepseek(tmp_path, "v2")
    mc = ModelConfig.from_file(path / "config.json")
    with pytest.raises(ConfigError, match="MP_NUM=5: .*num_attention_heads=4.*moe_intermediate_size=24"):
        check_shardable(mc, 5)
    check_shardable(mc, 4)  # heads, features and every expert's split 4 ways (test_tensor_parallel.py)
    with pytest.raises(ConfigError, match="SPECULATE_METHOD=mtp: .* has no MTP module"):
        make_runner(path, block_bs=4, speculate_method="mtp")  # the tiny V2 writes no MTP layer
    with pytest.raises(ValueError, match="KV_CACHE_DTYPE=int8"):
        kv_spec_for("int8", torch.float32, 2, 1, 4, mc.head_dim, mc.kv_latent_dim)
    llama_yarn = dict(architectures=["LlamaForCausalLM"], vocab_size=8, hidden_size=8, intermediate_size=8)
    llama_yarn.update(num_hidden_layers=1, num_attention_heads=2, rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_dict(llama_yarn)


def test_latent_cache_spec():
    """One plane of [latent | rope key] a token and layer; V a view of K's latent features."""
    spec = kv_spec_for("", torch.bfloat16, 3, 1, 16, 512 + 64, latent_dim=512)
    assert spec.block_bytes == 3 * 16 * 576 * 2  # half of a K-and-V cache of that width
    cache = spec.allocate(5, "cpu")
    assert cache.data.shape == (3, 1, 5, 1, 16, 576) and cache.data.dtype == torch.float16
    k, v, ks, vs = cache.layer(2)
    assert k.shape == (5, 1, 16, 576) and v.shape == (5, 1, 16, 512) and ks is None and vs is None
    k[1, 0, 3, :512] = 7.0
    assert v[1, 0, 3].eq(7.0).all() and v.data_ptr() == k.data_ptr()


@pytest.mark.parametrize(
    "params",
    [
        dict(
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        dict(factor=4.0, original_max_position_embeddings=128, mscale=0.707, mscale_all_dim=0.707),
        dict(factor=8.0, original_max_position_embeddings=64),
        dict(factor=2.0, original_max_position_embeddings=64, attention_factor=1.3, beta_fast=16, beta_slow=2),
    ],
)
def test_yarn_matches_transformers(params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

    from llmserve.layers.rope import rope_inv_freq, yarn_attention_factor, yarn_softmax_mscale

    rope = dict(rope_type="yarn", rope_theta=10000.0, **params)
    cfg = transformers.DeepseekV3Config(qk_rope_head_dim=64, max_position_embeddings=8192, rope_parameters=dict(rope))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    np.testing.assert_allclose(rope_inv_freq(64, 10000.0, rope), inv_freq.numpy(), rtol=1e-6)
    assert yarn_attention_factor(rope) == pytest.approx(factor, rel=1e-12)
    assert yarn_softmax_mscale(rope) == pytest.approx(yarn_apply_mscale(cfg.rope_parameters, 1.0), rel=1e-12)
