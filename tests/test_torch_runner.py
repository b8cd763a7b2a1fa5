"""The torch runner: greedy parity with HF transformers, kernels against their references, sampler semantics.

CPU (CI): tiny random Llama and Qwen2 checkpoints written here with transformers run through
TorchRunner's reference path in fp32 and must give HF generate's greedy tokens, over mixed
batches (chunked prefill beside decodes, non-contiguous KV blocks). Kernel tests need Triton:
they run on a GPU, or on a CPU under TRITON_INTERPRET=1 when triton is installed.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from llmserve.config import Config
from llmserve.engine.request import Request
from llmserve.engine.runner_contract import SeqChunk, StepBatch
from llmserve.engine.sampler import apply_penalties
from llmserve.engine.sampling_params import SamplingParams
from llmserve.kernels import HAS_TRITON

transformers = pytest.importorskip("transformers")

HAS_CUDA = torch.cuda.is_available()
KERNELS = HAS_TRITON and (HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1")
needs_kernels = pytest.mark.skipif(not KERNELS, reason="needs triton on a GPU (or TRITON_INTERPRET=1)")
DEV = "cuda" if HAS_CUDA else "cpu"


def tiny_checkpoint(path, arch: str, seed: int) -> None:
    torch.manual_seed(seed)
    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.3,
        rms_norm_eps=1e-5,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=10000.0)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "llama3-rope":
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
        scaling.update(original_max_position_embeddings=64, rope_theta=500000.0)
        cfg = transformers.LlamaConfig(**common, rope_scaling=scaling)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common, rope_theta=1e6, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)


class Driver:
    """A minimal scheduler: shuffled free blocks, chunked prefill, requests joining one per step."""

    def __init__(self, runner, chunk: int = 7, seed: int = 0) -> None:
        self.runner = runner
        self.chunk = chunk
        self.free = list(range(runner.num_kv_blocks))
        random.Random(seed).shuffle(self.free)

    def _ensure(self, req: Request, tokens: int) -> None:
        while len(req.block_table) * self.runner.block_size < tokens:
            req.block_table.append(self.free.pop())

    def run(self, reqs: list[Request], on_logits=None) -> None:
        active: list[Request] = []
        pending = list(reqs)
        left: list[str] = []
        while pending or active:
            if pending:
                active.append(pending.pop(0))
            chunks = []
            for r in active:
                if r.num_computed_tokens < r.num_prompt_tokens:
                    n = min(self.chunk, r.num_prompt_tokens - r.num_computed_tokens)
                    sample = r.num_computed_tokens + n == r.num_prompt_tokens
                else:
                    n, sample = 1, True
                self._ensure(r, r.num_computed_tokens + n)
                chunks.append(SeqChunk(r, r.num_computed_tokens, n, sample))
            batch = StepBatch(chunks, finished_req_ids=left)
            if on_logits is not None:
                on_logits(batch, self.runner.forward_logits(batch))
                # replay the same step for the tokens: K/V writes are idempotent
            res = self.runner.execute(batch)
            left = []
            it = iter(res.token_ids)
            for c in chunks:
                c.request.num_computed_tokens += c.num_tokens
                if c.sample:
                    c.request.output_token_ids += next(it)
            for r in list(active):
                if len(r.output_token_ids) >= r.params.max_tokens:
                    active.remove(r)
                    left.append(r.req_id)
                    self.free.extend(r.block_table)
                    r.block_table = []


def make_runner(path, **overrides):
    from llmserve.runners.torch.runner import TorchRunner

    cfg = Config(block_size=overrides.pop("block_size", 4), max_seq_len=256, batch_size=8, **overrides)
    return TorchRunner(str(path), cfg)


# fp32 only: on a GPU the runner computes in bf16, whose greedy tokens may part from HF's fp32 ones at a
# near-tie; there test_step_logits_match_transformers_forward and the GPU tests below compare logits.
cpu_fp32 = pytest.mark.skipif(HAS_CUDA, reason="greedy-token parity is an fp32 (CPU) check; GPU parity is by logits")


@cpu_fp32
@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama3-rope"])
def test_greedy_tokens_match_transformers(tmp_path, arch, fresh_seed):
    tiny_checkpoint(tmp_path, arch, seed=fresh_seed)
    runner = make_runner(tmp_path, block_bs=4)
    assert runner.dtype == torch.float32
    rng = np.random.default_rng(fresh_seed)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (1, 5, 19, 33)]
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=10, temperature=0.0)) for i, p in enumerate(prompts)]
    Driver(runner, chunk=7, seed=fresh_seed).run(reqs)
    hf = (transformers.Qwen2ForCausalLM if arch == "qwen2" else transformers.LlamaForCausalLM).from_pretrained(tmp_path)
    for r, p in zip(reqs, prompts):
        ref = hf.generate(
            torch.tensor([p]), max_new_tokens=10, do_sample=False, attention_mask=torch.ones(1, len(p)), pad_token_id=0
        )[0, len(p) :].tolist()
        assert r.output_token_ids == ref, r.req_id


def test_step_logits_match_transformers_forward(tmp_path, fresh_seed):
    """Prefill chunks and decode logits against a full HF forward of the same tokens (teacher forcing)."""
    assert_logits_match_transformers(tmp_path, (13, 2, 40), seed=fresh_seed)


def assert_logits_match_transformers(
    tmp_path, lengths: tuple[int, ...], max_tokens: int = 6, seed: int = 5, **cfg
) -> None:
    tiny_checkpoint(tmp_path, "llama", seed=seed)
    runner = make_runner(tmp_path, block_bs=4, **cfg)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).to(runner.device)  # fp32 reference
    rng = np.random.default_rng(seed + 1)
    reqs = [
        Request(f"r{i}", rng.integers(0, 256, size=n).tolist(), SamplingParams(max_tokens=max_tokens, temperature=0.0))
        for i, n in enumerate(lengths)
    ]
    seen: dict[str, list[torch.Tensor]] = {r.req_id: [] for r in reqs}

    def record(batch, logits):
        rows = [c for c in batch.chunks if c.sample]
        for c, row in zip(rows, logits):
            seen[c.request.req_id].append(row.float().cpu())

    Driver(runner, chunk=9).run(reqs, on_logits=record)
    hf16 = transformers.LlamaForCausalLM.from_pretrained(tmp_path).to(runner.device, runner.dtype)
    with torch.inference_mode():
        for r in reqs:
            ids = torch.tensor([r.all_token_ids[:-1]], device=runner.device)
            ref = hf(ids).logits[0, r.num_prompt_tokens - 1 :].float().cpu()
            ours = torch.stack(seen[r.req_id])
            err = float((ours - ref).norm() / ref.norm())
            if not HAS_CUDA:
                assert err < 1e-4, (r.req_id, err)
                continue
            # bf16 on the GPU: against the fp32 reference, our error is no larger than HF's own in bf16
            theirs = hf16(ids).logits[0, r.num_prompt_tokens - 1 :].float().cpu()
            hf_err = float((theirs - ref).norm() / ref.norm())
            assert err < max(1e-2, 1.5 * hf_err), (r.req_id, err, hf_err)


def test_the_runner_applies_its_configs_switches(tmp_path):
    """LLMSERVE_KERNEL_SWITCHES (a lab setting, kernels/switches.py) are the process's from a runner's construction on,
    every switch its config does not name at its default."""
    from llmserve.kernels import switches

    tiny_checkpoint(tmp_path, "llama", seed=5)
    make_runner(tmp_path, block_bs=4, kernel_switches="skinny=0,ref=1")
    assert switches.current == switches.Switches(skinny=False, ref=True)
    make_runner(tmp_path, block_bs=4)
    assert switches.current == switches.Switches()


def test_sampler_matches_host_definitions():
    from llmserve.layers.sampler import DeviceSampler

    V = 64
    rng = np.random.default_rng(0)
    sampler = DeviceSampler(V, torch.device(DEV), seed=1)
    reqs = []
    for i, (rp, fp, pp, mt) in enumerate([(1.3, 0.5, 0.2, 1), (0.8, 0.0, 0.0, 5), (1.0, -0.4, 1.0, 0), (1.0, 0, 0, 1)]):
        p = SamplingParams(
            max_tokens=20,
            min_tokens=mt,
            temperature=0.0,
            repetition_penalty=rp,
            frequency_penalty=fp,
            presence_penalty=pp,
        )
        r = Request(f"s{i}", rng.integers(0, V, size=6).tolist(), p, eos_token_ids=frozenset({3, 7}))
        r.output_token_ids = rng.integers(0, V, size=3).tolist()
        reqs.append(r)
    logits = rng.normal(size=(4, V)).astype(np.float32) * 3
    out = torch.tensor(logits, device=DEV)
    for _step in range(2):  # the second step checks the incremental penalty counts
        ref = logits.copy()
        for row, r in zip(ref, reqs):
            apply_penalties(row, r.prompt_token_ids, r.output_token_ids, r.params)
            if len(r.output_token_ids) < r.params.min_tokens:
                row[list(r.eos_token_ids)] = -np.inf
        x = out.clone()
        tokens, _ = sampler.sample(x, reqs)
        np.testing.assert_allclose(x.cpu().numpy(), ref, rtol=1e-5, atol=1e-5)
        assert tokens.tolist() == ref.argmax(1).tolist()
        for r, t in zip(reqs, tokens.tolist()):  # penalty counts follow the tokens the sampler drew
            r.output_token_ids.append(t)


def test_sampler_top_k_top_p_support_and_seeds():
    from llmserve.layers.sampler import DeviceSampler

    V = 50
    logits = torch.tensor(np.random.default_rng(1).normal(size=V).astype(np.float32) * 2)
    sampler = DeviceSampler(V, torch.device(DEV), seed=0)
    p = SamplingParams(max_tokens=1000, temperature=0.7, top_k=10, top_p=0.6, seed=1234)
    scaled = logits.numpy() / 0.7
    order = np.argsort(-scaled, kind="stable")[:10]
    probs = np.exp(scaled[order] - scaled[order][0])
    probs /= probs.sum()
    allowed = set(order[: max(1, int(np.count_nonzero(np.cumsum(probs) - probs < 0.6)))].tolist())
    req = Request("a", [1, 2], p)
    drawn = []
    for i in range(300):
        req.output_token_ids = [0] * i
        t, _ = sampler.sample(logits[None].to(DEV).clone(), [req])
        drawn.append(int(t[0]))
    assert set(drawn) <= allowed and len(set(drawn)) > 1
    # frequency of the top token close to its nucleus probability
    kept = order[: len(allowed)]
    pk = probs[: len(allowed)] / probs[: len(allowed)].sum()
    assert abs(drawn.count(int(kept[0])) / 300 - pk[0]) < 0.1
    # the same seed and output index give the same token in any batch
    other = Request("b", [5], SamplingParams(temperature=1.0))
    req.output_token_ids = [0] * 17
    alone, _ = sampler.sample(logits[None].to(DEV).clone(), [req])
    both, _ = sampler.sample(torch.stack([logits * 0.5, logits]).to(DEV), [other, req])
    assert int(alone[0]) == int(both[1])


# ---------------------------------------------------------------- kernels against references
@needs_kernels
def test_norm_swiglu_kernels():
    from llmserve.kernels.activation import swiglu, swiglu_ref
    from llmserve.kernels.norm import rms_norm, rms_norm_ref

    dt = torch.bfloat16 if HAS_CUDA else torch.float32
    x = torch.randn(37, 200, device=DEV, dtype=dt)
    w = torch.randn(200, device=DEV, dtype=dt)
    r1 = torch.randn_like(x)
    r2 = r1.clone()
    tol = 2e-2 if HAS_CUDA else 1e-5
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), rtol=tol, atol=tol)
    torch.testing.assert_close(rms_norm(x, w, 1e-6, r1), rms_norm_ref(x, w, 1e-6, r2), rtol=tol, atol=tol)
    torch.testing.assert_close(r1, r2, rtol=tol, atol=tol)
    g = torch.randn(37, 2 * 1500, device=DEV, dtype=dt)
    torch.testing.assert_close(swiglu(g), swiglu_ref(g), rtol=tol, atol=tol)


def _cache_setup(T_kv_blocks=40, KVH=2, BS=16, D=32, dt=torch.float32):
    k = torch.randn(T_kv_blocks, KVH, BS, D, device=DEV, dtype=dt)
    v = torch.randn_like(k)
    return k, v


@needs_kernels
@pytest.mark.parametrize("H,KVH,D,wide", [(4, 2, 32, False), (8, 1, 64, False), (6, 2, 16, False), (8, 2, 64, True)])
def test_rope_cache_kernel(H, KVH, D, wide):
    """wide: an fp32 qkv (the model's projection output) over a bf16 cache, as on CUDA."""
    from llmserve.kernels.rotary import rope_and_cache, rope_and_cache_ref, rope_cos_sin
    from llmserve.layers.rope import rope_inv_freq

    dt = torch.bfloat16 if HAS_CUDA else torch.float32
    T, BS, NB = 11, 8, 6
    qkv = torch.randn(T, (H + 2 * KVH) * D, device=DEV, dtype=torch.float32 if wide else dt)
    pos = torch.randint(0, 100, (T,), device=DEV, dtype=torch.int32)
    slots = torch.randperm(NB * BS, device=DEV)[:T].to(torch.int32)
    slots[3] = -1
    cs = rope_cos_sin(rope_inv_freq(D, 10000.0), 128, torch.device(DEV))
    outs = []
    for fn in (rope_and_cache, rope_and_cache_ref):
        q = qkv.clone()
        k = torch.full((NB, KVH, BS, D), 7.0, device=DEV, dtype=dt)
        v = k.clone()
        fn(q, pos, slots, cs, k, v, H, KVH)
        outs.append((q, k, v))
    for a, b in zip(*outs):
        tol = 1e-5 if a.dtype == torch.float32 else 2e-2
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def _stored(x: float, dtype: torch.dtype) -> torch.Tensor:
    """x as a store of `dtype` keeps it, as fp32. Round to nearest even (torch, a GPU), except bf16 under
    Triton's interpreter, which converts fp32 to bf16 by dropping the low 16 bits (runtime/interpreter.py
    _convert_float): 7e4 is 70144 on a GPU, 69632 there."""
    t = torch.tensor(x, dtype=torch.float32)
    if dtype == torch.bfloat16 and not HAS_CUDA and os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON:
        return (t.view(torch.int32) & ~0xFFFF).view(torch.float32)
    return t.to(dtype).float()


def test_rope_saturates_at_fp16_range_over_fp16_cache():
    """Over an fp16 cache (a bf16 model's) q, k and v beyond fp16's range are saturated when written,
    never inf; over a bf16 or fp32 cache they are kept as they are."""
    from llmserve.kernels.rotary import rope_and_cache, rope_cos_sin
    from llmserve.layers.rope import rope_inv_freq

    H, KVH, D, T = 2, 1, 16, 3
    cs = rope_cos_sin(rope_inv_freq(D, 10000.0), 16, torch.device(DEV))
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        qkv = torch.randn(T, (H + 2 * KVH) * D, device=DEV)
        qkv[:, 0] = 1e6  # q, head 0, first half: position 0 leaves it unrotated
        qkv[:, H * D + D // 2] = -3e5  # k, second half
        qkv[:, (H + KVH) * D] = 7e4  # v
        k = torch.zeros(2, KVH, 4, D, device=DEV, dtype=dt)
        v = torch.zeros_like(k)
        pos = torch.zeros(T, device=DEV, dtype=torch.int32)
        rope_and_cache(qkv, pos, torch.arange(T, device=DEV, dtype=torch.int32), cs, k, v, H, KVH)
        got = (qkv[:, 0], k[0, 0, :T, D // 2].float(), v[0, 0, :T, 0].float())  # q stays in qkv (fp32)
        want = (65504.0, -65504.0, 65504.0) if dt == torch.float16 else (1e6, -3e5, 7e4)
        for g, w, store in zip(got, want, (torch.float32, dt, dt)):
            assert g.eq(_stored(w, store)).all(), (dt, g, w)
        assert k.isfinite().all() and v.isfinite().all()


@needs_kernels
@pytest.mark.parametrize("wide_q", [False, True])
@pytest.mark.parametrize("decode_only,splits", [(False, 1), (True, 1), (True, 3)])
def test_paged_attention_kernel(decode_only, splits, wide_q):
    """wide_q: the model's layout on CUDA, fp32 q over an fp16 cache, output bf16. Against the exact
    attention of unrounded fp32 K/V, it must beat a bf16 cache with bf16 q (what a plain bf16 model
    does) and be within a little of the output's own bf16 rounding."""
    from llmserve.kernels.attention import AttnMeta, paged_attention, paged_attention_ref, tile_tokens
    from llmserve.runners.torch.inputs import work_items

    dt = torch.bfloat16 if HAS_CUDA else torch.float32
    H, KVH, D, BS, NB = 8, 2, 32, 16, 64
    k, v = _cache_setup(NB, KVH, BS, D, dt)
    rng = np.random.default_rng(7)
    ctx = np.array([0, 5, 37, 100, 16])
    q_lens = np.ones(5, dtype=np.int64) if decode_only else np.array([40, 1, 3, 70, 1])
    if decode_only:
        ctx = ctx + 1
    seq_lens = ctx + q_lens
    if decode_only:
        seq_lens = ctx  # the token's own K/V is already in the cache
    perm = rng.permutation(NB)
    width = int(-(-seq_lens.max() // BS))
    bt = np.stack([perm[i * width : (i + 1) * width] for i in range(5)])
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    block_t = tile_tokens(H, KVH, decode_only)
    single = q_lens == 1
    item_seq, item_q = work_items(q_lens if decode_only else np.where(single, 0, q_lens), block_t)
    i32 = lambda a: torch.tensor(np.asarray(a), dtype=torch.int32, device=DEV)  # noqa: E731
    meta = AttnMeta(i32(cu), i32(seq_lens), i32(bt), i32(item_seq), i32(item_q), block_t, splits)
    if not decode_only:  # single tokens get the decode launch, as in the runner
        meta.dec_item_seq, meta.dec_item_qstart = i32(np.flatnonzero(single)), i32(np.zeros(int(single.sum())))
        meta.dec_block_t = tile_tokens(H, KVH, True)
    T = int(cu[-1])
    qkv = torch.randn(T, (H + 2 * KVH) * D, device=DEV, dtype=torch.float32 if wide_q else dt)
    q = qkv[:, : H * D].view(T, H, D)  # strided like the model's view
    if wide_q and HAS_CUDA:
        k32, v32 = k.float(), v.float()  # fresh values, not bf16-representable ones
        k32 += torch.randn_like(k32) * 1e-2
        v32 += torch.randn_like(v32) * 1e-2
        k, v = k32.half(), v32.half()
    out = paged_attention(q, k, v, meta, D**-0.5, dt)
    assert out.dtype == dt and torch.isfinite(out).all()
    ref = paged_attention_ref(q, k, v, meta, D**-0.5, dt)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    if wide_q and HAS_CUDA:
        exact = paged_attention_ref(q, k32, v32, meta, D**-0.5, torch.float32)
        err, rounding = _rel(out, exact), _rel(exact.to(dt), exact)
        plain = _rel(paged_attention(q.to(dt), k32.to(dt), v32.to(dt), meta, D**-0.5), exact)
        print(f"attention rel. error {err:.2e}; output rounding alone {rounding:.2e}; all-bf16 {plain:.2e}")
        assert err <= 1.2 * rounding, (err, rounding)
        assert err < plain, (err, plain)  # seen: 1.5-1.8e-3 against 2.2-3.1e-3 (H200)


@needs_kernels
def test_gumbel_kernel_matches_reference():
    from llmserve.engine.draw import mix_key
    from llmserve.kernels.sampling import gumbel_argmax, gumbel_argmax_ref

    logits = torch.randn(6, 10000, device=DEV)
    inv_t = torch.tensor([0.0, 1.0, 2.0, 0.5, 1.0, 1.0], device=DEV)
    keys = torch.tensor([mix_key(s, i) for s, i in [(1, 0), (1, 1), (2, 0), (3, 5), (4, 4), (4, 5)]], device=DEV)
    assert gumbel_argmax(logits, inv_t, keys).tolist() == gumbel_argmax_ref(logits, inv_t, keys).tolist()


@needs_kernels
def test_argmax_kernel_matches_torch(fresh_seed):
    """kernels/sampling.py's split argmax gives torch.argmax's indices: ties to the first, -inf rows, NaN, a vocabulary
    that no chunk divides, rows of a wider tensor (a stride)."""
    from llmserve.kernels.sampling import argmax

    gen = torch.Generator().manual_seed(fresh_seed)
    for vocab in (1, 1000, 70001, 129 * 1024 + 3):
        x = torch.randn(5, vocab + 7, generator=gen)[:, :vocab]
        x[1] = float("-inf")  # nothing allowed: index 0
        x[2, vocab // 2 :] = x[2].max() + 1  # a tie over the second half: its first index
        x[3] = x[3].round()  # many ties
        x[4, vocab // 3] = float("nan")
        x = x.to(DEV)
        assert argmax(x).tolist() == x.argmax(dim=1).tolist(), (vocab, fresh_seed)
    assert argmax(torch.zeros(0, 10, device=DEV)).shape == (0,)


# The kernel tests above, under the interpreter, in a subprocess (triton reads TRITON_INTERPRET at import): CI's
# CPU runs them against the references this way.
INTERPRETED = 1 + 4 + 1 + 6 + 1 + 1  # norm/swiglu, rope cache, rope saturation, paged attention, gumbel, argmax


@pytest.mark.skipif(not HAS_TRITON, reason="triton does not import here")
@pytest.mark.skipif(KERNELS, reason="the kernel tests run directly here")
def test_kernels_under_interpreter():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            __file__,
            "-q",
            "-m",
            "not gpu",
            "-k",
            "kernel and not under_interpreter or saturates",
        ]
        + ["-p", "no:cacheprovider", "-p", "no:xdist"],
        env=dict(os.environ, TRITON_INTERPRET="1"),
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=900,
    )
    tail = r.stdout[-3000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    passed = re.search(r"(\d+) passed", r.stdout)
    assert passed and int(passed.group(1)) == INTERPRETED, tail
    assert "skipped" not in r.stdout.splitlines()[-1], tail


# ---------------------------------------------------------------- with the engine
@cpu_fp32
def test_engine_with_torch_runner_matches_transformers(tmp_path, fresh_seed):
    """LLMEngine (scheduler, block manager, prefix cache) over TorchRunner: greedy tokens as HF's."""
    from llmserve.engine.llm_engine import LLMEngine

    tiny_checkpoint(tmp_path, "qwen2", seed=fresh_seed)
    cfg = Config(block_size=4, max_seq_len=128, batch_size=4, block_bs=3, max_num_batched_tokens=16)
    from llmserve.runners.torch.runner import TorchRunner

    engine = LLMEngine(cfg, TorchRunner(str(tmp_path), cfg))
    rng = np.random.default_rng(fresh_seed)
    shared = rng.integers(0, 256, size=9).tolist()  # a common prefix exercises the prefix cache
    prompts = [shared + rng.integers(0, 256, size=n).tolist() for n in (3, 20, 1, 11, 6)]
    for i, p in enumerate(prompts):
        engine.add_request(f"e{i}", p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    got: dict[str, list[int]] = {f"e{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.req_id] += out.new_token_ids
    hf = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path)
    for i, p in enumerate(prompts):
        ref = hf.generate(
            torch.tensor([p]), max_new_tokens=8, do_sample=False, attention_mask=torch.ones(1, len(p)), pad_token_id=0
        )[0, len(p) :].tolist()
        assert got[f"e{i}"] == ref


# ---------------------------------------------------------------- GPU only
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@gpu
@needs_cuda
def test_cuda_graph_decode_matches_eager(tmp_path):
    from llmserve.runners.torch.inputs import host_arrays

    tiny_checkpoint(tmp_path, "llama", seed=2)
    runner = make_runner(tmp_path, block_bs=8)
    assert runner.graphs is not None
    rng = np.random.default_rng(0)
    free = list(range(runner.num_kv_blocks))
    reqs = []
    for i, n in enumerate((5, 30, 17)):
        r = Request(f"g{i}", rng.integers(0, 256, size=n).tolist(), SamplingParams(max_tokens=3, temperature=0.0))
        r.block_table = [free.pop() for _ in range(-(-(n + 1) // runner.block_size))]
        reqs.append(r)
    runner.execute(StepBatch([SeqChunk(r, 0, r.num_prompt_tokens - 1, False) for r in reqs]))  # prefill
    batch = StepBatch([SeqChunk(r, r.num_prompt_tokens - 1, 1, True) for r in reqs])  # decode the last token
    with torch.inference_mode():
        graph_logits = runner.graphs.replay(host_arrays(batch.chunks, runner.block_size))[:3].clone()
        x = runner.prepare(batch, host_arrays(batch.chunks, runner.block_size))
        eager = runner.model.logits(
            runner.model.forward(x.input_ids, x.positions, x.slot_mapping, x.meta, runner.kv_cache)
        )
    # The graph replays the kernels the eager step launches, over the same inputs; the graph's bucket pads the
    # batch with rows of its own, and every kernel computes a row independently of the others (the GEMVs and
    # skinny products: test_gemv's "a row is its own product"; attention: a sequence's own blocks), so the
    # logits are the same bits. (GPU only: unverified on the CPU, where there are no CUDA graphs.)
    assert torch.equal(graph_logits, eager), (graph_logits - eager).abs().max()


@gpu
@needs_cuda
@pytest.mark.parametrize("gemv_norm", [True, False])
def test_one_stream_decode_matches_transformers(tmp_path, gemv_norm):
    """One stream's decode steps run the GEMVs, with the norms in them (model.py `Normed`) or as kernels of their
    own (the kernel switch gemv_norm=0, which the runner applies): its logits against HF's forward, as above."""
    switch = {"kernel_switches": f"gemv_norm={int(gemv_norm)}"}
    tiny_checkpoint(tmp_path, "llama", seed=5)
    m = make_runner(tmp_path, block_bs=4, **switch).model
    assert m.norms_in_gemvs(torch.zeros(1, m.cfg.hidden_size, device="cuda", dtype=m.dtype)) == gemv_norm
    assert not m.norms_in_gemvs(torch.zeros(2, m.cfg.hidden_size, device="cuda", dtype=m.dtype))
    assert_logits_match_transformers(tmp_path, (21,), max_tokens=12, **switch)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@gpu
@pytest.mark.slow
@pytest.mark.skipif(
    not (HAS_CUDA and os.environ.get("LLMSERVE_GPU_BIG") == "1") and os.environ.get("LLMSERVE_PARITY_SHAPE") != "tiny",
    reason="set LLMSERVE_GPU_BIG=1 on a GPU with >= 40 GB (8B-shaped model)",
)
def test_8b_shaped_logits_and_greedy_match_transformers(tmp_path):
    """Issue 5 point 3: prefill + 64 decode steps in mixed batches vs HF on the same bf16 weights."""
    from llmserve.models.random_model import write_random_checkpoint
    from llmserve.runners.torch.runner import TorchRunner

    shape = os.environ.get("LLMSERVE_PARITY_SHAPE", "llama3-8b")
    root = "/dev/shm" if os.path.isdir("/dev/shm") and HAS_CUDA else str(tmp_path)
    path = write_random_checkpoint(
        f"{root}/llmserve-random-v3-{shape}", shape, device=DEV, dtype=torch.bfloat16 if HAS_CUDA else torch.float32
    )
    runner = TorchRunner(str(path), Config(block_size=64, max_seq_len=1024, batch_size=8, block_bs=8))
    rng = np.random.default_rng(0)
    V = runner.vocab_size
    reqs = [
        Request(f"p{i}", rng.integers(0, V, size=n).tolist(), SamplingParams(max_tokens=65, temperature=0.0))
        for i, n in enumerate((300, 37, 700, 129))
    ]
    seen: dict[str, list[torch.Tensor]] = {r.req_id: [] for r in reqs}
    inner = runner._forward  # what every step's `submit` runs (forward_logits is the draft model's entry)

    def recording(batch, *args, **kwargs):  # whatever else `_forward` takes, passed on as given
        out = inner(batch, *args, **kwargs)
        for c, row in zip([c for c in batch.chunks if c.sample], out[0]):
            seen[c.request.req_id].append(row.float().cpu())
        return out

    runner._forward = recording
    Driver(runner, chunk=256).run(reqs)
    runner.shutdown()
    del runner
    # References: HF on the same weights in bf16 (what the issue names) and in fp32 (the exact
    # function); HF's own bf16 error says how much of ours is bf16 noise shared by both.
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEV)
    refs32, refs16 = {}, {}
    with torch.inference_mode():
        for r in reqs:
            ids = torch.tensor([r.all_token_ids[:-1]], device=DEV)
            refs32[r.req_id] = hf(ids).logits[0, r.num_prompt_tokens - 1 :].float().cpu()
        del hf  # (.to(bf16) would also round HF's rotary inv_freq buffer: load it in bf16 instead)
        torch.cuda.empty_cache() if HAS_CUDA else None
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=runner_dtype()).to(DEV)
        for r in reqs:
            ids = torch.tensor([r.all_token_ids[:-1]], device=DEV)
            refs16[r.req_id] = hf(ids).logits[0, r.num_prompt_tokens - 1 :].float().cpu()
    worst = {"ours_vs_hf_bf16": 0.0, "ours_vs_fp32": 0.0, "hf_bf16_vs_fp32": 0.0}
    report = []
    for r in reqs:
        ours, ref32, ref16 = torch.stack(seen[r.req_id]), refs32[r.req_id], refs16[r.req_id]
        assert ours.shape == ref32.shape == (65, V)
        for key, (a, b) in {"ours_vs_hf_bf16": (ours, ref16), "ours_vs_fp32": (ours, ref32),
                            "hf_bf16_vs_fp32": (ref16, ref32)}.items():  # fmt: skip
            worst[key] = max(worst[key], max(_rel(x, y) for x, y in zip(a, b)))
        # greedy: our tokens are the reference's argmax until the first near-tie
        mism = [j for j in range(65) if int(ref32[j].argmax()) != r.output_token_ids[j]]
        if mism:
            j = mism[0]
            gap = float(ref32[j].max() - ref32[j][r.output_token_ids[j]])
            noise = float((ours[j] - ref32[j]).abs().max())
            assert gap <= 2 * noise, (r.req_id, j, gap, noise)
        report.append((r.req_id, r.num_prompt_tokens, mism[:1]))
    print("parity:", report, worst)
    # The target is the exact function of these weights (HF in fp32): under 1e-2 for every row.
    # HF's own bf16 forward is ~1.8e-2 off it on this random 32-layer model (it keeps the residual
    # in bf16), so ours vs HF bf16 is mostly HF's error: reported, and bounded by the sum of both.
    assert worst["ours_vs_fp32"] < 1e-2, worst
    assert worst["ours_vs_fp32"] < worst["hf_bf16_vs_fp32"], worst
    assert worst["ours_vs_hf_bf16"] <= worst["ours_vs_fp32"] + worst["hf_bf16_vs_fp32"] + 1e-3, worst


def runner_dtype() -> torch.dtype:
    return torch.bfloat16 if HAS_CUDA else torch.float32
