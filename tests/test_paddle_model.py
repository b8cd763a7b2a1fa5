"""The paged Paddle static graph against the dygraph model and a dense-attention reference.

Tiny models (hidden 64, heads 4, GQA), block_size 4 so sequences span many blocks, and
block tables drawn from a shuffled pool so blocks are non-contiguous and interleaved.
Weights are random with a larger spread than real init, so attention is far from uniform
and a masking or indexing error moves the logits well beyond the tolerances.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import paddle
import pytest
from conftest import new_seed

from llmserve.config import Config
from llmserve.engine.request import Request
from llmserve.engine.runner_contract import SeqChunk, StepBatch
from llmserve.engine.sampling_params import SamplingParams
from llmserve.layers.model_config import ModelConfig
from llmserve.models.layout import ModelFormatError, detect_model_format
from llmserve.runners.paddle import runner as runner_module
from llmserve.runners.paddle.export import export_random, export_weights
from llmserve.runners.paddle.graph import LlamaPaddle, param_shapes
from llmserve.runners.paddle.inputs import build_step_inputs
from llmserve.runners.paddle.opcheck import MissingKernelsError, missing_kernels
from llmserve.runners.paddle.runner import PaddleRunner

BLOCK = 4
QWEN = ModelConfig(
    architecture="qwen2", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True, rope_theta=10000.0,
    max_position_embeddings=256, bos_token_id=0, eos_token_ids=(1,),
)  # fmt: skip
LLAMA = ModelConfig(
    architecture="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=1, head_dim=16, rope_theta=500000.0, max_position_embeddings=256,
    tie_word_embeddings=True, eos_token_ids=(2, 3),
)  # fmt: skip


class GreedySampler:
    """Stand-in for engine.sampler.Sampler: argmax, records drops."""

    def __init__(self):
        self.dropped: list[str] = []

    def sample_chunks(self, logits, chunks):
        assert len(logits) == len(chunks)  # no drafts here: one row each
        return [[int(i)] for i in logits.argmax(-1)], None

    def drop(self, req_ids):
        self.dropped.extend(req_ids)


def test_weights(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = {}
    for name, shape in param_shapes(cfg).items():
        if name == "rope.inv_freq":
            w[name] = cfg.inv_freq()
        elif name.endswith("norm.weight"):
            w[name] = (1 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        else:
            w[name] = (0.15 * rng.standard_normal(shape)).astype(np.float32)
    return w


test_weights.__test__ = False  # a helper, not a test


def make_runner(model_dir, num_blocks: int = 64, **kw) -> PaddleRunner:
    config = Config(block_size=BLOCK, max_seq_len=num_blocks * BLOCK, block_bs=1, **kw)
    return PaddleRunner(str(model_dir), config, GreedySampler())


@pytest.fixture(scope="module", params=[QWEN, LLAMA], ids=["qwen2-bias-gqa2", "llama-tied-gqa4"])
def model(request, tmp_path_factory):
    cfg = request.param
    weights = test_weights(cfg, seed=new_seed(request))  # a failing test's report names it
    out = export_weights(cfg, weights, tmp_path_factory.mktemp(cfg.architecture))
    return cfg, weights, out


def new_request(rng, name: str, num_tokens: int, blocks: list[int]) -> Request:
    req = Request(name, [int(t) for t in rng.integers(0, 300, num_tokens)], SamplingParams(temperature=0.0))
    req.block_table = blocks
    return req


def test_static_graph_equals_dygraph(model, monkeypatch, fresh_seed):
    """One mixed step (two prefills, one of them chunk 2, and a decode) through the saved graph
    and through the same paged forward run eagerly: logits and caches are bitwise equal.
    The predictor runs single-threaded here like eager mode: with 2 math threads the GEMMs
    split their sums differently and ~0.3% of logits move by one ulp."""
    cfg, weights, out = model
    runner = make_runner(out, paddle_threads=1)
    rng = np.random.default_rng(fresh_seed)
    pool = [int(b) for b in rng.permutation(runner.num_kv_blocks)]
    reqs = [new_request(rng, f"r{i}", n, pool[i * 8 : i * 8 + 8]) for i, n in enumerate([13, 22, 9])]
    chunks = [SeqChunk(reqs[0], 0, 13, True), SeqChunk(reqs[1], 10, 12, True), SeqChunk(reqs[2], 8, 1, True)]
    for r, c in ((reqs[1], 10), (reqs[2], 8)):  # the cached prefix: write it with a first step
        runner.forward([SeqChunk(r, 0, c, False)])
    eager_caches = [paddle.to_tensor(c.numpy()) for c in runner.kv_caches]
    logits, model_time = runner.forward(chunks)

    inputs = build_step_inputs(chunks, BLOCK)
    eager = LlamaPaddle.from_numpy(cfg, weights).forward_paged(
        {k: paddle.to_tensor(v) for k, v in inputs.items() if k != "num_logits"}, eager_caches
    )
    assert logits.shape == (3, cfg.vocab_size) and model_time > 0
    np.testing.assert_array_equal(logits, eager.numpy())
    for static_cache, eager_cache in zip(runner.kv_caches, eager_caches):
        np.testing.assert_array_equal(static_cache.numpy(), eager_cache.numpy())


def test_paged_steps_match_dense_reference(model, fresh_seed):
    """Eight sequences arrive over time, prefill in random chunks (1..9 tokens, so some chunks
    are single tokens and some tiles are padded), then decode, all in mixed batches. Every
    chunk's last-token logits match the dense full-sequence forward at that position, and at
    the end every cached K/V row equals the dense K (after RoPE) / V of its token."""
    cfg, weights, out = model
    runner = make_runner(out, num_blocks=96)
    dense = LlamaPaddle.from_numpy(cfg, weights)
    rng = np.random.default_rng(fresh_seed)
    pool = [int(b) for b in rng.permutation(runner.num_kv_blocks)]
    seqs = []
    for i in range(8):
        total = int(rng.integers(6, 40))
        req = new_request(rng, f"s{i}", int(rng.integers(2, total)), [pool.pop() for _ in range(-(-total // BLOCK))])
        future = [int(t) for t in rng.integers(0, 300, total - req.num_prompt_tokens)]
        seqs.append((req, future, int(rng.integers(0, 6))))  # (request, tokens it will "generate", arrival step)
    refs = {r.req_id: dense.forward_dense(r.prompt_token_ids + f) for r, f, _ in seqs}
    done = {r.req_id: 0 for r, _, _ in seqs}
    checked, step = 0, 0
    while any(done[r.req_id] < r.num_prompt_tokens + len(f) for r, f, _ in seqs):
        chunks = []
        for req, future, arrival in seqs:
            pos, total = done[req.req_id], req.num_prompt_tokens + len(future)
            if step < arrival or pos >= total:
                continue
            n = min(int(rng.integers(1, 10)), req.num_tokens - pos) if pos < req.num_prompt_tokens else 1
            chunks.append(SeqChunk(req, pos, n, sample=bool(rng.random() < 0.8)))
        if not chunks:  # nobody has arrived yet, or everyone waits on a later arrival
            step += 1
            continue
        rng.shuffle(chunks)
        logits, _ = runner.forward(chunks)
        sampled = [c for c in chunks if c.sample]
        assert logits.shape == (len(sampled), cfg.vocab_size)
        for row, c in zip(logits, sampled):
            want = refs[c.request.req_id][0].numpy()[c.start + c.num_tokens - 1]
            np.testing.assert_allclose(row, want, rtol=1e-5, atol=5e-5, err_msg=f"step {step} {c}")
            checked += 1
        for c in chunks:
            done[c.request.req_id] = c.start + c.num_tokens
            if done[c.request.req_id] == c.request.num_tokens:  # "generate" the next known token
                future = next(f for r, f, _ in seqs if r is c.request)
                if len(c.request.output_token_ids) < len(future):
                    c.request.output_token_ids.append(future[len(c.request.output_token_ids)])
        step += 1
    assert checked > 40 and step > 10

    caches = [c.numpy() for c in runner.kv_caches]
    for req, _, _ in seqs:
        pos = np.arange(req.num_tokens)
        slots = np.array(req.block_table)[pos // BLOCK] * BLOCK + pos % BLOCK
        _, keys, values = refs[req.req_id]
        for layer in range(cfg.num_hidden_layers):
            np.testing.assert_allclose(caches[2 * layer][slots], keys[layer].numpy(), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(caches[2 * layer + 1][slots], values[layer].numpy(), rtol=1e-5, atol=1e-5)


def test_step_inputs_route_every_token():
    rng = np.random.default_rng(3)
    reqs = [new_request(rng, f"q{i}", 40, list(range(i * 10, i * 10 + 10))) for i in range(4)]
    chunks = [SeqChunk(reqs[0], 0, 37, True), SeqChunk(reqs[1], 20, 1, True), SeqChunk(reqs[2], 5, 3, False)]
    inp = build_step_inputs(chunks, BLOCK, max_tile=16)
    assert inp["tile_tok"].shape == (3 + 1, 16)  # 37 tokens -> 3 tiles of 16, 3 tokens -> 1 tile
    routed = np.concatenate([inp["tile_tok"].reshape(-1), inp["row_tok"].reshape(-1)])[inp["out_index"]]
    np.testing.assert_array_equal(routed, np.arange(41))
    np.testing.assert_array_equal(inp["positions"][[0, 36, 37, 38, 40]], [0, 36, 20, 5, 7])
    assert inp["slot_mapping"][37] == reqs[1].block_table[20 // BLOCK] * BLOCK + 20 % BLOCK
    np.testing.assert_array_equal(inp["logits_index"], [36, 37])
    decode_only = build_step_inputs([SeqChunk(r, 39, 1, True) for r in reqs], BLOCK)
    assert decode_only["tile_tok"].shape == (1, 1) and decode_only["row_tok"].shape == (4, 1)
    assert int(build_step_inputs([SeqChunk(reqs[3], 0, 5, False)], BLOCK)["num_logits"]) == 0


def test_runner_execute_and_attributes(model):
    cfg, _, out = model
    runner = make_runner(out)
    assert runner.num_kv_blocks == 64 and runner.block_size == BLOCK and runner.vocab_size == cfg.vocab_size
    assert runner.max_model_len == 256 and runner.eos_token_ids == frozenset(cfg.eos_token_ids)
    rng = np.random.default_rng(4)
    reqs = [new_request(rng, f"e{i}", 6, [i * 2, i * 2 + 1]) for i in range(3)]
    batch = StepBatch([SeqChunk(r, 0, 6, i != 1) for i, r in enumerate(reqs)], finished_req_ids=["gone"])
    result = runner.execute(batch)
    logits, _ = runner.forward([SeqChunk(r, 0, 6, True) for r in reqs])  # same tokens, same slots: same values
    assert result.token_ids == [[int(logits[0].argmax())], [int(logits[2].argmax())]]
    assert result.model_time > 0 and runner.sampler.dropped == ["gone"]
    memory_sized = PaddleRunner(str(out), Config(block_size=8, max_seq_len=512, batch_size=3), GreedySampler())
    assert memory_sized.num_kv_blocks == 3 * 64  # capped at batch_size x blocks per sequence


def test_kv_cache_sized_from_free_memory(model, monkeypatch):
    """Without BLOCK_BS: the caches (all layers, K and V) fill KV_CACHE_MEMORY_FRACTION of
    MemAvailable less headroom: 256 MiB and the largest step's activations, a step of
    MAX_PREFILL_TOKENS + BATCH_SIZE tokens (4 bytes x tokens x (3 heads x context + 3 x intermediate
    + 8 x hidden))."""
    _, _, out = model
    monkeypatch.setattr(runner_module, "mem_available", lambda: 2 << 30)
    config = Config(
        block_size=8, max_seq_len=256, batch_size=10_000, kv_cache_memory_fraction=0.5, max_num_batched_tokens=16
    )
    runner = PaddleRunner(str(out), config, GreedySampler())
    mc = ModelConfig.from_file(out / "config.json")
    act = 4 * 10_016 * (3 * mc.num_attention_heads * 256 + 3 * mc.intermediate_size + 8 * mc.hidden_size)
    want = (1 << 30) - act - (256 << 20)
    cache_bytes = sum(c.numel().item() * 4 for c in runner.kv_caches)
    assert cache_bytes == runner.num_kv_blocks * 8 * 4 * sum(c.shape[1] for c in runner.kv_caches)
    assert runner.num_kv_blocks < 10_000 * 32  # sized by memory, not capped at BATCH_SIZE sequences
    assert 0.99 * want < cache_bytes <= want
    monkeypatch.setattr(runner_module, "mem_available", lambda: 512 << 20)
    with pytest.raises(MemoryError, match="BLOCK_BS"):
        PaddleRunner(str(out), config, GreedySampler())


def test_export_random_is_deterministic(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "tokenizer.json").write_text('{"kept": true}')
    files = ["config.json", "generation_config.json", "rank_0/model.json", "rank_0/model.pdiparams"]

    def digests(d):
        return [hashlib.sha256((d / f).read_bytes()).hexdigest() for f in files]

    a, b, c = (export_random(LLAMA, tmp_path / n, seed=s) for n, s in (("a", 5), ("b", 5), ("c", 6)))
    assert digests(a) == digests(b)
    assert digests(a)[3] != digests(c)[3] and digests(a)[:3] == digests(c)[:3]
    assert (a / "tokenizer.json").read_text() == '{"kept": true}'
    assert ModelConfig.from_file(a / "config.json") == LLAMA
    assert detect_model_format(a) == "paddle"


def test_missing_kernels_are_named_before_loading(tmp_path):
    """A graph holding ops with no CPU kernel (as PaddleNLP's fused GPU graphs do) fails at load,
    naming every such op. Built by renaming two ops of our saved graph: this CPU build cannot
    even trace block_multihead_attention (its dtype check needs a kernel)."""
    out = export_random(QWEN, tmp_path / "m", seed=0)
    program = out / "rank_0" / "model.json"
    assert missing_kernels(program) == []
    text = program.read_text()
    assert '"1.rsqrt"' in text and '"1.silu"' in text
    text = text.replace('"1.rsqrt"', '"1.block_multihead_attention"', 1).replace('"1.silu"', '"1.fused_bias_act"', 1)
    program.write_text(text)
    with pytest.raises(MissingKernelsError) as err:
        make_runner(out)
    assert "block_multihead_attention" in str(err.value) and "fused_bias_act" in str(err.value)
    assert "rsqrt" not in str(err.value)


def test_missing_kernels_in_legacy_pdmodel(tmp_path):
    from paddle.base.proto import framework_pb2

    desc = framework_pb2.ProgramDesc()
    block = desc.blocks.add(idx=0, parent_idx=-1)
    for op_type in (
        "feed",
        "lookup_table_v2",
        "matmul_v2",
        "reshape2",
        "fill_constant",
        "masked_multihead_attention",
        "fetch",
    ):
        block.ops.add(type=op_type)
    path = tmp_path / "model.pdmodel"
    path.write_bytes(desc.SerializeToString())
    assert missing_kernels(path) == ["masked_multihead_attention"]


def test_wrong_directory_lists_expected_and_found(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    (tmp_path / "rank_0").mkdir()
    (tmp_path / "rank_0" / "model.json").write_text("{}")
    with pytest.raises(ModelFormatError) as err:
        make_runner(tmp_path)
    msg = str(err.value)
    for part in (
        "config.json",
        "rank_0/model.pdiparams",
        "*.safetensors",
        "found: rank_0/, weights.bin, rank_0/model.json",
    ):
        assert part in msg, msg
    (tmp_path / "config.json").write_text(json.dumps(QWEN.to_hf_dict()))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert detect_model_format(tmp_path) == "hf"
    with pytest.raises(ModelFormatError, match="Hugging Face checkpoint"):
        make_runner(tmp_path)
