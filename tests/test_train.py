"""`llmserve train`: the stdlib corpus, the tokenizer, the loop, the MTP module and the checkpoint.

A tiny preset trains for 30 steps on the first 30 stdlib files (about a second on one core), through
the CLI, in this process. The checkpoint must load in the torch runner and in transformers with the
same greedy tokens, export to a Paddle static graph with the torch runner's logits, and come out byte
for byte the same from a second run with the same seed. References: transformers' own forward for the
trunk, a one-layer transformers Llama fed by hand-written RMSNorm / projection for the MTP module,
tokenizers' own encode for the token streams, a meta-device model for the parameter counts.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from llmserve.cli import main  # noqa: E402
from llmserve.config import Config  # noqa: E402
from llmserve.engine.request import Request  # noqa: E402
from llmserve.engine.runner_contract import SeqChunk, StepBatch  # noqa: E402
from llmserve.engine.sampling_params import SamplingParams  # noqa: E402
from llmserve.train import corpus as corpus_mod  # noqa: E402
from llmserve.train.mtp import load_mtp  # noqa: E402
from llmserve.train.presets import PRESETS  # noqa: E402
from llmserve.train.tokenizer import build_tokenizer  # noqa: E402
from llmserve.train.trainer import lr_factor  # noqa: E402

PROMPT = "def fibonacci(n):\n    "


def _train(out, cache, *extra: str) -> dict:
    args = ["train", "--preset", "tiny", "--out", str(out), "--max-files", "30", "--cache-dir", str(cache)]
    assert main(args + ["--device", "cpu", *extra]) == 0
    return json.loads((out / "train_metrics.json").read_text())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model with an MTP module, its tokenizer trained on the corpus."""
    root = tmp_path_factory.mktemp("train")
    out = root / "model"
    metrics = _train(out, root / "cache", "--mtp")
    return out, root / "cache", metrics


def test_loss_falls_and_beats_random_init(trained, tmp_path):
    out, cache, metrics = trained
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [10, 20, 30] and metrics["steps"] == 30
    assert log[-1]["loss"] < log[0]["loss"] - 0.3, log
    assert log[-1]["mtp_loss"] < log[0]["mtp_loss"] - 0.3, log
    # the same shape, untrained (0 steps: evaluation only) is near-uniform over the vocabulary
    init = _train(tmp_path / "init", cache, "--mtp", "--max-steps", "0", "--tokenizer", str(out))
    assert init["steps"] == 0 and init["heldout_ppl"] > 0.8 * metrics["vocab_size"]
    assert metrics["heldout_ppl"] < 0.5 * init["heldout_ppl"]
    assert metrics["mtp_heldout_ppl"] < 0.7 * init["mtp_heldout_ppl"]
    assert metrics["heldout_windows"] >= 1 and metrics["heldout_tokens"] == 64 * metrics["heldout_windows"]
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (out / name).is_file(), name


def test_same_seed_same_bytes(trained, tmp_path):
    out, cache, _ = trained
    again = tmp_path / "again"
    _train(again, cache, "--mtp", "--tokenizer", str(out))
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    other = tmp_path / "other"
    _train(other, cache, "--mtp", "--tokenizer", str(out), "--seed", "1")
    assert (other / "model.safetensors").read_bytes() != (out / "model.safetensors").read_bytes()


def test_checkpoint_layout_is_deepseek_v3s(trained):
    out, _, metrics = trained
    cfg = json.loads((out / "config.json").read_text())
    L = cfg["num_hidden_layers"]
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["architectures"] == ["LlamaForCausalLM"]
    names = set(load_file(out / "model.safetensors"))
    mtp = {n for n in names if n.startswith(f"model.layers.{L}.")}
    own = {"enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens"}
    layer = {f"self_attn.{x}_proj" for x in "qkvo"} | {f"mlp.{x}_proj" for x in ("gate", "up", "down")}
    layer |= {"input_layernorm", "post_attention_layernorm"}
    assert mtp == {f"model.layers.{L}.{n}.weight" for n in own | layer}
    assert not any(n.startswith(f"model.layers.{L + 1}.") for n in names)
    assert metrics["params"] == PRESETS["tiny"].num_params(metrics["vocab_size"])
    assert metrics["mtp_params"] == PRESETS["tiny"].mtp_params()


def _runner(path):
    from llmserve.runners.torch.runner import TorchRunner

    return TorchRunner(str(path), Config(block_size=4, max_seq_len=256, batch_size=4, block_bs=4, device="cpu"))


def _prompt_ids(path) -> list[int]:
    return Tokenizer.from_file(str(path / "tokenizer.json")).encode(PROMPT).ids


def test_torch_runner_and_transformers_same_greedy_tokens(trained):
    out, _, _ = trained
    prompt, n = _prompt_ids(out), 16
    runner = _runner(out)  # the MTP layer's weights are in the file: the runner must skip them
    req = Request("g", prompt, SamplingParams(max_tokens=n, min_tokens=0, temperature=0.0))
    req.block_table = list(range(-(-(len(prompt) + n) // runner.block_size)))
    chunk = SeqChunk(req, 0, len(prompt), True)
    for _ in range(n):
        req.output_token_ids.append(runner.execute(StepBatch([chunk])).token_ids[0][0])
        req.num_computed_tokens += chunk.num_tokens
        chunk = SeqChunk(req, req.num_computed_tokens, 1, True)

    hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):  # greedy by hand: no generation-config eos or min-length rules in the way
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    assert req.output_token_ids == ids[len(prompt) :]


def test_exported_graph_matches_torch_runner(trained, tmp_path):
    from llmserve.runners.paddle.export import export_hf
    from llmserve.runners.paddle.runner import PaddleRunner

    out, _, _ = trained
    export_hf(out, tmp_path / "static")
    tokens = _prompt_ids(out) + [int(t) for t in np.random.default_rng(0).integers(4, 384, 12)]
    steps = [(0, 5), (5, len(tokens) - 5 - 12)] + [(p, 1) for p in range(len(tokens) - 12, len(tokens))]
    paddle_runner = PaddleRunner(str(tmp_path / "static"), Config(block_size=8, max_seq_len=128, block_bs=2), Greedy())
    torch_runner = _runner(out)
    rows = {}
    for name, run in (
        ("paddle", lambda c: paddle_runner.forward([c])[0][0]),
        ("torch", lambda c: torch_runner.forward_logits(StepBatch([c]))[0].numpy()),
    ):
        req = Request(name, tokens, SamplingParams())
        block_size = 8 if name == "paddle" else 4
        req.block_table = list(reversed(range(-(-len(tokens) // block_size))))  # not in order: paging is used
        rows[name] = np.stack([run(SeqChunk(req, start, n, True)) for start, n in steps])
    np.testing.assert_allclose(rows["paddle"], rows["torch"], rtol=1e-4, atol=1e-4)
    assert np.abs(rows["torch"]).max() > 1.0


class Greedy:
    def sample(self, logits, requests):
        return [int(i) for i in logits.argmax(-1)], None

    def drop(self, req_ids):
        pass


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_mtp_matches_a_one_layer_llama_reference(trained):
    out, _, _ = trained
    tensors = load_file(out / "model.safetensors")
    trunk = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa")
    cfg = trunk.config
    mtp = load_mtp(cfg, tensors).eval()
    ids = torch.tensor([_prompt_ids(out) + [5, 17, 40, 99, 7, 250]])
    L, eps, p = cfg.num_hidden_layers, cfg.rms_norm_eps, f"model.layers.{cfg.num_hidden_layers}."
    with torch.no_grad():
        h = trunk.model(input_ids=ids).last_hidden_state
        got = trunk.lm_head(mtp.hidden(trunk, h, ids))

        # reference: the MTP's layer + shared head as a 1-layer Llama (eager attention, its own causal
        # mask) whose input embeddings are eh_proj(cat(enorm(e), hnorm(h))) written out by hand
        e = trunk.model.embed_tokens(ids[:, 1:]).clone()
        e[:, 0] = 0
        x = torch.cat(
            [_rms(e, tensors[p + "enorm.weight"], eps), _rms(h[:, :-1], tensors[p + "hnorm.weight"], eps)], -1
        )
        x = x @ tensors[p + "eh_proj.weight"].T
        one = {**cfg.to_dict(), "num_hidden_layers": 1, "tie_word_embeddings": False, "attn_implementation": "eager"}
        ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**one)).eval()
        assert ref.config._attn_implementation == "eager"
        state = {k.replace(p, "model.layers.0."): v for k, v in tensors.items() if k.startswith(p)}
        state["model.norm.weight"] = state.pop("model.layers.0.shared_head.norm.weight")
        state["lm_head.weight"] = state.pop("model.layers.0.shared_head.head.weight")
        state["model.embed_tokens.weight"] = state.pop("model.layers.0.embed_tokens.weight")
        for k in ("enorm", "hnorm", "eh_proj"):
            state.pop(f"model.layers.0.{k}.weight")
        ref.load_state_dict(state, strict=True)
        want = ref(inputs_embeds=x).logits
    assert L == 2 and got.shape == want.shape == (1, ids.shape[1] - 1, cfg.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the shared head really is the trunk's (tied here: the embedding)
    torch.testing.assert_close(tensors[p + "shared_head.head.weight"], tensors["model.embed_tokens.weight"])


def test_corpus_filters_split_and_streams(tmp_path):
    root = tmp_path / "lib"
    for i in range(101):
        (root / "pkg").mkdir(parents=True, exist_ok=True)
        (root / "pkg" / f"m{i:03d}.py").write_text(f"def f{i}(x):\n    return x + {i}\n")
    skipped = {
        "site-packages/third.py": b"x = 1\n",
        "pydoc_data/topics.py": b"topics = {}\n",
        "encodings/cp0.py": b'""" Python Character Mapping Codec generated from X with gencodec.py.\n"""\n',
        "py2.py": b'print "hello"\n',
        "latin.py": b"s = '\xe9'\n",
    }
    for rel, data in skipped.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    c = corpus_mod.load_corpus(root)
    assert len(c.train) + len(c.heldout) == 101 and not set(c.train) & set(c.heldout)
    assert [p.name for p in c.heldout] == ["m000.py", "m050.py", "m100.py"]  # every 50th file, by index
    assert corpus_mod.load_corpus(root, max_files=10).heldout == c.heldout[:1]

    tok = build_tokenizer(c.texts("train"), 300)
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    streams, stats = corpus_mod.token_streams(tmp_path / "tok", tmp_path / "cache", root=root)
    want = [t for text in c.texts("heldout") for t in tok.encode(text).ids + [1]]
    assert streams["heldout"].tolist() == want and stats["heldout"]["tokens"] == len(want)
    assert stats["train"]["files"] == 98 and streams["train"].dtype == np.uint16
    again, _ = corpus_mod.token_streams(tmp_path / "tok", tmp_path / "cache", root=root)
    assert len(list((tmp_path / "cache").iterdir())) == 1 and again["train"].tolist() == streams["train"].tolist()


def test_tokenizer_is_deterministic_and_loads_everywhere(trained):
    out, _, _ = trained
    texts = list(corpus_mod.load_corpus(max_files=30).texts("train"))
    a, b = build_tokenizer(texts, 384), build_tokenizer(texts, 384)
    assert a.to_str() == b.to_str() == Tokenizer.from_file(str(out / "tokenizer.json")).to_str()
    assert [a.token_to_id(t) for t in ("<s>", "</s>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2, 3]
    from llmserve.engine.tokenizer import load_tokenizer

    hf = transformers.AutoTokenizer.from_pretrained(out)
    ours = load_tokenizer(str(out))
    assert hf(PROMPT)["input_ids"] == ours.encode(PROMPT) == a.encode(PROMPT).ids
    assert ours.decode(ours.encode(PROMPT)) == PROMPT and ours.eos_token_ids == {1, 3}


def test_lr_schedule():
    assert lr_factor(0, 100, 10, 0.1) == pytest.approx(0.1)
    assert lr_factor(9, 100, 10, 0.1) == pytest.approx(1.0)
    assert lr_factor(55, 100, 10, 0.1) == pytest.approx(0.55)  # cosine midpoint: halfway to 0.1
    assert lr_factor(100, 100, 10, 0.1) == pytest.approx(0.1)
    assert lr_factor(50, None, 10, 0.1) == 1.0  # steps not known yet (time budget): hold the peak


def test_time_budget_sets_the_step_count(trained, tmp_path, monkeypatch):
    """A preset with a time budget and no step count: the count is fixed from the measured step time. The trainer's
    clock is a fake one that ticks TICK s at each reading (about one per step), so the pace it measures, and the plan,
    do not depend on this machine's speed."""
    import dataclasses
    import itertools
    import types

    from llmserve.train import trainer

    out, cache, _ = trained
    TICK, BUDGET = 0.01, 0.5  # ~1-2 readings a step: a pace of 10-20 ms, so 20 + 0.95 * (0.5 - now) / pace steps
    ticks = itertools.count()
    monkeypatch.setattr(trainer, "time", types.SimpleNamespace(perf_counter=lambda: TICK * next(ticks)))
    monkeypatch.setitem(
        trainer.PRESETS,
        "tiny",
        dataclasses.replace(PRESETS["tiny"], max_steps=None, max_seconds=BUDGET, warmup_steps=20),
    )
    m = _train(tmp_path / "timed", cache, "--tokenizer", str(out))
    assert m["planned_steps"] > 20  # the pace was measured over the warm-up, and more steps fit in the budget
    assert m["steps"] == m["planned_steps"] or (m["stopped_by"] == "time" and m["steps"] > 0.9 * m["planned_steps"])
    assert m["train_seconds"] <= BUDGET + 5 * TICK  # on the trainer's clock: it kept to its budget
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "timed" / "train_log.jsonl").read_text().splitlines()]
    if m["stopped_by"] == "steps":  # the cosine ran to its end
        assert lrs[-1] == pytest.approx(PRESETS["tiny"].lr * lr_factor(m["steps"] - 1, m["steps"], 20, 0.1))


def test_presets_meet_their_budgets():
    """Parameter counts from a model built on the meta device; the issue's size rules."""
    counts = {}
    for name, p in PRESETS.items():
        from llmserve.train.checkpoint import causal_lm, model_config
        from llmserve.train.mtp import mtp_layer

        with torch.device("meta"):
            config = model_config(p, p.vocab_size, 0, (1, 3), mtp=True)
            model, mtp = causal_lm(config), mtp_layer(config)
        counts[name] = sum(t.numel() for t in model.parameters())
        assert counts[name] == p.num_params(), name
        assert sum(t.numel() for t in mtp.parameters()) == p.mtp_params(), name
    assert counts["demo-cpu"] * 4 < 10 * 2**20  # float32 safetensors under 10 MB
    demo = PRESETS["demo"]  # issue 45's demo: bf16 trunk + MTP module (no copies) + tokenizer <= 24 MB
    assert (counts["demo"] + demo.mtp_params()) * 2 + 600_000 <= 24e6 and demo.save_dtype == "bfloat16"
    assert 50e6 <= counts["target"] <= 150e6
    assert counts["draft"] * 8 <= counts["target"]
    assert math.isclose(PRESETS["target"].head_dim, 64)
    # the DeepSeek target: its active parameters (dense parts + 4 routed and 1 shared expert a token) near the
    # Llama target's, so that both train in the same budget
    ds = PRESETS["target-deepseek"]
    expert = 3 * ds.hidden_size * ds.deepseek.moe_intermediate_size
    idle = (ds.num_hidden_layers - 1) * (ds.deepseek.n_routed_experts - ds.deepseek.num_experts_per_tok) * expert
    assert 0.5 <= (counts["target-deepseek"] - idle) / counts["target"] <= 1.5


def test_held_out_checks_keep_the_best_weights_and_stop_early(trained, tmp_path):
    """A small corpus learnt by heart: the held-out checks keep the best weights seen, and a run whose
    checks stop improving stops early; what is written is what the checks chose."""
    out, cache, _ = trained
    args = ("--tokenizer", str(out), "--max-files", "8", "--max-steps", "240", "--eval-every", "10")
    m = _train(tmp_path / "long", cache, *args)
    checks = m["heldout_checks"]
    assert checks and all(step % 10 == 0 for step, _ in checks) and checks[-1][0] == m["steps"]
    best_step, best_ppl = min(checks, key=lambda c: c[1])
    if m["kept_step"] != m["steps"]:  # an earlier check won: its weights were written
        assert m["kept_step"] == best_step
    # 8 files (~20k tokens) overfit well within 240 steps: three checks in a row no better than the best
    assert m["stopped_by"] == "early" and m["steps"] < 240 and all(ppl >= best_ppl for _, ppl in checks[-3:])


@pytest.fixture(scope="module")
def attached(trained, tmp_path_factory):
    """A tiny trunk trained without MTP, then an MTP module trained alone on it (--init-from, frozen),
    with the optimizer's parameters recorded; and the same module at initialisation (0 steps)."""
    tok, cache, _ = trained
    root = tmp_path_factory.mktemp("attach")
    _train(root / "trunk", cache, "--tokenizer", str(tok))
    seen = []

    class Recording(torch.optim.AdamW):
        def __init__(self, groups, **kw):
            seen.extend((p, g["weight_decay"]) for g in groups for p in g["params"])
            super().__init__(groups, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.optim, "AdamW", Recording)
        metrics = _train(root / "mtp", cache, "--init-from", str(root / "trunk"), "--mtp")
    init = _train(root / "init", cache, "--init-from", str(root / "trunk"), "--mtp", "--max-steps", "0")
    return root, cache, metrics, init, seen


def test_init_from_trains_an_mtp_module_on_a_frozen_trunk(attached):
    root, _, metrics, init, seen = attached
    src, out = root / "trunk", root / "mtp"
    before, after = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(torch.equal(after[k], v) for k, v in before.items())  # the trunk, bit for bit
    cfg = json.loads((src / "config.json").read_text())
    assert json.loads((out / "config.json").read_text()) == {**cfg, "num_nextn_predict_layers": 1}
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name

    H, F, V, L, hd = 64, 128, cfg["vocab_size"], cfg["num_hidden_layers"], 16
    shapes = {"enorm": [H], "hnorm": [H], "eh_proj": [H, 2 * H], "shared_head.norm": [H]}
    shapes |= {"input_layernorm": [H], "post_attention_layernorm": [H], "embed_tokens": [V, H]}
    shapes |= {"self_attn.q_proj": [4 * hd, H], "self_attn.k_proj": [2 * hd, H], "self_attn.v_proj": [2 * hd, H]}
    shapes |= {"self_attn.o_proj": [H, 4 * hd], "mlp.gate_proj": [F, H], "mlp.up_proj": [F, H]}
    shapes |= {"mlp.down_proj": [H, F], "shared_head.head": [V, H]}
    mtp = {k: list(v.shape) for k, v in after.items() if k not in before}
    assert mtp == {f"model.layers.{L}.{n}.weight": s for n, s in shapes.items()}
    torch.testing.assert_close(after[f"model.layers.{L}.embed_tokens.weight"], before["model.embed_tokens.weight"])

    # only the MTP module's parameters reached the optimizer (none of the trunk's: no state, no decay)
    assert sum(p.numel() for p, _ in seen) == metrics["mtp_params"] == PRESETS["tiny"].mtp_params()
    assert all(p.requires_grad for p, _ in seen) and {wd for p, wd in seen if p.dim() < 2} == {0.0}

    # it learnt: held-out loss of the token after next well below the untrained module's
    assert init["mtp"]["steps"] == 0 and metrics["mtp"]["steps"] == 30 and metrics["mtp"]["frozen_trunk"]
    assert metrics["mtp_heldout_ppl"] < 0.7 * init["mtp_heldout_ppl"]
    assert metrics["mtp_top1"] > init["mtp_top1"] and metrics["mtp_top1"] == metrics["mtp"]["mtp_top1"]
    # the trunk's metrics are the source's, and measured again they come out the same
    trunk = json.loads((src / "train_metrics.json").read_text())
    assert {k: metrics[k] for k in trunk if k not in ("mtp", "mtp_params")} == {
        k: v for k, v in trunk.items() if k not in ("mtp", "mtp_params")
    }
    assert metrics["mtp"]["trunk_heldout_ppl"] == pytest.approx(trunk["heldout_ppl"], rel=1e-9)
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert log[:3] == [json.loads(line) for line in (src / "train_log.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("phase")) for r in log[3:]] == [(10, "mtp"), (20, "mtp"), (30, "mtp")]
    assert log[-1]["mtp_loss"] < log[3]["mtp_loss"], log


def test_init_from_again_gives_the_same_bytes(attached, tmp_path):
    """From the attached checkpoint itself: its MTP module is replaced by a new one, trained with the same
    seed on the same frozen trunk: the same file, and the log holds the MTP run once."""
    root, cache, _, _, _ = attached
    _train(tmp_path / "again", cache, "--init-from", str(root / "mtp"), "--mtp")
    for name in ("model.safetensors", "config.json", "tokenizer_config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (root / "mtp" / name).read_bytes(), name

    def phases(d):
        return [(r["step"], r.get("phase")) for r in map(json.loads, (d / "train_log.jsonl").read_text().splitlines())]

    want = [(10, None), (20, None), (30, None), (10, "mtp"), (20, "mtp"), (30, "mtp")]
    assert phases(tmp_path / "again") == phases(root / "mtp") == want


def test_init_from_refusals(attached, tmp_path, capsys):
    root, cache, _, _, _ = attached
    trunk = str(root / "trunk")
    cases = [
        ((trunk,), "--mtp"),  # no --mtp
        ((trunk, "--mtp", "--preset", "demo-cpu"), "hidden_size 64 (preset: 128)"),  # another shape
        ((trunk, "--mtp", "--tokenizer", trunk), "--tokenizer"),
        ((str(tmp_path / "none"), "--mtp"), "config.json"),
    ]
    for args, words in cases:
        capsys.readouterr()
        out = tmp_path / "out"
        argv = ["train", "--preset", "tiny", "--out", str(out), "--cache-dir", str(cache), "--init-from", *args]
        assert main(argv) == 2, args
        err = capsys.readouterr().err
        assert "--init-from" in err and words in err, err
        assert not out.exists()  # refused before anything was written
    assert main(["train", "--preset", "tiny", "--out", trunk, "--init-from", trunk, "--mtp"]) == 2
    assert "--out" in capsys.readouterr().err


def test_chat_exchanges_are_the_served_template(tmp_path):
    """chat_every: every Nth training file is a ChatML exchange, rendered as the demo's chat template
    renders a user request and its answer; the held-out stream is the plain one."""
    from llmserve.engine.tokenizer import load_tokenizer
    from llmserve.models.demo import DEMO_HF_DIR

    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    for i in range(60):
        doc = f'"""Add {i} to x.\n\nMore words."""\n' if i % 3 else ""
        (root / "pkg" / f"m{i:03d}.py").write_text(f"{doc}def f{i}(x):\n    return x + {i}\n")
    c = corpus_mod.load_corpus(root)
    rel, text = c.train[0], next(c.texts("train"))
    served = load_tokenizer(str(DEMO_HF_DIR))
    messages = [{"role": "user", "content": "Add 1 to x."}, {"role": "assistant", "content": text}]
    assert corpus_mod.chat_exchange(rel, text) + "\n" == served.apply_chat_template(messages, False)
    assert corpus_mod.chat_exchange(c.train[2], "x = 1\n").startswith("<|im_start|>user\nWrite m003.py.<|im_end|>")

    tok = build_tokenizer(c.texts("train"), 300)
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    plain, _ = corpus_mod.token_streams(tmp_path / "tok", tmp_path / "cache", root=root)
    chat, stats = corpus_mod.token_streams(tmp_path / "tok", tmp_path / "cache", root=root, chat_every=4)
    assert len(list((tmp_path / "cache").iterdir())) == 2 and stats["chat_every"] == 4
    assert chat["heldout"].tolist() == plain["heldout"].tolist()
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    wrapped = len(range(0, len(c.train), 4))
    assert (chat["train"] == im_start).sum() == 2 * wrapped and (chat["train"] == im_end).sum() == 2 * wrapped
    assert (plain["train"] == im_start).sum() == 0
    first = tok.decode(chat["train"][: list(chat["train"]).index(1)].tolist(), skip_special_tokens=False)
    assert first == corpus_mod.chat_exchange(rel, text)


def test_bfloat16_checkpoint_and_attached_mtp(trained, tmp_path, monkeypatch):
    """save_dtype bfloat16: every tensor is written as bf16, the metrics are those of the rounded weights,
    --init-from keeps the bf16 trunk bit for bit and writes its MTP module in bf16 too, and the Paddle
    export serves it."""
    import dataclasses

    from llmserve.train.evaluate import evaluate

    tok, cache, _ = trained
    monkeypatch.setitem(PRESETS, "tiny", dataclasses.replace(PRESETS["tiny"], save_dtype="bfloat16"))
    m = _train(tmp_path / "trunk", cache, "--tokenizer", str(tok), "--max-steps", "10")
    trunk = load_file(tmp_path / "trunk" / "model.safetensors")
    assert {v.dtype for v in trunk.values()} == {torch.bfloat16} and m["save_dtype"] == "bfloat16"
    cfg = json.loads((tmp_path / "trunk" / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16"
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "trunk", dtype=torch.float32)
    streams, _ = corpus_mod.token_streams(tmp_path / "trunk", cache, 30)
    p = PRESETS["tiny"]
    ev = evaluate(model, None, streams["heldout"], p.seq_len, p.eval_windows, p.batch_size // 2, False)
    assert math.isclose(ev["heldout_ppl"], m["heldout_ppl"], rel_tol=1e-4)

    _train(tmp_path / "mtp", cache, "--init-from", str(tmp_path / "trunk"), "--mtp", "--max-steps", "3")
    after = load_file(tmp_path / "mtp" / "model.safetensors")
    assert all(torch.equal(after[k], v) for k, v in trunk.items())
    assert {v.dtype for v in after.values()} == {torch.bfloat16} and len(after) > len(trunk)
    # the exporter widens bf16: the Paddle graph computes transformers' float32 logits of the bf16 weights
    from llmserve.runners.paddle.export import export_hf
    from llmserve.runners.paddle.runner import PaddleRunner

    export_hf(tmp_path / "mtp", tmp_path / "static")
    tokens = _prompt_ids(tmp_path / "mtp")
    runner = PaddleRunner(str(tmp_path / "static"), Config(block_size=8, max_seq_len=128, block_bs=2), Greedy())
    req = Request("p", tokens, SamplingParams())
    req.block_table = list(range(-(-len(tokens) // 8)))
    got = runner.forward([SeqChunk(req, 0, len(tokens), True)])[0][0]
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0, -1].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
