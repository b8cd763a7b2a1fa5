"""SPECULATE_METHOD=mtp on DeepSeek-V2/V3: the checkpoint's own MTP layer (`model.layers.{N}.`) as the head.

Tiny random checkpoints (models/random_model.py `write_random_deepseek`, CPU fp32). The reference is built
independently of our code: transformers' DeepSeek decoder layer (`DeepseekV3DecoderLayer` /
`DeepseekV2DecoderLayer`, loaded by `from_pretrained` as layer N of an N + 1 layer model, so transformers'
own loader reads the MTP layer's tensors), the trunk's hidden states from transformers' model, and the
module's enorm / hnorm / eh_proj / shared_head written out here from the checkpoint's tensors.

- The module's logits over a sequence (expanded and absorbed MLA) equal the reference's within 1e-4: V3
  (MoE MTP layer), V2 (MoE), V2 with a dense MTP layer (`first_k_dense_replace` past it), V3 with its own
  `shared_head.head` (and an `embed_tokens` copy equal to the trunk's, which is shared, not loaded twice).
- Every proposal an engine run makes (first from the kept output, the rest from the chain) is the
  reference's argmax.
- Lossless: greedy output with k = 1, 3 is the output without speculation (prefix-cache hits included), and
  seeded sampled requests draw the very tokens they draw without it. Acceptance on random weights is low
  (printed, not asserted).
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_spec_draft import _one_thread  # noqa: F401 - autouse: one torch thread for this module
from test_spec_mtp import make_engine, record_proposals
from test_speculative import run

from llmserve.config import Config
from llmserve.engine.sampling_params import SamplingParams
from llmserve.kernels.attention import AttnMeta
from llmserve.layers.model_config import ModelConfig
from llmserve.layers.moe import MLP, MoE
from llmserve.models.deepseek import DeepseekModel
from llmserve.models.random_model import write_random_deepseek
from llmserve.runners.torch.inputs import StepInputs
from tests.test_torch_runner import make_runner

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="fp32 parity on the CPU (the GPU computes in bf16)")

VARIANTS = {  # name: (version, overrides, the MTP layer's MLP class)
    "v3": ("v3", {}, MoE),
    "v2": ("v2", dict(num_nextn_predict_layers=1), MoE),
    "v2-dense-mtp": ("v2", dict(num_nextn_predict_layers=1, first_k_dense_replace=3), MLP),
    "v3-own-head": ("v3", {}, MoE),
}


def add_own_head(path, seed: int) -> None:
    """The MTP layer's copies: `embed_tokens` equal to the trunk's, `shared_head.head` a different one."""
    cfg = json.loads((path / "config.json").read_text())
    p = f"model.layers.{cfg['num_hidden_layers']}."
    embed = load_file(path / "embed.safetensors")["model.embed_tokens.weight"]
    head = torch.randn(cfg["vocab_size"], cfg["hidden_size"], generator=torch.Generator().manual_seed(seed)) * 0.125
    tensors = {p + "embed_tokens.weight": embed.clone(), p + "shared_head.head.weight": head}
    save_file(tensors, str(path / "mtp-copies.safetensors"), metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(tensors, "mtp-copies.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    version, overrides, _ = VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    seed = random.randrange(1 << 20)
    write_random_deepseek(path, version, seed=seed, **overrides)
    if request.param == "v3-own-head":
        add_own_head(path, seed)
    return request.param, path, seed


class Reference:
    """The MTP module of a checkpoint, dense, from transformers' layer and the checkpoint's tensors."""

    def __init__(self, path) -> None:
        cfg = json.loads((path / "config.json").read_text())
        n, self.eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
        v3 = cfg["model_type"] == "deepseek_v3"
        cls = transformers.DeepseekV3ForCausalLM if v3 else transformers.DeepseekV2ForCausalLM
        self.trunk = cls.from_pretrained(path, dtype=torch.float32).eval()
        # layer N of an (N + 1)-layer model: transformers' loader reads the MTP layer's decoder tensors
        ext = cls.from_pretrained(path, dtype=torch.float32, num_hidden_layers=n + 1, attn_implementation="eager")
        self.layer, self.rotary = ext.eval().model.layers[n], ext.model.rotary_emb
        p = f"model.layers.{n}."
        t = {k[len(p) :]: v.float() for f in path.glob("*.safetensors") for k, v in load_file(f).items() if p in k}
        self.t = t
        self.embed = t.get("embed_tokens.weight", self.trunk.model.embed_tokens.weight)
        self.head = t.get("shared_head.head.weight", self.trunk.lm_head.weight)

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    @torch.no_grad()
    def hidden(self, ids: list[int]) -> torch.Tensor:
        """The trunk's last hidden states (after its final norm), [T, hidden]."""
        return self.trunk.model(torch.tensor([ids])).last_hidden_state[0]

    @torch.no_grad()
    def y(self, h: torch.Tensor, ids: list[int]) -> torch.Tensor:
        """The module's outputs (after shared_head.norm) at positions 0..n-1 from hidden rows h [n, hidden]
        and tokens ids [n + 1]: row i from h[i] and ids[i + 1], the embedding zeroed at position 0."""
        n, t = h.shape[0], self.t
        e = F.embedding(torch.tensor(ids[1 : n + 1]), self.embed)
        e[0] = 0
        x = torch.cat([self.norm(e, t["enorm.weight"]), self.norm(h, t["hnorm.weight"])], -1) @ t["eh_proj.weight"].T
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = self.layer(x[None], attention_mask=mask, position_ids=pos, position_embeddings=self.rotary(x[None], pos))
        out = out[0] if isinstance(out, tuple) else out
        return self.norm(out[0], t["shared_head.norm.weight"])

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        return y @ self.head.T


@pytest.fixture(scope="module")
def reference(checkpoint):
    return Reference(checkpoint[1])


# ---------------------------------------------------------------- the module against the reference


def test_mtp_logits_match_the_reference(checkpoint, reference):
    """The head's forward after a prefill over shuffled paged blocks, expanded and absorbed: max |diff| <= 1e-4."""
    name, path, seed = checkpoint
    runner = make_runner(path, block_bs=4, speculate_method="mtp", speculate_max_draft_tokens=2)
    model, proposer = runner.model, runner.head
    head, n = proposer.head, model.cfg.num_hidden_layers
    assert isinstance(head.w.layer.mlp, VARIANTS[name][2])
    assert runner.kv_cache.data.shape[0] == n + 1  # the head's latent layer, after the trunk's
    assert head.w.embed is model.embed  # no copy, or an equal one: the trunk's
    assert (head.w.lm_head is model.lm_head) == (name != "v3-own-head")
    T, bs = 37, runner.block_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.cfg.vocab_size, (T,), generator=g)
    blocks = torch.randperm(runner.num_kv_blocks, generator=g)[: -(-T // bs)]
    slots = blocks.repeat_interleave(bs)[:T] * bs + torch.arange(T) % bs
    meta = AttnMeta(torch.tensor([0, T]), torch.tensor([T]), blocks[None], None, None, 0)
    x = StepInputs(ids, torch.arange(T), slots, meta, torch.tensor([T - 1]))
    ref = reference.logits(reference.y(reference.hidden(ids.tolist())[:-1], ids.tolist()))
    nxt = torch.cat([ids[1:], ids[:1]])
    with torch.inference_mode():
        for absorb_max_q in (0, T):  # every chunk expanded / absorbed
            for lw in [*model.layers, head.w.layer]:
                lw.attn.absorb_max_q = absorb_max_q
            hidden = model.forward(ids, x.positions, slots, meta, runner.kv_cache)
            y = head.forward(nxt, hidden, x, proposer.kv_layer(runner.kv_cache, model))
            err = (head.logits(y)[: T - 1] - ref).abs().max().item()
            assert err <= 1e-4, (name, seed, absorb_max_q, err)
    assert ref.abs().max() > 0.5  # logits of some size: the bound means something


@pytest.mark.parametrize("checkpoint", ["v3", "v2"], indirect=True)
def test_proposals_are_the_modules_argmax(checkpoint, reference):
    """Every proposal of an engine run (k = 3, chunked prefill, decodes) is the reference's argmax, the
    reference's chain fed its own outputs and our drafts."""
    name, path, seed = checkpoint
    engine = make_engine(str(path), 3, tokenizer=False, enable_prefix_caching=False, max_seq_len=256)
    proposals = record_proposals(engine)
    rng = np.random.default_rng(seed)
    p = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    run(engine, [(f"r{i}", rng.integers(0, 256, int(rng.integers(1, 30))).tolist(), p) for i in range(5)])
    captured = list(proposals.items())
    assert len(captured) > 10
    checked = 0
    for tokens, drafts in captured[:: max(1, len(captured) // 16)]:
        h, fed = reference.hidden(list(tokens))[:-1], list(tokens)
        for j, d in enumerate(drafts):
            y = reference.y(h, fed)[-1]
            logits = reference.logits(y)
            assert logits[d] >= logits.max() - 1e-3, f"seed {seed}: draft {j} of {tokens}: {drafts}"
            h, fed = torch.cat([h, y[None]]), fed + [d]
            checked += 1
    assert checked >= 16


# ---------------------------------------------------------------- lossless through the engine


def workload(seed: int, temperature: float = 0.0) -> list:
    """Prompts sharing a 20-token prefix (prefix-cache hits for those arriving after the first), one of
    them repetitive, and a few unrelated ones."""
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(20)]
    prompts = [prefix + [rng.randrange(256) for _ in range(rng.randint(1, 9))] for _ in range(4)]
    prompts += [prefix + [5, 6, 7, 8] * 3, [rng.randrange(256) for _ in range(7)], [3]]
    reqs = []
    for i, ids in enumerate(prompts):
        p = SamplingParams(max_tokens=rng.randint(8, 20), temperature=temperature, ignore_eos=True)
        if temperature:
            p = SamplingParams(max_tokens=p.max_tokens, temperature=temperature, top_p=0.9, top_k=50, seed=seed + i)
        reqs.append((f"r{i}", ids, p))
    return reqs


@pytest.mark.parametrize("checkpoint", ["v3", "v2"], indirect=True)
def test_greedy_output_with_mtp_is_the_output_without_it(checkpoint):
    name, path, seed = checkpoint
    reqs = workload(seed)
    plain = run(make_engine(str(path), tokenizer=False, max_seq_len=256), reqs)
    for k in (1, 3):
        engine = make_engine(str(path), k, tokenizer=False, max_seq_len=256)
        assert run(engine, reqs) == plain, f"seed {seed} k={k}"
        st = engine.stats()
        assert st.spec_draft_tokens > 0 and st.prefix_cache_hits > 0, f"seed {seed} k={k}: {st}"
        print(f"{name} k={k}: accepted {st.spec_accepted_tokens} of {st.spec_draft_tokens} proposals")
        engine.step()  # the engine hands the requests that left to the proposer with its next step
        assert not engine.proposer.head.rows, "MTP state left behind"


@pytest.mark.parametrize("checkpoint", ["v3"], indirect=True)
def test_seeded_sampled_requests_draw_the_tokens_they_draw_without_mtp(checkpoint):
    name, path, seed = checkpoint
    reqs = workload(seed, temperature=0.8)
    plain = run(make_engine(str(path), tokenizer=False, max_seq_len=256), reqs)
    engine = make_engine(str(path), 3, tokenizer=False, max_seq_len=256)
    assert run(engine, reqs) == plain, f"seed {seed}"
    assert engine.stats().spec_draft_tokens > 0


# ---------------------------------------------------------------- settings


def test_mtp_and_cuda_graphs_are_served_or_run_eagerly_with_a_reason(tmp_path):
    """Neither setting is refused; where a torch path would wait on the host inside a graph, the model names it
    (graph_blocker) and the runner runs its steps eagerly."""
    path = write_random_deepseek(tmp_path, "v3")
    mc = ModelConfig.from_file(path / "config.json")
    for device in ("cpu", "cuda"):
        DeepseekModel.check_settings(mc, Config(speculate_method="mtp", cuda_graphs=True), torch.device(device))
    runner = make_runner(path, block_bs=4)
    model, kv = runner.model, runner.kv_cache
    assert model.graph_blocker(kv, 8) is None
    assert "9 queries" in model.graph_blocker(kv, 9)
    moe = next(lw.mlp for lw in model.layers if isinstance(lw.mlp, MoE))
    moe.stacked = None
    assert "expert by expert" in model.graph_blocker(kv, 2)
