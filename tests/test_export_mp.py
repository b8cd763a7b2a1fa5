"""Sharded export (`llmserve export --mp N`): the ranks' graphs together are the unsharded model.

Three checks:
- the weights each rank's graph holds (read back from its model.pdiparams) reproduce the model:
  a float64 numpy forward over the shards, where each all-reduce is the sum of the ranks'
  partial outputs and the all-gather a concatenation, equals the same forward over the unsharded
  export, which itself matches transformers (tiny random HF checkpoints; KV heads split, KV heads
  replicated (fewer than ranks), vocabulary padded, tied embeddings, biases);
- the saved graphs themselves, run one process per rank on CPU with Paddle's gloo communicator
  (paddle.inference predictor, collectives in the graph), give the unsharded graph's logits over
  mixed prefill/decode steps;
- bad --mp values and MP_NUM mismatches fail with one message naming the numbers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

from llmserve.cli import main as cli_main
from llmserve.config import Config
from llmserve.engine.request import Request
from llmserve.engine.runner_contract import SeqChunk
from llmserve.engine.sampling_params import SamplingParams
from llmserve.layers.model_config import ModelConfig
from llmserve.runners.paddle import runner as runner_module
from llmserve.runners.paddle.export import export_hf, export_random, export_weights
from llmserve.runners.paddle.export_mp import check_mp
from llmserve.runners.paddle.graph import INPUT_SPECS, cache_names, param_shapes
from llmserve.runners.paddle.inputs import build_step_inputs
from llmserve.runners.paddle.runner import PaddleRunner, check_ranks, rank_dirs

BLOCK, NUM_BLOCKS = 4, 8
# KV heads fewer than ranks (replicated), a vocabulary that 2 ranks must pad, o_proj bias, tied.
RANDOM = ModelConfig(
    architecture="llama", vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True, attention_bias=True,
    max_position_embeddings=64, eos_token_ids=(1,),
)  # fmt: skip


def load_params(rank_dir: Path) -> dict[str, np.ndarray]:
    """The weights saved in rank_dir/model.pdiparams, by name."""
    was_dynamic = paddle.in_dynamic_mode()
    paddle.enable_static()
    try:
        scope = paddle.static.Scope()
        with paddle.static.scope_guard(scope):
            paddle.static.load_inference_model(str(rank_dir / "model"), paddle.static.Executor(paddle.CPUPlace()))
            return {n: np.array(scope.find_var(n).get_tensor()) for n in scope.local_var_names()}
    finally:
        if was_dynamic:
            paddle.disable_static()


def load_ranks(model_dir: Path) -> list[tuple[dict[str, np.ndarray], dict]]:
    ranks = [model_dir / name for name in rank_dirs(model_dir)]
    tp = [json.loads((d / "tp.json").read_text()) if (d / "tp.json").is_file() else None for d in ranks]
    return [(load_params(d), t) for d, t in zip(ranks, tp)]


def tp_forward(cfg: ModelConfig, ranks: list[tuple[dict[str, np.ndarray], dict | None]], ids) -> np.ndarray:
    """Logits [T, vocab] of one sequence, float64, dense causal attention, over the ranks' shards:
    every all-reduce sums the ranks' partial outputs, the logits all-gather concatenates them."""
    w64 = [{n: x.astype(np.float64) for n, x in w.items()} for w, _ in ranks]
    ids, d, t = np.asarray(ids), cfg.head_dim, len(ids)
    freqs = np.arange(t)[:, None] * w64[0]["rope.inv_freq"][None]
    cos, sin = (f(np.concatenate([freqs, freqs], -1))[:, None] for f in (np.cos, np.sin))  # [T, 1, D]
    causal = np.tril(np.ones((t, t), bool))

    def norm(x, g):
        return g * x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps)

    def rope(x):  # [T, heads, D], rotate-half
        x1, x2 = np.split(x, 2, -1)
        return x * cos + np.concatenate([-x2, x1], -1) * sin

    def embed(w, tp):  # c_embedding: the rank's vocabulary rows, zero for other ids
        start = tp["vocab"][0] if tp else 0
        local = (ids >= start) & (ids < start + len(w["embed_tokens.weight"]))
        return np.where(local[:, None], w["embed_tokens.weight"][np.where(local, ids - start, 0)], 0.0)

    def attention(w, i, x):
        p = f"layers.{i}.self_attn."
        qkv = x @ w[p + "qkv_proj.weight"] + w.get(p + "qkv_proj.bias", 0.0)
        kv_heads = (qkv.shape[1] // d - len(w[p + "o_proj.weight"]) // d) // 2
        q, k, v = np.split(qkv.reshape(t, -1, d), [qkv.shape[1] // d - 2 * kv_heads, -kv_heads], axis=1)
        g = q.shape[1] // kv_heads
        q, k, v = rope(q), np.repeat(rope(k), g, 1), np.repeat(v, g, 1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(d)
        s = np.exp(np.where(causal, s, -np.inf) - s.max(-1, keepdims=True))
        o = np.einsum("hts,shd->thd", s / s.sum(-1, keepdims=True), v).reshape(t, -1)
        return o @ w[p + "o_proj.weight"]

    def mlp(w, i, x):
        gate, up = np.split(x @ w[f"layers.{i}.mlp.gate_up_proj.weight"], 2, -1)
        return (gate / (1 + np.exp(-gate)) * up) @ w[f"layers.{i}.mlp.down_proj.weight"]

    h = sum(embed(w, tp) for w, (_, tp) in zip(w64, ranks))
    for i in range(cfg.num_hidden_layers):
        h = h + sum(attention(w, i, norm(h, w[f"layers.{i}.input_layernorm.weight"])) for w in w64)
        h = h + w64[0].get(f"layers.{i}.self_attn.o_proj.bias", 0.0)  # replicated: added once, after the sum
        h = h + sum(mlp(w, i, norm(h, w[f"layers.{i}.post_attention_layernorm.weight"])) for w in w64)
    heads = [w.get("lm_head.weight", w["embed_tokens.weight"].T) for w in w64]
    return np.concatenate([norm(h, w["norm.weight"]) @ lm for w, lm in zip(w64, heads)], -1)[:, : cfg.vocab_size]


def graph_ops(program: Path) -> dict[str, int]:
    found = re.findall(r'"#":"1\.(mp_allreduce_sum|all_gather|c_embedding|scatter_)"', program.read_text())
    return {op: found.count(op) for op in ("mp_allreduce_sum", "all_gather", "c_embedding", "scatter_")}


@pytest.mark.parametrize(
    "arch,mp,extra",
    [
        ("qwen2", 2, {}),
        ("llama", 2, {"num_key_value_heads": 1, "tie_word_embeddings": True, "vocab_size": 301}),
        ("llama", 4, {"attention_bias": True, "vocab_size": 301}),
    ],
    ids=["qwen2-kv-split", "llama-kv-replicated-tied-padded", "llama-mp4-kv-pairs-obias"],
)
def test_shards_reproduce_the_model(tmp_path, fresh_seed, arch, mp, extra):
    torch = pytest.importorskip("torch")
    from test_export_hf import hf_logits, write_checkpoint

    hf = tmp_path / "hf"
    write_checkpoint(hf, arch, torch.float32, False, **extra)
    full, sharded = export_hf(hf, tmp_path / "mp1"), export_hf(hf, tmp_path / f"mp{mp}", mp=mp)
    cfg = ModelConfig.from_file(sharded / "config.json")
    assert cfg == ModelConfig.from_file(full / "config.json")  # the full model's config, not a rank's

    ranks = load_ranks(sharded)
    assert [tp["rank"] for _, tp in ranks] == list(range(mp)) and all(tp["world_size"] == mp for _, tp in ranks)
    kv = cfg.num_key_value_heads
    for r, (_, tp) in enumerate(ranks):
        assert tp["key_value_heads"] == (
            [r // (mp // kv), r // (mp // kv) + 1] if kv < mp else [r * kv // mp, (r + 1) * kv // mp]
        )
        assert tp["vocab_size_padded"] == -(-cfg.vocab_size // mp) * mp
        n = cfg.num_hidden_layers
        ops = graph_ops(sharded / f"rank_{r}" / "model.json")
        assert ops == {"mp_allreduce_sum": 2 * n + 1, "all_gather": 1, "c_embedding": 1, "scatter_": 2 * n}, ops
    assert (sharded / "rank_mapping.csv").read_text().splitlines() == (
        ["[ring_id -> ranks]", "0," + ",".join(map(str, range(mp))), "[rank -> ring_ids]"]
        + [f"{r},0" for r in range(mp)]
    )

    ids = np.random.default_rng(fresh_seed).integers(0, cfg.vocab_size, 19)
    ids[-1] = cfg.vocab_size - 1  # the last rank's vocabulary slice, next to the padding
    want = tp_forward(cfg, load_ranks(full), ids)
    got = tp_forward(cfg, ranks, ids)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9, err_msg=f"seed {fresh_seed}")
    # The float64 forward is the model: transformers (float32) agrees with it.
    np.testing.assert_allclose(want, hf_logits(hf, [int(i) for i in ids]), rtol=1e-4, atol=1e-4)
    assert np.abs(want).max() > 1.0


# ---- the saved graphs, one process per rank over gloo ------------------------------------------


def _steps() -> list[list[SeqChunk]]:
    """Two sequences: chunked prefill, then prefill mixed with decode, then decode (as the engine packs them)."""
    a = Request("a", [5, 300, 17, 42, 99, 150, 151, 7, 8, 9, 250, 3], SamplingParams())
    b = Request("b", [300, 1, 2, 151, 150, 60, 61, 62], SamplingParams())
    a.block_table, b.block_table = [5, 2, 7], [3, 6, 0]
    return [
        [SeqChunk(a, 0, 7, True), SeqChunk(b, 0, 3, True)],
        [SeqChunk(a, 7, 1, True), SeqChunk(b, 3, 4, True)],
        [SeqChunk(a, 8, 1, True), SeqChunk(b, 7, 1, True)],
        [SeqChunk(a, 9, 3, True)],
    ]


def rank_worker(model_dir: str, rank: int, endpoints: list[str], out: str) -> None:
    """In a subprocess: join the gloo group, run rank `rank`'s graph over `_steps()`, save the logits."""
    os.environ.update(
        PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM=str(len(endpoints) - 1), PADDLE_RANK_IN_NODE=str(rank),
        PADDLE_MASTER=endpoints[0], PADDLE_TRAINER_ENDPOINTS=",".join(endpoints[1:]),
        PADDLE_CURRENT_ENDPOINT=endpoints[1 + rank], PADDLE_DISTRI_BACKEND="gloo",
    )  # fmt: skip
    import paddle.distributed as dist
    import paddle.inference as infer

    paddle.set_device("cpu")
    dist.init_parallel_env()  # the communicator of ring 0, which the graph's collectives use
    rank_dir = Path(model_dir) / f"rank_{rank}"
    cfg = infer.Config(str(rank_dir / "model.json"), str(rank_dir / "model.pdiparams"))
    cfg.disable_gpu()
    cfg.disable_mkldnn()
    cfg.set_cpu_math_library_num_threads(1)
    cfg.disable_glog_info()
    predictor = infer.create_predictor(cfg)
    kv_dim = json.loads((rank_dir / "tp.json").read_text())["key_value_heads"]
    kv_dim = (kv_dim[1] - kv_dim[0]) * RANDOM.head_dim
    caches = [paddle.zeros([NUM_BLOCKS * BLOCK, kv_dim], "float32") for _ in cache_names(RANDOM.num_hidden_layers)]
    for name, cache in zip(cache_names(RANDOM.num_hidden_layers), caches):
        predictor.get_input_handle(name).share_external_data(cache)
    rows = []
    for chunks in _steps():
        inputs = build_step_inputs(chunks, BLOCK)
        for name, _, _ in INPUT_SPECS:
            predictor.get_input_handle(name).copy_from_cpu(inputs[name])
        predictor.run()
        logits = predictor.get_output_handle(predictor.get_output_names()[0]).copy_to_cpu()
        rows.append(logits[: int(inputs["num_logits"])])
    np.save(out, np.concatenate(rows))


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture(scope="module")
def random_exports(tmp_path_factory) -> tuple[Path, Path]:
    """RANDOM unsharded and over 2 ranks; weights spread wider than init so attention is far from uniform."""
    rng, base = np.random.default_rng(3), tmp_path_factory.mktemp("mp")
    w = {n: (0.15 * rng.standard_normal(s)).astype(np.float32) for n, s in param_shapes(RANDOM).items()}
    w["rope.inv_freq"] = RANDOM.inv_freq()
    w.update({n: (1 + 0.2 * rng.standard_normal(x.shape)).astype(np.float32) for n, x in w.items() if "norm" in n})
    return export_weights(RANDOM, w, base / "mp1"), export_weights(RANDOM, w, base / "mp2", mp=2)


def test_rank_graphs_run_over_gloo(random_exports, tmp_path):
    full, sharded = random_exports
    endpoints = [f"127.0.0.1:{p}" for p in _free_ports(3)]  # master, rank 0, rank 1
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(sharded), str(r), ",".join(endpoints), str(tmp_path / f"rank{r}.npy")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in range(2)
    ]
    runner = PaddleRunner(str(full), Config(block_size=BLOCK, max_seq_len=NUM_BLOCKS * BLOCK, block_bs=1), None)
    want = np.concatenate([runner.forward(chunks)[0] for chunks in _steps()])  # while the ranks start
    for p in procs:
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("rank processes did not finish in 120 s (gloo rendezvous?)")
        assert p.returncode == 0, out[-3000:]
    for r in range(2):  # every rank ends with the all-gathered logits
        got = np.load(tmp_path / f"rank{r}.npy")
        assert got.shape == want.shape == (7, RANDOM.vocab_size)  # one row per sampling chunk
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(want).max() > 1.0


# ---- errors ------------------------------------------------------------------------------------


def test_check_mp_names_the_settings():
    check_mp(RANDOM, 1)
    check_mp(RANDOM, 4)  # 1 KV head: replicated on every rank
    with pytest.raises(ValueError) as e:
        check_mp(RANDOM, 8)
    assert "--mp 8" in str(e.value) and "num_attention_heads=4" in str(e.value)
    bad = dataclasses.replace(RANDOM, num_attention_heads=6, num_key_value_heads=3, intermediate_size=98)
    with pytest.raises(ValueError) as e:
        check_mp(bad, 4)
    msg = str(e.value)
    assert "num_attention_heads=6" in msg and "num_key_value_heads=3" in msg and "intermediate_size=98" in msg
    with pytest.raises(ValueError, match="intermediate_size=99 is not a multiple of 2"):
        check_mp(dataclasses.replace(RANDOM, intermediate_size=99), 2)


def test_cli_mp_flag(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(RANDOM.to_hf_dict()))
    assert cli_main(["export", "--hf", str(hf), "--out", str(tmp_path / "o"), "--mp", "3"]) == 2
    err = capsys.readouterr().err
    assert "--mp 3" in err and "num_attention_heads=4 is not a multiple of 3" in err  # before any weight is read
    assert cli_main(["export", "--random-demo", "--out", str(tmp_path / "o"), "--mp", "2"]) == 2
    assert "--mp is for --hf only" in capsys.readouterr().err


def test_reexport_drops_stale_ranks(tmp_path):
    out = export_random(RANDOM, tmp_path / "m", seed=0, mp=2)
    assert (out / "rank_1" / "tp.json").is_file() and (out / "rank_mapping.csv").is_file()
    export_random(RANDOM, out, seed=0)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "rank_0"]
    assert sorted(p.name for p in (out / "rank_0").iterdir()) == ["model.json", "model.pdiparams"]


@pytest.mark.skipif(paddle.is_compiled_with_cuda(), reason="the CPU build")
def test_cpu_build_serves_mp(random_exports):
    """MP_NUM=2 over 2 rank graphs passes the checks (served over gloo: test_paddle_tensor_parallel.py);
    a PaddleRunner built outside llmserve.executor's group says where its ranks start."""
    _, sharded = random_exports
    config = Config(mp_num=2, block_size=BLOCK, block_bs=1)
    check_ranks(sharded, config)
    with pytest.raises(ValueError, match=r"^MP_NUM=2: the Paddle runner's ranks start through llmserve.executor"):
        PaddleRunner(str(sharded), config, None)


def test_runner_checks_rank_count(random_exports, monkeypatch):
    full, sharded = random_exports
    with pytest.raises(ValueError) as e:
        check_ranks(sharded, Config(mp_num=1))
    msg = str(e.value)
    assert re.match(r"MP_NUM=1 but .* holds 2 rank graph\(s\) \(rank_0, rank_1\); .*--mp 1", msg), msg
    assert "CPU build" not in msg
    with pytest.raises(ValueError, match=r"^MP_NUM=2 but .* holds 1 rank graph\(s\) \(rank_0\)$"):
        check_ranks(full, Config(mp_num=2))
    check_ranks(full, Config(mp_num=1))
    # A GPU build: the counts match, serving them over NCCL is what is missing; LLMSERVE_DEVICE=cpu is not.
    monkeypatch.setattr(runner_module.paddle, "is_compiled_with_cuda", lambda: True)
    with pytest.raises(ValueError) as e:
        check_ranks(sharded, Config(mp_num=2))
    msg = str(e.value)
    assert msg.startswith("MP_NUM=2: ") and "on GPU (NCCL) is not implemented in the Paddle runner" in msg, msg
    assert "LLMSERVE_DEVICE=cpu" in msg and "LLMSERVE_RUNNER=torch" in msg
    check_ranks(sharded, Config(mp_num=2, device="cpu"))


if __name__ == "__main__":  # rank_worker's process: model_dir rank endpoints out
    rank_worker(sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4])
