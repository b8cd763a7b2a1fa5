"""The `engine` backend: LLMEngine in this process, no server, as the baseline.

The engine is driven by a task on the benchmark's own event loop: it adds the
requests that arrived, runs one `step()`, hands the outputs to the waiting
requests, and yields so they (and new arrivals) run before the next step. One
thread only: a second thread stepping the engine would fight the client for
the GIL, and every hand-over can wait out the GIL's 5 ms switch interval
(that version measured well below the served stack at concurrency 64).
Outputs are stamped when their step ends. Output lengths are fixed with
`ignore_eos` and `min_tokens`.
"""

from __future__ import annotations

import asyncio
import time

from llmserve.bench.backends import Backend, _new_result, _Timer
from llmserve.bench.metrics import RequestResult, stats_counters
from llmserve.bench.workload import BenchRequest, Vocab
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.sampling_params import SamplingParams


class EngineBackend(Backend):
    name = "engine"

    def __init__(self, engine: LLMEngine, vocab: Vocab, temperature: float = 0.0, timeout: float = 300.0) -> None:
        super().__init__("", 0, vocab, temperature, timeout)
        self.engine = engine
        self.arrived: list[tuple[str, list[int], SamplingParams]] = []
        self.waiters: dict[str, asyncio.Queue] = {}

    async def start(self) -> None:
        self.wake = asyncio.Event()
        self.driver = asyncio.create_task(self._drive())

    async def close(self) -> None:
        self.driver.cancel()
        try:
            await self.driver
        except asyncio.CancelledError:
            pass

    async def _drive(self) -> None:
        eng = self.engine
        while True:
            arrived, self.arrived = self.arrived, []
            for rid, ids, params in arrived:
                try:
                    eng.add_request(rid, ids, params)
                except ValueError as e:
                    self._post(rid, e)
            if not eng.has_unfinished():
                self.wake.clear()
                await self.wake.wait()
                continue
            try:
                outs = eng.step()
            except Exception as e:  # the engine broke: fail what is in flight
                for rid in list(self.waiters):
                    eng.abort(rid)
                    self._post(rid, e)
                outs = []
            stamp = time.perf_counter()
            for out in outs:
                self._post(out.req_id, (out, stamp))
            await asyncio.sleep(0)  # let the requests take their outputs and new ones arrive

    async def counters(self, since: dict | None = None, tokens: int = 0) -> dict | None:
        return stats_counters(self.engine.stats())  # a step's counts are in before its outputs are posted

    def _post(self, rid: str, item: object) -> None:
        q = self.waiters.get(rid)
        if q is not None:
            q.put_nowait(item)

    async def send(self, req: BenchRequest, rid: str) -> RequestResult:
        res = _new_result(req)
        n = req.output_len
        params = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=self.temperature)
        q: asyncio.Queue = asyncio.Queue()
        self.waiters[rid] = q
        timer = _Timer(res)
        self.arrived.append((rid, list(req.prompt_ids), params))
        self.wake.set()
        try:
            while True:
                item = await asyncio.wait_for(q.get(), self.timeout)
                if isinstance(item, Exception):
                    res.fail(400 if isinstance(item, ValueError) else 500, str(item))
                    break
                out, stamp = item
                if out.new_token_ids:
                    timer.chunk(stamp)
                    res.output_len += len(out.new_token_ids)
                if out.finished:
                    if out.finish_reason == "abort":
                        res.fail(out.error or "abort", "aborted")
                    res.input_len = out.num_prompt_tokens
                    break
        except asyncio.TimeoutError:
            self.engine.abort(rid)
            res.fail("timeout", f"no answer within {self.timeout} s")
        finally:
            self.waiters.pop(rid, None)
        return timer.done(None if timer.first else timer.last)
