"""The step message: what rank 0 sends the other ranks of a tensor-parallel group each step.

Rank 0 schedules; every rank runs the same step over its shard (parallel.py). A request is sent
once, when a step first holds it (prompt, sampling parameters, stop ids); after that a step carries
only what changed: per chunk its position and length, the request's output tokens since the last
message (a token still in flight is PENDING in the chunk's inputs, as on rank 0, and each rank fills
it in on its device from its own last tokens, which are every rank's), and its block table's new entries (the whole table again after it shrank:
a preemption or a speculative rollback). The workers keep a mirror `Request` per req_id and drop it
when rank 0 says the request left (before the step's new requests: an id may leave and return in
one step).

msgpack map: {"new": [[req_id, prompt ids, params, eos ids], ...],
              "chunks": [[req_id, start, num_tokens, sample, new outputs, keep, table tail, drafts,
                          prompt_logprobs, token bitmask bytes | None (structured output)], ...],
              "left": [req_id, ...]}
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmserve.engine.request import Request
from llmserve.engine.runner_contract import SeqChunk, StepBatch
from llmserve.engine.sampling_params import SamplingParams
from llmserve.utils.wire import dumps, loads


@dataclass
class _Sent:
    outputs: int = 0  # output tokens the workers hold
    table: int = 0  # block-table entries they hold
    trims: int = 0  # the request's num_table_trims when they were sent


class StepEncoder:
    """Rank 0's side: what the workers know of each request, and the message of a step."""

    def __init__(self) -> None:
        self.sent: dict[str, _Sent] = {}

    def encode(self, batch: StepBatch) -> bytes:
        # Requests that left first: a req_id may leave and come back in the same step (a preempted
        # request, or the offline LLM numbering each call's requests from 0), and then it is new.
        for req_id in batch.finished_req_ids:
            self.sent.pop(req_id, None)
        new, chunks = [], []
        for c in batch.chunks:
            req = c.request
            s = self.sent.get(req.req_id)
            if s is None:
                s = self.sent[req.req_id] = _Sent(trims=req.num_table_trims)
                new.append([req.req_id, req.prompt_token_ids, req.params.as_dict(), sorted(req.eos_token_ids)])
            outs = req.output_token_ids[s.outputs :]
            s.outputs += len(outs)
            keep = 0 if req.num_table_trims != s.trims else min(s.table, len(req.block_table))
            tail = req.block_table[keep:]
            s.table, s.trims = len(req.block_table), req.num_table_trims
            mask = None if c.token_bitmask is None else c.bitmask().tobytes()  # computed here, before sending
            chunks.append(
                [
                    req.req_id,
                    c.start,
                    c.num_tokens,
                    c.sample,
                    outs,
                    keep,
                    tail,
                    c.draft_token_ids,
                    c.prompt_logprobs,
                    mask,
                ]
            )
        return dumps({"new": new, "chunks": chunks, "left": batch.finished_req_ids})


class StepDecoder:
    """A worker's side: mirror requests, and each message turned back into the step it describes."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}

    def decode(self, raw: bytes) -> StepBatch:
        msg = loads(raw)
        for req_id in msg["left"]:  # first, as the encoder (and the runner) take them
            self.requests.pop(req_id, None)
        for req_id, prompt, params, eos in msg["new"]:
            self.requests[req_id] = Request(req_id, prompt, SamplingParams(**params), frozenset(eos))
        chunks = []
        for req_id, start, n, sample, outs, keep, tail, drafts, plp, mask in msg["chunks"]:
            req = self.requests[req_id]
            req.output_token_ids.extend(outs)
            del req.block_table[keep:]
            req.block_table.extend(tail)
            bitmask = None if mask is None else np.frombuffer(mask, dtype=np.int32).reshape(1 + len(drafts), -1)
            chunks.append(SeqChunk(req, start, n, sample, drafts, plp, bitmask))
        return StepBatch(chunks, finished_req_ids=msg["left"])
