"""Benchmark workloads: prompts with an exact input token count and a fixed output length.

Every prompt is built from token ids, so its length is exact for backends that
take `input_ids` (native, triton-grpc, engine). Backends that take text (the
OpenAI ones) get the same prompt as text made of "word tokens": tokens whose
text is one space plus letters and that encode back to themselves alone.
Byte-level BPE and SentencePiece split text at such word boundaries, so a
sequence of them re-encodes to exactly the same ids; `text_for` checks this
and repairs the rare miss.

Workloads (same `seed` -> same lengths and tokens):
- `random`: lengths uniform in [L*(1-r), L*(1+r)] (r = range ratio, as vLLM's
  `bench serve` does), tokens uniform over the word tokens.
- `sharegpt-synthetic`: log-normal lengths resembling the ShareGPT conversations
  used by vLLM/FastDeploy benchmarks (see SHAREGPT below and docs/benchmarks.md).
- `jsonl`: one JSON object a line: `{"prompt": str}` or `{"input_ids": [int]}`,
  optionally `"output_len"`; text is tokenized here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# ShareGPT-like length distributions: log-normal, ln(len) ~ N(mu, sigma), clipped.
# mu/sigma give a median of ~100 input / ~130 output tokens and means of ~230 /
# ~200, close to the filtered ShareGPT_V3 statistics commonly quoted for
# serving benchmarks (prompt mean ~220-230, output mean ~190-200 Llama tokens),
# with a long tail of prompts (p99 ~1.9k, clipped at 2048) and shorter-tailed answers.
SHAREGPT = {
    "input": {"mu": math.log(100.0), "sigma": 1.27, "min": 4, "max": 2048},
    "output": {"mu": math.log(130.0), "sigma": 0.93, "min": 4, "max": 1024},
}


@dataclass
class BenchRequest:
    prompt_ids: list[int]
    output_len: int
    prompt: str | None = None  # text (for text backends); built lazily from prompt_ids

    @property
    def input_len(self) -> int:
        return len(self.prompt_ids)


class Vocab:
    """The tokens prompts are built from, and the text <-> ids round trip."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        special = set(getattr(tokenizer, "special_token_ids", ()))
        words = []
        for i in range(tokenizer.vocab_size):
            if i in special:
                continue
            s = tokenizer.decode([i])
            if len(s) > 1 and s[0] == " " and s[1:].isalpha() and tokenizer.encode(s, add_special_tokens=False) == [i]:
                words.append(i)
        if len(words) < 16:
            raise ValueError(f"the tokenizer has only {len(words)} word tokens; cannot build benchmark prompts")
        self.word_ids = np.array(words, dtype=np.int64)
        # Tokens the tokenizer adds around plain text (e.g. BOS) and around a chat message.
        self.text_overhead = len(tokenizer.encode("", add_special_tokens=True))
        self.chat_overhead = self._chat_overhead()

    def _chat_overhead(self) -> int | None:
        if not getattr(self.tokenizer, "chat_template", None):
            return None
        probe = self.tokenizer.decode(self.word_ids[:4].tolist())
        n = len(self.tokenizer.encode_chat([{"role": "user", "content": probe}]))
        return n - len(self.tokenizer.encode(probe, add_special_tokens=False))

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        return rng.choice(self.word_ids, size=n).tolist()

    def text_for(self, ids: list[int], rng: np.random.Generator | None = None) -> str:
        """Text that encodes (without special tokens) to exactly len(ids) tokens."""
        target = len(ids)
        cur = list(ids)
        rng = rng or np.random.default_rng(target)
        for _ in range(10):
            text = self.tokenizer.decode(cur)
            got = len(self.tokenizer.encode(text, add_special_tokens=False))
            if got == target:
                return text
            # Re-tokenization merged or split something: trim or pad and retry.
            cur = cur[: max(1, len(cur) - (got - target))] if got > target else cur + self.sample(rng, target - got)
        raise ValueError(f"could not build a text prompt of exactly {target} tokens")


def random_lengths(rng: np.random.Generator, n: int, mean_len: int, range_ratio: float) -> np.ndarray:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, math.floor(mean_len * (1 - range_ratio)))
    hi = max(lo, math.ceil(mean_len * (1 + range_ratio)))
    return rng.integers(lo, hi + 1, size=n)


def sharegpt_lengths(rng: np.random.Generator, n: int, which: str) -> np.ndarray:
    p = SHAREGPT[which]
    x = rng.lognormal(p["mu"], p["sigma"], size=n)
    return np.clip(np.rint(x), p["min"], p["max"]).astype(np.int64)


def build_workload(
    name: str,
    vocab: Vocab,
    num_prompts: int,
    seed: int = 0,
    input_len: int = 128,
    output_len: int = 128,
    range_ratio: float = 0.0,
    path: str | None = None,
) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    if name == "random":
        ins = random_lengths(rng, num_prompts, input_len, range_ratio)
        outs = random_lengths(rng, num_prompts, output_len, range_ratio)
    elif name == "sharegpt-synthetic":
        ins = sharegpt_lengths(rng, num_prompts, "input")
        outs = sharegpt_lengths(rng, num_prompts, "output")
    elif name == "jsonl":
        if not path:
            raise ValueError("--workload jsonl needs --dataset-path FILE")
        return load_jsonl(path, vocab, num_prompts, output_len)
    else:
        raise ValueError(f"unknown workload {name!r}")
    return [BenchRequest(vocab.sample(rng, int(i)), int(o)) for i, o in zip(ins, outs)]


def load_jsonl(path: str, vocab: Vocab, num_prompts: int, output_len: int) -> list[BenchRequest]:
    reqs = []
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
        out = int(obj.get("output_len") or output_len)
        if "input_ids" in obj:
            reqs.append(BenchRequest([int(t) for t in obj["input_ids"]], out))
        elif isinstance(obj.get("prompt") or obj.get("text"), str):
            text = obj.get("prompt") or obj.get("text")
            reqs.append(BenchRequest(vocab.tokenizer.encode(text, add_special_tokens=False), out, prompt=text))
        else:
            raise ValueError(f"{path}:{lineno}: expected a `prompt` string or `input_ids`")
        if len(reqs) == num_prompts:
            break
    if not reqs:
        raise ValueError(f"{path}: no prompts")
    # Fewer lines than --num-prompts: cycle through them.
    return [reqs[i % len(reqs)] for i in range(num_prompts)]


def arrival_delays(num: int, request_rate: float, seed: int) -> list[float]:
    """Gaps before each request: Poisson process of `request_rate` req/s, or all at once (inf)."""
    if math.isinf(request_rate):
        return [0.0] * num
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 or inf, got {request_rate}")
    rng = np.random.default_rng(seed + 1)
    return rng.exponential(1.0 / request_rate, size=num).tolist()


def arrival_offsets(num: int, request_rate: float, seed: int) -> list[float]:
    """Each request's send time, in seconds after the start: the sums of `arrival_delays`."""
    return np.cumsum(arrival_delays(num, request_rate, seed)).tolist()
