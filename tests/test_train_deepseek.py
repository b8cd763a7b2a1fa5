"""`llmserve train --preset tiny-deepseek --mtp`: the DeepSeek-V3 family's reference model (MLA, experts, its MTP
layer), trained here in about a second on the CPU (30 steps, 30 stdlib files).

What it must be: a checkpoint in DeepSeek-V3's own layout (experts one by one, routers and their bias in
float32, the MTP layer at index num_hidden_layers) that transformers' DeepseekV3ForCausalLM and the torch runner
both read, with the same logits; the auxiliary-loss-free balancing moved the routers' biases; the MTP layer
serves SPECULATE_METHOD=mtp losslessly; the Paddle exporter refuses the family by name.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from llmserve.cli import main  # noqa: E402
from llmserve.engine.sampling_params import SamplingParams  # noqa: E402
from llmserve.offline import LLM  # noqa: E402
from llmserve.train.presets import PRESETS  # noqa: E402


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-deepseek")
    out = root / "model"
    args = ["train", "--preset", "tiny-deepseek", "--out", str(out), "--max-files", "30", "--mtp"]
    assert main([*args, "--cache-dir", str(root / "cache"), "--device", "cpu"]) == 0
    return out, json.loads((out / "train_metrics.json").read_text())


def test_it_learns_and_reports_its_experts(trained):
    out, m = trained
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < log[0]["loss"] - 0.5
    assert m["heldout_ppl"] < 0.7 * m["vocab_size"]  # a uniform guess: the vocabulary size
    preset = PRESETS["tiny-deepseek"]
    assert m["params"] == preset.num_params(m["vocab_size"]) and m["mtp_params"] == preset.mtp_params()
    routers = preset.num_hidden_layers - preset.deepseek.first_k_dense_replace + 1  # + the MTP layer's
    assert len(m["expert_load"]) == routers
    assert all(r["max_over_mean"] >= 1 >= r["min_over_mean"] for r in m["expert_load"])


def test_checkpoint_layout_is_deepseek_v3s(trained):
    out, _ = trained
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["num_nextn_predict_layers"] == 1
    t = load_file(out / "model.safetensors")
    n, ds = cfg["num_hidden_layers"], PRESETS["tiny-deepseek"].deepseek
    for layer in (1, n):  # a trunk MoE layer and the MTP layer
        p = f"model.layers.{layer}.mlp."
        for e in range(ds.n_routed_experts):
            assert t[f"{p}experts.{e}.gate_proj.weight"].shape == (ds.moe_intermediate_size, cfg["hidden_size"])
            assert t[f"{p}experts.{e}.down_proj.weight"].shape == (cfg["hidden_size"], ds.moe_intermediate_size)
        assert t[p + "gate.weight"].dtype == torch.float32
        assert t[p + "gate.e_score_correction_bias"].abs().max() > 0  # the balancing moved it
    assert not any("gate_up_proj" in k for k in t)
    assert f"model.layers.{n}.eh_proj.weight" in t and "model.layers.0.mlp.gate_proj.weight" in t  # layer 0: dense


def test_torch_runner_reads_it_as_transformers_does(trained):
    """One prefill through our DeepSeek model (paged latent cache) against transformers' forward: the logits."""
    from llmserve.kernels.attention import AttnMeta
    from llmserve.layers.kv_cache import kv_spec_for
    from llmserve.layers.model_config import ModelConfig
    from llmserve.models.deepseek import DeepseekModel

    out, _ = trained
    mc = ModelConfig.from_file(out / "config.json")
    model = DeepseekModel(mc, out, torch.device("cpu"), torch.float32, 512)
    T, bs = 40, 4
    ids = torch.randint(0, mc.vocab_size, (T,))
    spec = kv_spec_for("", torch.float32, mc.num_hidden_layers, 1, bs, mc.head_dim, mc.kv_latent_dim)
    blocks = torch.randperm(16)[: -(-T // bs)]
    slots = blocks.repeat_interleave(bs)[:T] * bs + torch.arange(T) % bs
    meta = AttnMeta(torch.tensor([0, T]), torch.tensor([T]), blocks[None], None, None, 0)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0]
        ours = model.logits(model.forward(ids, torch.arange(T), slots, meta, spec.allocate(16, "cpu")))
    assert (ours - ref).abs().max().item() <= 1e-4


def test_its_mtp_layer_serves_losslessly(trained):
    out, _ = trained
    prompts = [[5, 17, 99, 3, 250, 11, 42], list(range(40, 75)), [7] * 12]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    got = {}
    for method in ("none", "mtp"):
        llm = LLM(str(out), device="cpu", speculate_method=method)
        try:
            got[method] = [r.token_ids for r in llm.generate(prompts, params)]
            drafts = llm.engine.stats().spec_draft_tokens
        finally:
            llm.engine.shutdown()
    assert got["mtp"] == got["none"] and drafts > 0


def test_the_paddle_exporter_refuses_the_family(trained, tmp_path):
    from llmserve.runners.paddle.export import export_hf

    with pytest.raises(ValueError, match="deepseek_v3: the Paddle static-graph exporter does not express MLA"):
        export_hf(trained[0], tmp_path / "paddle")


def test_the_whole_stack_serves_it_with_mtp(trained, tmp_path):
    """Triton + the HTTP front end on the trained tiny DeepSeek with its MTP layer speculating: OpenAI, native HTTP
    and Triton gRPC give the offline engine's greedy completions (tests/test_speculative.py)."""
    from test_speculative import check_stack_serves_speculating

    out = str(trained[0])
    check_stack_serves_speculating(tmp_path, out, MODEL_DIR=out, LLMSERVE_DEVICE="cpu", SPECULATE_METHOD="mtp")
