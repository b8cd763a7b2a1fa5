#!/usr/bin/env python3
"""xgrammar against llguidance on our tokenizers: grammar compile time and next-token mask time.

For each engine and schema: compile (cold, then cached where the engine caches), then walk 200 tokens
of a valid output (each step: the mask, a random allowed token, consume it) timing each mask. The same
seeded walk for both engines. Prints one table and writes JSON.

Usage: PYTHONPATH=server python scripts/bench_grammar.py [--model DIR] [--out grammar.json]
(xgrammar needs torch, transformers and triton installed; llguidance has no dependencies.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from llmserve.engine.tokenizer import load_tokenizer
from llmserve.runners.model_dir import resolve_model_dir

SCHEMAS = {
    "object": {"type": "object"},
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}},
        },
        "required": ["name", "age"],
    },
}


def walk(mask_fn, consume_fn, vocab: int, steps: int, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        allowed = mask_fn()
        times.append(time.perf_counter() - t)
        ids = np.flatnonzero(allowed[:vocab])
        if not ids.size or not consume_fn(int(rng.choice(ids))):
            break
    return times


def bits(words: np.ndarray) -> np.ndarray:
    return np.unpackbits(words.view(np.uint8), bitorder="little").astype(bool)


def bench_llguidance(tok, schema) -> dict:
    import llguidance
    import llguidance.numpy as lln

    t = time.perf_counter()
    lt = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrap(tok)))
    t_tok = time.perf_counter() - t
    t = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    m = llguidance.LLMatcher(lt, grammar)
    t_compile = time.perf_counter() - t
    mask = lln.allocate_token_bitmask(1, lt.vocab_size)

    def mask_fn():
        lln.fill_next_token_bitmask(m, mask, 0)
        return bits(mask[0])

    times = walk(mask_fn, lambda i: m.consume_token(i) and not m.is_stopped(), tok.vocab_size, 200, 0)
    return dict(tokenizer_s=t_tok, compile_s=t_compile, steps=len(times), mask_ms=_stats(times))


class _Wrap:
    def __init__(self, tok) -> None:
        self.tok = tok
        self.eos_token_id = tok.eos_token_id if tok.eos_token_id is not None else min(tok.eos_token_ids or {0})
        self.bos_token_id = tok.bos_token_id
        self.tokens = [tok.decode_token_bytes(i) for i in range(tok.vocab_size)]
        self.special_token_ids = sorted(tok.special_token_ids)

    def __call__(self, s):
        return self.tok.encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s, add_special_tokens=False)


def bench_xgrammar(tok, schema) -> dict:
    import xgrammar as xgr

    t = time.perf_counter()
    vocab = [tok.decode_token_bytes(i) for i in range(tok.vocab_size)]
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=sorted(tok.eos_token_ids) or None)
    compiler = xgr.GrammarCompiler(info)
    t_tok = time.perf_counter() - t
    t = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema))
    t_compile = time.perf_counter() - t
    m = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)

    def mask_fn():
        m.fill_next_token_bitmask(mask, 0)
        return bits(mask[0].numpy())

    times = walk(mask_fn, lambda i: m.accept_token(i) and not m.is_terminated(), tok.vocab_size, 200, 0)
    return dict(tokenizer_s=t_tok, compile_s=t_compile, steps=len(times), mask_ms=_stats(times))


def _stats(times: list[float]) -> dict:
    ms = sorted(x * 1e3 for x in times)
    return dict(median=statistics.median(ms), p99=ms[int(0.99 * (len(ms) - 1))], max=ms[-1]) if ms else {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="", help="tokenizer directory (default: the demo model)")
    ap.add_argument("--out", default="grammar.json")
    a = ap.parse_args()
    from llmserve.config import Config

    d = a.model or str(resolve_model_dir(Config()))
    tok = load_tokenizer(d)
    res = {"tokenizer": repr(tok)}
    for engine, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        for name, schema in SCHEMAS.items():
            try:
                res[f"{engine}/{name}"] = r = fn(tok, schema)
            except Exception as e:  # noqa: BLE001 - a missing engine is a row, not a crash
                res[f"{engine}/{name}"] = r = {"error": repr(e)[:200]}
            print(engine, name, r, flush=True)
    open(a.out, "w").write(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
