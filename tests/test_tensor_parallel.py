"""Tensor parallelism on CPU (gloo): MP_NUM ranks give MP_NUM=1's tokens; rendezvous errors; cycles.

Every test runs real ranks: rank 0 in this process (the offline LLM engine) and workers as separate
processes joined by torch.distributed over gloo, on loopback ports picked here. Models are random
tiny Llama (8 heads, 2 KV heads: split at MP_NUM=2, replicated at 4) and Qwen2 (biases, tied
embeddings, 4 heads, 2 KV heads) checkpoints with a trained tokenizer, in fp32, so MP_NUM ranks
compute the same function as one rank up to summation order, and greedy tokens must agree.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time

import pytest

from tests.conftest import new_seed

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from llmserve.config import Config, ConfigError  # noqa: E402
from llmserve.engine.sampling_params import SamplingParams  # noqa: E402
from llmserve.offline import LLM  # noqa: E402
from llmserve.runners.rank_layout import RendezvousError  # noqa: E402
from llmserve.serving.testing import free_ports, process_tree  # noqa: E402


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, request):
    from llmserve.models.demo_tokenizer import train_demo_tokenizer
    from llmserve.models.random_model import SHAPES, write_random_checkpoint

    path = tmp_path_factory.mktemp("tp-llama")
    write_random_checkpoint(path, "tiny", seed=new_seed(request), device="cpu", dtype=torch.float32, max_positions=512)
    train_demo_tokenizer(path, vocab_size=SHAPES["tiny"]["vocab_size"])
    return path


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory, llama_dir, request):
    from tests.test_torch_runner import tiny_checkpoint

    path = tmp_path_factory.mktemp("tp-qwen2")
    tiny_checkpoint(path, "qwen2", seed=new_seed(request))  # vocabulary 256, tied, q/k/v biases
    for f in llama_dir.glob("tokenizer*"):
        (path / f.name).write_bytes(f.read_bytes())
    return path


def config(model_dir, mp: int, **kw) -> Config:
    base = Config.from_env(env={})
    (port,) = free_ports(1)
    kw = dict(model_dir=str(model_dir), runner="torch", device="cpu", mp_num=mp, dist_port=port, dist_timeout=60.0) | kw
    return dataclasses.replace(base, **kw)


def generate(model_dir, mp: int, prompts, params, **kw):
    llm = LLM(config=config(model_dir, mp, **kw))
    try:
        return llm.generate(prompts, params)
    finally:
        llm.engine.shutdown()


def prompts_for(vocab: int, n: int = 6, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (70,), generator=g).tolist()  # a shared prefix: prefix-cache hits
    out = []
    for i in range(n):
        tail = torch.randint(3, vocab, (5 + 13 * i,), generator=g).tolist()
        out.append(shared + tail if i % 2 else tail)
    return out


# 20: the longest prompt (140 tokens) and its output fit the 160 tokens of the tight case below (the engine refuses,
# never shortens, a request that cannot fit).
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    "arch,mps,extra",
    [
        ("llama", (2, 4), {}),
        ("qwen2", (2, 4), {}),
        # Chunked prefill over small steps, and a KV cache so small that requests are preempted.
        ("llama", (2,), {"max_num_batched_tokens": 48, "block_size": 16, "block_bs": 1, "max_seq_len": 160}),
        ("llama", (2,), {"speculate_method": "ngram"}),
    ],
)
def test_greedy_tokens_match_one_rank(arch, mps, extra, llama_dir, qwen2_dir, fresh_seed):
    d = llama_dir if arch == "llama" else qwen2_dir
    vocab = 512 if arch == "llama" else 256
    prompts = prompts_for(vocab, seed=fresh_seed)
    if extra.get("speculate_method"):  # repetitive prompts: n-gram proposals get accepted
        prompts = [(p[:12] * 6)[:60] for p in prompts]
    want = [r.token_ids for r in generate(d, 1, prompts, GREEDY, **extra)]
    for mp in mps:
        got = [r.token_ids for r in generate(d, mp, prompts, GREEDY, **extra)]
        assert got == want, f"MP_NUM={mp} {extra}"


@pytest.fixture(scope="module", params=["v3", "v2"])
def deepseek_dir(tmp_path_factory, llama_dir, request):
    from llmserve.models.random_model import write_random_deepseek

    path = tmp_path_factory.mktemp(f"tp-deepseek-{request.param}")
    write_random_deepseek(path, request.param, seed=new_seed(request))  # vocabulary 256, MLA + experts
    for f in llama_dir.glob("tokenizer*"):
        (path / f.name).write_bytes(f.read_bytes())
    return path


def test_deepseek_greedy_tokens_match_one_rank(deepseek_dir, fresh_seed):
    """MLA's heads and every expert's intermediate features split over the ranks (models/deepseek.py), with a
    prefix-cache hit and chunked prefill."""
    prompts = prompts_for(256, seed=fresh_seed)
    extra = {"max_num_batched_tokens": 48}
    want = [r.token_ids for r in generate(deepseek_dir, 1, prompts, GREEDY, **extra)]
    for mp in (2, 4):
        got = [r.token_ids for r in generate(deepseek_dir, mp, prompts, GREEDY, **extra)]
        assert got == want, f"MP_NUM={mp}"


def rank_quantized_copy(src, dst, quantize, dequantize, ranks: int):
    """A copy of checkpoint `src` whose projections hold their quantized-then-dequantized weights as MP_NUM=`ranks`
    quantizes them at load: per output channel over each rank's inputs, so the row-parallel o_proj and down_proj
    get a scale per rank's slice of their inputs (layers/quant/methods.py), the others one per whole row."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    for f in src.glob("*.safetensors"):
        out = {}
        for k, v in load_file(str(f)).items():
            if k.endswith("_proj.weight"):
                row_parallel = k.endswith(("o_proj.weight", "down_proj.weight"))
                parts = v.float().chunk(ranks if row_parallel else 1, dim=1)
                v = torch.cat([dequantize(*quantize(x)) for x in parts], dim=1).to(v.dtype)
            out[k] = v
        save_file(out, str(dst / f.name), metadata={"format": "pt"})
    return dst


def test_quantized_layers_shard(llama_dir, tmp_path):
    """QUANT_TYPE=weight_only_int8 and fp8 at MP_NUM=2: each rank quantizes its own shard (row-parallel layers get
    their own per-channel scales over their half of the inputs), so the sharded quantized model computes what one
    rank computes on the weights quantized that way (up to fp32 summation order, as the dense check), and not what
    one rank computes on the whole rows' quantization. (Their errors against the dense model are two draws of the
    same size: a ratio between them is no test.)"""
    from llmserve.layers.quant import formats

    p = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    (prompt,) = prompts_for(512, 1, seed=3)

    def logprobs(model_dir, mp, quant=""):
        (r,) = generate(model_dir, mp, [prompt], p, quant_type=quant)
        return torch.tensor([lp.logprob for lp in r.prompt_logprobs[1:]])

    dense = logprobs(llama_dir, 1)
    assert torch.allclose(logprobs(llama_dir, 2), dense, atol=1e-4)  # dense MP_NUM=2: the same function
    for quant, q, dq in (
        ("weight_only_int8", formats.quantize_w8, formats.dequantize_w8),
        ("fp8", formats.quantize_fp8_channel, formats.dequantize_fp8),
    ):
        sharded = logprobs(llama_dir, 2, quant)
        for ranks in (1, 2):
            sim = logprobs(rank_quantized_copy(llama_dir, tmp_path / f"{quant}-{ranks}", q, dq, ranks), 1)
            if ranks == 1:
                assert torch.allclose(logprobs(llama_dir, 1, quant), sim, atol=1e-4), quant  # the simulation is right
                assert (sharded - sim).abs().max() > 1e-3, quant  # whole-row scales: another function
            else:
                assert torch.allclose(sharded, sim, atol=1e-4), (quant, (sharded - sim).abs().max().item())


@pytest.mark.parametrize("fmt", ["gptq", "gptq-v2", "awq", "fp8-channel"])
def test_quantized_checkpoints_shard(fmt, llama_dir, tmp_path):
    """Each rank reads only its part of a GPTQ / AWQ / FP8 checkpoint's packed tensors: the same
    function as one rank reading them whole (groups of 32: the o projection's 64 inputs a rank)."""
    from tests import quant_checkpoints as qc

    dst = tmp_path / fmt
    if fmt.startswith("gptq"):
        qc.write_gptq(llama_dir, dst, group_size=32, v2=fmt == "gptq-v2")
    elif fmt == "awq":
        qc.write_awq(llama_dir, dst, group_size=32)
    else:
        qc.write_fp8_channel(llama_dir, dst)
    p = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    (prompt,) = prompts_for(512, 1, seed=4)
    one, two = ([lp.logprob for lp in generate(dst, mp, [prompt], p)[0].prompt_logprobs[1:]] for mp in (1, 2))
    assert torch.allclose(torch.tensor(two), torch.tensor(one), atol=1e-4)


def test_act_order_and_blocks_that_straddle_ranks_are_refused(llama_dir, tmp_path):
    from tests import quant_checkpoints as qc

    qc.write_gptq(llama_dir, tmp_path / "act", group_size=32, desc_act=True)
    with pytest.raises(ConfigError, match="desc_act"):
        LLM(config=config(tmp_path / "act", 2))
    qc.write_fp8_block(llama_dir, tmp_path / "block")  # 128 x 128 blocks: a rank holds 64 rows of q
    with pytest.raises(ConfigError, match=r"weight_scale_inv cannot be split at 0..64: its fp8_block blocks hold 128"):
        LLM(config=config(tmp_path / "block", 2))


def test_int4_groups_that_straddle_ranks_are_refused(llama_dir):
    """The tiny model's o projection has 128 inputs: 64 a rank at MP_NUM=2, less than one group of 128."""
    with pytest.raises(ConfigError, match=r"o_proj.weight has 64 inputs on each rank \(MP_NUM\)"):
        LLM(config=config(llama_dir, 2, quant_type="weight_only_int4"))


def test_seeded_sampling_is_the_same_on_every_rank(llama_dir):
    """Every rank samples for itself from the same logits and seeds: rank 0's tokens are every rank's
    (a divergence would desynchronize the next steps' inputs and break the greedy check after it)."""
    prompts = prompts_for(512, 4, seed=5)
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=100 + i) for i in range(4)]
    params += [GREEDY]
    a = [r.token_ids for r in generate(llama_dir, 2, prompts + prompts[:1], params)]
    b = [r.token_ids for r in generate(llama_dir, 2, prompts + prompts[:1], params)]
    assert a == b
    assert a[-1] == generate(llama_dir, 1, prompts[:1], GREEDY)[0].token_ids


def test_model_that_cannot_be_split_is_refused(llama_dir):
    with pytest.raises(ConfigError, match=r"MP_NUM=3: .*num_attention_heads=8"):
        LLM(config=config(llama_dir, 3))


def test_a_node_that_never_arrives_names_itself_and_the_port(llama_dir):
    cfg = config(llama_dir, 2, mp_nnode=2, pod_ips="127.0.0.1,127.0.0.2", node_rank=0, dist_timeout=3.0)
    t0 = time.monotonic()
    with pytest.raises(RendezvousError) as e:
        LLM(config=cfg)
    msg = str(e.value)
    assert f"127.0.0.1:{cfg.dist_port}" in msg and "rank 1 (node 1, 127.0.0.2)" in msg and "never arrived" in msg
    assert time.monotonic() - t0 < 30


def test_start_stop_cycles_leave_nothing(llama_dir):
    import gc
    import os

    before = set(process_tree(os.getpid()))
    prompt = prompts_for(512, 1)
    want = None
    for _ in range(4):  # a leak would show from the second (each cycle checks processes and the port)
        cfg = config(llama_dir, 2)
        llm = LLM(config=cfg)
        got = llm.generate(prompt, GREEDY)[0].token_ids
        llm.engine.shutdown()
        del llm
        gc.collect()
        want = want or got
        assert got == want
        assert set(process_tree(os.getpid())) == before  # the worker is gone
        from llmserve.serving.testing import port_is_free

        assert port_is_free(cfg.dist_port)
    assert not math.isnan(len(want))


def test_structured_output_reaches_every_rank(llama_dir):
    """The grammar's bitmask travels in the step message: every rank samples the same masked tokens
    (a rank sampling unmasked would feed the others a different token and the outputs would part)."""
    from llmserve.protocol.structured import grammar_for

    g = grammar_for({"guided_regex": r"[a-z]{3,12}-[0-9]{2}"})
    p = [SamplingParams(max_tokens=20, temperature=1.0, seed=s, grammar=g) for s in range(4)]
    prompts = prompts_for(512, 4, seed=9)
    one = [r.text for r in generate(llama_dir, 1, prompts, p)]
    two = [r.text for r in generate(llama_dir, 2, prompts, p)]
    assert all(re.fullmatch(r"[a-z]{3,12}-[0-9]{2}", t) for t in two), two
    assert two == one


def test_step_message_takes_a_request_that_left_and_came_back_in_one_step():
    """A req_id that leaves and returns in the same step (a preemption, or the offline LLM numbering
    each call from 0) is a new request on the workers, with its own prompt and no old outputs."""
    from llmserve.engine.request import Request
    from llmserve.engine.runner_contract import SeqChunk, StepBatch
    from llmserve.executor.step_message import StepDecoder, StepEncoder

    enc, dec = StepEncoder(), StepDecoder()
    old = Request("r", [1, 2, 3], SamplingParams())
    old.block_table = [4]
    dec.decode(enc.encode(StepBatch([SeqChunk(old, 0, 3, True)])))
    old.output_token_ids.append(9)
    dec.decode(enc.encode(StepBatch([SeqChunk(old, 3, 1, True)])))
    new = Request("r", [7, 8], SamplingParams(temperature=0.5))
    new.block_table = [2]
    got = dec.decode(enc.encode(StepBatch([SeqChunk(new, 0, 2, True)], finished_req_ids=["r"])))
    mirror = got.chunks[0].request
    assert mirror.prompt_token_ids == [7, 8] and mirror.output_token_ids == [] and mirror.block_table == [2]
    assert mirror.params.temperature == 0.5 and got.finished_req_ids == ["r"]
