"""Quantized models on the torch runner: checkpoints as GPTQ, AWQ and FP8 tools write them, and
online quantization (QUANT_TYPE), against HF transformers running the dequantized weights.

Each test quantizes a fresh random tiny Llama/Qwen2 (tests/quant_checkpoints.py writes the tensor
layouts and `quantization_config` the real tools write), loads it with TorchRunner and compares its
logits with HF's forward over a dense checkpoint holding the same weights dequantized: on the CPU
both compute in fp32, so they agree to float rounding (the formats' own error is another test's).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from llmserve.config import Config, ConfigError
from llmserve.engine.request import Request
from llmserve.engine.sampling_params import SamplingParams
from llmserve.layers.quant import formats
from tests import quant_checkpoints as qc
from tests.test_torch_runner import Driver, make_runner

transformers = pytest.importorskip("transformers")
CPU = not torch.cuda.is_available()


def tiny(path, seed: int, arch: str = "llama") -> None:
    """Dimensions that are multiples of 128 where group-wise formats need it (K of every projection)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, rms_norm_eps=1e-5,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True))
    model.save_pretrained(path, safe_serialization=True)


def dense_copy(src, dst, weights: dict[str, torch.Tensor]) -> None:
    """`src` with the named tensors replaced (by dequantized weights), as a plain fp32 checkpoint."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        ts = load_file(f)
        ts = {k: weights.get(k, v).to(torch.float32).contiguous() for k, v in ts.items()}
        save_file(ts, f, metadata={"format": "pt"})


def hf_logits(model_dir, arch: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    cls = transformers.Qwen2ForCausalLM if arch == "qwen2" else transformers.LlamaForCausalLM
    hf = cls.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        return [hf(torch.tensor([p])).logits[0].float() for p in prompts]


def our_logits(model_dir, prompts: list[list[int]], **cfg) -> list[torch.Tensor]:
    """Teacher-forced logits at every prompt position (one prefill chunk per prompt)."""
    runner = make_runner(model_dir, block_bs=4, **cfg)
    out = []
    for i, p in enumerate(prompts):
        req = Request(f"r{i}", p, SamplingParams(max_tokens=1, temperature=0.0))
        seen: list[torch.Tensor] = []
        Driver(runner, chunk=len(p)).run([req], on_logits=lambda b, lg, seen=seen: seen.append(lg))
        out.append(seen[0])
    return out


def check_close(ours: list[torch.Tensor], ref: list[torch.Tensor], tol: float) -> None:
    for a, b in zip(ours, ref):
        err = float((a[-1].cpu() - b[-1]).norm() / b[-1].norm())
        assert err < tol, err


PROMPTS_RNG = np.random.default_rng


@pytest.mark.skipif(not CPU, reason="fp32 parity on the CPU; the GPU kernels have their own tests")
@pytest.mark.parametrize(
    "fmt,arch",
    [("gptq", "llama"), ("gptq-act-order", "qwen2"), ("gptq-v2", "llama"), ("awq", "llama"), ("awq", "qwen2"),
     ("fp8-block", "llama"), ("fp8-channel", "qwen2")],
)  # fmt: skip
def test_quantized_checkpoint_matches_the_dequantized_model(tmp_path, fmt, arch, fresh_seed):
    src, dst, ref = tmp_path / "src", tmp_path / "q", tmp_path / "ref"
    tiny(src, fresh_seed % 1000, arch)
    if fmt.startswith("gptq"):
        deq = qc.write_gptq(src, dst, desc_act=fmt == "gptq-act-order", v2=fmt == "gptq-v2")
    elif fmt == "awq":
        deq = qc.write_awq(src, dst)
    elif fmt == "fp8-block":
        deq = qc.write_fp8_block(src, dst)
    else:
        deq = qc.write_fp8_channel(src, dst)
    dense_copy(src, ref, deq)
    rng = PROMPTS_RNG(fresh_seed)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (3, 17)]
    check_close(our_logits(dst, prompts), hf_logits(ref, arch, prompts), 1e-4)


@pytest.mark.skipif(not CPU, reason="fp32 parity on the CPU; the GPU kernels have their own tests")
@pytest.mark.parametrize("quant_type", ["weight_only_int8", "weight_only_int4", "fp8"])
def test_online_quantization_matches_the_dequantized_model(tmp_path, quant_type, fresh_seed):
    src, ref = tmp_path / "src", tmp_path / "ref"
    tiny(src, fresh_seed % 1000)
    deq = {}
    for k, w in load_file(src / "model.safetensors").items():
        if ".layers." in k and k.endswith("_proj.weight"):
            if quant_type == "weight_only_int8":
                deq[k] = formats.dequantize_w8(*formats.quantize_w8(w.float()))
            elif quant_type == "weight_only_int4":
                q, s, z = formats.quantize_w4(w.float(), 128)
                deq[k] = formats.dequantize_w4(q, s, z, 128)
            else:
                deq[k] = formats.dequantize_fp8(*formats.quantize_fp8_channel(w.float()))
    dense_copy(src, ref, deq)
    rng = PROMPTS_RNG(fresh_seed)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (5, 21)]
    ours = our_logits(src, prompts, quant_type=quant_type)
    check_close(ours, hf_logits(ref, "llama", prompts), 1e-4)
    # and the quantization is real: against the unquantized model, a nonzero error, bounded (a
    # random tiny model has no structure to spare: int4 moves its logits by ~0.45 of their norm)
    plain = hf_logits(src, "llama", prompts)
    err = float((ours[1][-1] - plain[1][-1]).norm() / plain[1][-1].norm())
    assert 1e-4 < err < {"weight_only_int8": 0.1, "weight_only_int4": 1.0, "fp8": 0.3}[quant_type], err


def test_quantized_weights_take_fewer_bytes(tmp_path):
    tiny(tmp_path, 1)
    runners = {q: make_runner(tmp_path, block_bs=4, quant_type=q) for q in ("", "weight_only_int8")}
    sizes = {q: r.model.weight_bytes for q, r in runners.items()}
    dense = runners[""].dtype.itemsize  # fp32 on the CPU, bf16 on CUDA
    # embedding and LM head (2 x 256 x 128) stay dense; the projections go from `dense` bytes to 1 (+ scales)
    proj = 2 * (128 * (128 + 64 + 64) + 128 * 128 + 2 * 256 * 128 + 256 * 128)
    assert sizes[""] - sizes["weight_only_int8"] >= (dense - 1) * proj - 4 * 2 * (256 + 128 + 512 + 128)


def test_refusals(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "q"
    tiny(src, 2)
    qc.write_awq(src, dst)
    with pytest.raises(ConfigError, match="QUANT_TYPE=weight_only_int8.*already quantized"):
        make_runner(dst, block_bs=4, quant_type="weight_only_int8")
    with pytest.raises(ConfigError, match="QUANT_TYPE"):
        Config.from_env(env={"QUANT_TYPE": "int3"})
    with pytest.raises(ConfigError, match="USE_CACHE_KV_INT8=1 and KV_CACHE_DTYPE=fp8"):
        Config.from_env(env={"USE_CACHE_KV_INT8": "1", "KV_CACHE_DTYPE": "fp8"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="bitsandbytes"):
        make_runner(dst, block_bs=4)


def test_the_whole_stack_serves_a_quantized_model(tmp_path):
    """The trained demo checkpoint with QUANT_TYPE=weight_only_int4 through Triton and the HTTP front
    end: greedy completions equal the offline engine's with the same setting, and the int4 model is
    a different function from the unquantized one (its prompt logprobs moved; greedy tokens of a
    trained model often do not)."""
    import requests

    from llmserve.models.demo import DEMO_HF_DIR
    from llmserve.offline import LLM
    from llmserve.serving.testing import http_stack

    prompts = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def push(self, x):\n"]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    want, lps = {}, {}
    for q in ("weight_only_int4", ""):
        llm = LLM(str(DEMO_HF_DIR), Config.from_env(env={}, block_bs=4, max_seq_len=1024, device="cpu", quant_type=q))
        want[q] = [o.token_ids for o in llm.generate(prompts, params)]
        got = llm.generate(prompts[2], SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
        lps[q] = np.array([lp.logprob for lp in got[1:]])
        llm.shutdown()
    assert np.abs(lps["weight_only_int4"] - lps[""]).max() > 1e-2
    env = dict(MODEL_DIR=str(DEMO_HF_DIR), LLMSERVE_DEVICE="cpu", QUANT_TYPE="weight_only_int4", MAX_SEQ_LEN=1024)
    with http_stack(tmp_path, **env, BLOCK_BS=4) as stack:
        stack.wait_ready()
        for prompt, ids in zip(prompts, want["weight_only_int4"]):
            got = requests.post(
                stack.http_base + "/v1/chat/completions",
                json={"text": prompt, "max_dec_len": 32, "top_k": 1},
                timeout=120,
            ).json()
            assert got["token_ids"] == ids
            body = {"model": "default", "prompt": prompt, "max_tokens": 32, "temperature": 0}
            oa = requests.post(stack.http_base + "/v1/completions", json=body, timeout=120).json()
            assert oa["usage"]["completion_tokens"] == len(ids)


def hf_logits_over_a_quantized_cache(model_dir, prompts: list[list[int]], dtype: torch.dtype, monkeypatch):
    """HF's Llama in fp32 with its K (after RoPE) and V quantized and dequantized as the cache stores them: one
    absmax scale per token and head (kernels/rotary.py quantize_ref), before every attention reads them."""
    from transformers.models.llama import modeling_llama

    from llmserve.kernels.rotary import quantize_ref

    def fake_quant(x: torch.Tensor) -> torch.Tensor:  # [B, KVH, T, D]
        values, scales = quantize_ref(x, dtype)
        return values.float() * scales[..., None]

    attend = modeling_llama.eager_attention_forward
    monkeypatch.setattr(
        modeling_llama,
        "eager_attention_forward",
        lambda m, q, k, v, *a, **kw: attend(m, q, fake_quant(k), fake_quant(v), *a, **kw),
    )
    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.inference_mode():
        return [hf(torch.tensor([p])).logits[0].float() for p in prompts]


@pytest.mark.skipif(not CPU, reason="fp32 on the CPU; test_quantized_models_on_the_gpu covers the GPU")
@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_quantized_kv_cache_serves_what_a_quantized_cache_gives(tmp_path, kv, fresh_seed, monkeypatch):
    """Prefill and decode over an int8/FP8 cache (every attention reads the cache): logits as HF's over the same
    weights with its K/V quantized the same way, and not as HF's dense ones (the cache really is quantized).
    Exact agreement of the kernels with the reference is tests/test_kv_quant.py's."""
    tiny(tmp_path, fresh_seed % 1000)
    rng = PROMPTS_RNG(fresh_seed)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (9, 30)]
    ours = our_logits(tmp_path, prompts, kv_cache_dtype=kv)
    qdtype = torch.int8 if kv == "int8" else torch.float8_e4m3fn
    same = hf_logits_over_a_quantized_cache(tmp_path, prompts, qdtype, monkeypatch)
    dense = hf_logits(tmp_path, "llama", prompts)
    errs = [float((a[-1].cpu() - b[-1]).norm() / b[-1].norm()) for a, b in zip(ours, same)]
    quant = [float((a[-1].cpu() - b[-1]).norm() / b[-1].norm()) for a, b in zip(ours, dense)]
    print(f"{kv}: against the same quantization {errs}, against the dense model {quant}")
    # Both quantize fp32 K/V of the same weights, so they part only where the two computations' K/V (RoPE and
    # the projections summed in their own orders: ~1e-7 relative) fall on either side of a rounding boundary:
    # each element with a chance of ~1e-7 / step (int8's step is a vector's absmax / 127; fp8's 2^-3 of the
    # value), a few in 10^5 of these ~10^4 cache elements, and such a flip moves one element of one cached
    # vector by one step. The bound: the fp32 parity bound (1e-4) plus one flip's reach, well under 1e-3.
    assert all(e < 1e-3 for e in errs), (errs, quant)
    # The format's own error (seen: int8 ~1e-2, fp8 ~6e-2 of the logits' norm) is far above that.
    assert all(q > 10 * max(e, 1e-4) for q, e in zip(quant, errs)), (errs, quant)


def test_a_quantized_kv_cache_is_sized_from_its_bytes(tmp_path):
    tiny(tmp_path, 3)
    runners = {kv: make_runner(tmp_path, kv_cache_dtype=kv) for kv in ("auto", "int8")}
    dense, q8 = runners["auto"].kv_spec, runners["int8"].kv_spec
    D = 32  # head_dim of tiny(): int8 values plus one fp32 scale per token and head
    assert q8.block_bytes / dense.block_bytes == (D + 4) / (dense.dtype.itemsize * D)
    assert runners["int8"].kv_cache.data.dtype == torch.int8 and runners["int8"].kv_cache.scales is not None
    assert all(r._block_bytes() == r.kv_spec.block_bytes for r in runners.values())
    assert make_runner(tmp_path, use_cache_kv_int8=True).kv_spec == q8


@pytest.mark.gpu
@pytest.mark.parametrize(
    "fmt", ["gptq-act-order", "awq", "fp8-block", "fp8-channel", "weight_only_int8", "weight_only_int4", "fp8",
            "kv-int8", "kv-fp8"],
)  # fmt: skip
def test_quantized_models_on_the_gpu(tmp_path, fmt):
    """The CUDA paths (Triton GEMMs, FP8 tensor cores with per-token activation scales, the quantized
    KV cache) in a bf16 model: prompt logits against HF in fp32 over the dequantized weights, within
    a bf16 model's error (FP8 activations add theirs), and greedy decoding (CUDA graphs) runs, with PDL on in every
    format (kernels/pdl.py; the 4-bit GEMV launches without it)."""
    from llmserve.kernels import switches

    src, dst, ref = tmp_path / "src", tmp_path / "q", tmp_path / "ref"
    tiny(src, 5)
    kw, model = {}, dst
    if fmt == "gptq-act-order":
        deq = qc.write_gptq(src, dst, desc_act=True)
    elif fmt == "awq":
        deq = qc.write_awq(src, dst)
    elif fmt == "fp8-block":
        deq = qc.write_fp8_block(src, dst)
    elif fmt == "fp8-channel":
        deq = qc.write_fp8_channel(src, dst)
    else:
        deq, model = {}, src
        kw = {"kv_cache_dtype": fmt[3:]} if fmt.startswith("kv-") else {"quant_type": fmt}
        for k, w in load_file(src / "model.safetensors").items():
            if ".layers." in k and k.endswith("_proj.weight") and fmt == "weight_only_int8":
                deq[k] = formats.dequantize_w8(*formats.quantize_w8(w.float()))
            elif ".layers." in k and k.endswith("_proj.weight") and fmt == "weight_only_int4":
                deq[k] = formats.dequantize_w4(*formats.quantize_w4(w.float(), 128), 128)
            elif ".layers." in k and k.endswith("_proj.weight") and fmt == "fp8":
                deq[k] = formats.dequantize_fp8(*formats.quantize_fp8_channel(w.float()))
    dense_copy(src, ref, deq)
    rng = PROMPTS_RNG(7)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (5, 40)]
    ours = our_logits(model, prompts, **kw)
    theirs = hf_logits(ref, "llama", prompts)
    # The bounds, from the arithmetic rather than the largest error seen. The reference runs the same
    # dequantized weights densely in bf16 (8 mantissa bits: one rounding is <= 2^-9 ~ 2e-3 relative); the
    # two sides round differently at each of the ~12 roundings on a 2-layer model's path to the logits
    # (norms, projections, residual adds), so their difference grows like sqrt(12) * 2 * 2^-9 ~ 1.4e-2 of
    # the logits' norm: 3e-2 is about twice that. kv-fp8: each cached K/V element carries one e4m3
    # rounding (3 mantissa bits: <= 2^-4 relative, RMS 2^-4 / sqrt(3) ~ 3.6e-2), which attention's
    # weighted sums carry into the logits at about that RMS: 6e-2 is below one worst-case e4m3 rounding.
    # FP8 weights run with FP8 activations (per-token scales, 3 mantissa bits): on this tiny random
    # model ~0.08-0.10 of the logits' norm; each kernel's exactness is tests/test_fp8_gemm.py's
    bound = {"fp8-block": 0.15, "fp8-channel": 0.15, "fp8": 0.15, "kv-fp8": 6e-2}.get(fmt, 3e-2)
    for a, b in zip(ours, theirs):
        err = float((a[-1].float().cpu() - b[-1]).norm() / b[-1].norm())
        assert err < bound, (fmt, err)
    runner = make_runner(model, block_bs=4, **kw)
    assert switches.current.pdl, (
        fmt
    )  # the runner's config's: on (every format: the 4-bit GEMV itself launches without it)
    reqs = [Request(f"g{i}", p, SamplingParams(max_tokens=12, temperature=0.0)) for i, p in enumerate(prompts)]
    Driver(runner, chunk=16).run(reqs)
    assert all(len(r.output_token_ids) == 12 for r in reqs)
