"""The engine core process: scheduler, runner and sampler in a tight loop, and nothing else.

The engine server (engine_server.py) spawns it and owns everything around it:
admission, tokenizing, detokenizing, stop strings, response formatting,
timeouts and clients. So the core's loop holds only what must be serial with
the device: take new requests and aborts, run `LLMEngine.step()` (which
overlaps the next step's scheduling with the device's current step), and send
ONE binary message per step with every request's new tokens.

The link is one ZMQ PAIR over loopback, msgpack messages:

server -> core
  {"op": "add", "req_id", "ids": [int], "params": {SamplingParams fields}, "arrival": float}
  {"op": "abort", "req_ids": [str]}      the server has ended them: no output is wanted
  {"op": "stop"}
core -> server
  {"op": "ready", "vocab_size", "max_model_len", "capacity_tokens"}    once, when loaded
  {"op": "step", "outs": [CoreOut, ...], "kv": KvLoad,       (core_records.py: named arrays)
   "adds": int,
   "spec": [verified, drafted, accepted, [drafted at j], [accepted at j]]}
                                   per step, and after taking in messages when idle; `adds`
                                   counts the add messages taken in so far; `spec` (only when
                                   it changed) is how speculative decoding's counters grew since
                                   the last message: request-steps that verified drafts, drafts
                                   proposed / accepted, and both per draft position j = 0..k-1
  {"op": "reject", "req_id", "msg", "duplicate": bool}                 an add the engine refused

  logprobs: [[logprob, [[token_id, logprob], ...]], ...], one per new token (top best first).
  prompt_logprobs: on a request's first output when asked for (params "prompt_logprobs": k), else None:
  [None, [logprob, [[token_id, logprob], ...]], ...], one per prompt token (the first has none), each the
  logprob of that prompt token given those before it, and the k best at that position.

The core dies with its server (PR_SET_PDEATHSIG), so a killed server leaves no core behind.
`CoreLink` is the server's side: it spawns the core and holds the socket.

Run: `python -m llmserve.serving.engine_core ENDPOINT` (the engine server does).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import time
from itertools import zip_longest

import zmq

from llmserve.config import Config
from llmserve.engine.heap import freeze_startup_objects
from llmserve.engine.llm_engine import DuplicateRequestError, LLMEngine
from llmserve.engine.output import RequestOutput
from llmserve.engine.sampling_params import SamplingParams
from llmserve.engine.speculative import SpecStats
from llmserve.serving import start_status
from llmserve.serving.arrival_wait import CAP_S, POLL_S, ArrivalWait
from llmserve.serving.core_records import CoreOut, KvLoad
from llmserve.serving.ipc import dumps, endpoint, loads
from llmserve.serving.start_status import LOAD_FAILED
from llmserve.utils.process import die_with_parent, exit_now

log = logging.getLogger("llmserve.engine_core")

IDLE_POLL_MS = 100
CORE_START_TIMEOUT_S = 1800.0  # loading a large checkpoint and capturing CUDA graphs takes minutes


class CoreLoadError(RuntimeError):
    """The core ended before it was ready; `code` is its exit status (LOAD_FAILED: it wrote why)."""

    def __init__(self, msg: str, code: int) -> None:
        super().__init__(msg)
        self.code = code


class CoreLink:
    """The engine core process and its PAIR socket."""

    def __init__(self, ctx: zmq.Context, env: dict[str, str] | None = None) -> None:
        self.sock = ctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        argv = [sys.executable, "-m", "llmserve.serving.engine_core", endpoint(port)]
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)
        self.info: dict = {}

    def wait_ready(self, timeout: float = CORE_START_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(200):
                msg = loads(self.sock.recv())
                if msg["op"] == "ready":
                    self.info = msg
                    return msg
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise CoreLoadError(f"the engine core {start_status.exit_reason(code)} while loading", code)
        raise RuntimeError(f"the engine core was not ready within {timeout:.0f} s")

    def send(self, msg: dict) -> None:
        self.sock.send(dumps(msg))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.alive():
            try:
                self.send({"op": "stop"})
                self.proc.wait(10)
            except (zmq.ZMQError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.sock.close(0)


def encode(out: RequestOutput) -> CoreOut:
    lps = [[lp.logprob, lp.top] for lp in out.logprobs] if out.logprobs else None
    plps = None
    if out.prompt_logprobs is not None:
        plps = [None if lp is None else [lp.logprob, lp.top] for lp in out.prompt_logprobs]
    return CoreOut(out.req_id, out.new_token_ids, out.finish_reason, out.num_cached_tokens, lps, out.error, plps)


def spec_counters(s: SpecStats) -> list:
    """Speculative decoding's counters as the step message carries them."""
    return [s.verified, s.drafted, s.accepted, list(s.drafted_at), list(s.accepted_at)]


def spec_sum(a: list | None, b: list | None, sign: int = 1) -> list | None:
    """a + sign * b, element by element, for spec_counters lists (None: all zeros)."""
    if b is None:
        return a
    a = a or [0, 0, 0, [], []]
    heads = [x + sign * y for x, y in zip(a[:3], b[:3])]
    return heads + [[x + sign * y for x, y in zip_longest(p, q, fillvalue=0)] for p, q in zip(a[3:], b[3:])]


class EngineCore:
    def __init__(self, engine: LLMEngine, sock: zmq.Socket) -> None:
        self.engine = engine
        self.sock = sock
        self.stopping = False
        self.adds = 0  # add messages taken in so far (the server's queue bound counts those in transit)
        self.spec = spec_counters(engine.spec_stats)  # as of the last step message (warm-up's are not sent)
        self.arrivals = ArrivalWait()  # how long to wait for finished requests' successors
        # During a wait: when its finishes left, and the adds since that reached the server after it
        # (an add that came earlier, taken in only now, is no successor of these finishes).
        self._since, self._fresh = math.inf, 0

    def serve(self) -> None:
        eng = self.engine
        parent = os.getppid()
        period, last = 0.0, None  # decayed seconds per step of back-to-back steps; the last step's end
        step_s = 0.0  # the last back-to-back step's own time
        while not self.stopping:
            took = self.sock.poll(0 if eng.has_unfinished() else IDLE_POLL_MS) and self._drain()
            busy = eng.has_unfinished()
            outs = eng.step() if busy else []
            t = time.perf_counter()
            if busy and last is not None:
                step_s = t - last
                period = step_s if not period else 0.8 * period + 0.2 * step_s
                self.arrivals.busy(step_s)
            if last is not None and not busy:  # a busy stretch ended
                stretch = self.arrivals.rest()
                if stretch.waits:
                    log.info("%s", stretch.summary())
            last = t if busy else None
            if outs or took or eng.has_unfinished():  # every step reports: it is the server's sign of progress
                bm, sch = eng.block_manager, eng.scheduler
                kv = KvLoad(len(sch.running), len(sch.waiting), bm.num_used, bm.num_blocks)
                msg = {"op": "step", "outs": [encode(o) for o in outs], "kv": kv, "adds": self.adds}
                if eng.spec_stats.verified != self.spec[0]:  # drafts were verified: their counts grew
                    now = spec_counters(eng.spec_stats)
                    msg["spec"], self.spec = spec_sum(now, self.spec, -1), now
                self.sock.send(dumps(msg))
                finished = sum(1 for o in outs if o.finished)
                if finished:
                    sent = time.monotonic()  # the clock of the server's `arrival` stamps
                    self.arrivals.finished(finished, sent)
                    if eng.step_in_flight:  # else the device would idle all the wait
                        free = eng.step_left()  # None: no step of its size seen yet
                        free = self.arrivals.free(min(period, step_s)) if free is None else min(CAP_S, free)
                        self._await_successors(finished, free, sent)
            elif os.getppid() != parent:  # the server is gone (belt and braces beside PDEATHSIG)
                break

    def _await_successors(self, finished: int, free: float, since: float) -> None:
        """Take in new requests until as many have come as just finished (at `since`, monotonic), for
        as long as the policy allows (arrival_wait.py): `free` seconds (the step in flight covers
        them), then, polling whether the device still has work, its extension out of the idle budget.
        Only requests that reached the server after the finishes count: requests that arrived while
        the step before ran and are taken in only now must not end the wait for the successors."""
        aw, stats = self.arrivals, self.arrivals.stats
        self._since, self._fresh = since, 0
        t0 = time.perf_counter()
        free_end, cap_end = t0 + free, t0 + CAP_S
        idle_from = None  # when the device was first seen with nothing to run
        stats.waits += 1
        extended = False
        while self._fresh < finished and not self.stopping:
            now = time.perf_counter()
            if now < free_end:
                timeout = free_end - now
            else:
                if idle_from is None and self.engine.step_done():
                    idle_from = now
                if now >= cap_end or not aw.may_extend(now - idle_from if idle_from is not None else 0.0):
                    break
                extended = True
                timeout = min(POLL_S, cap_end - now)
            if self.sock.poll(timeout * 1e3):
                self._drain()
        if idle_from is not None:
            aw.charge(time.perf_counter() - idle_from)
        stats.extended += extended
        stats.by_arrivals += self._fresh >= finished
        self._since = math.inf

    def _drain(self) -> bool:
        eng = self.engine
        took = False
        while True:
            try:
                msg = loads(self.sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return took
            took = True
            op = msg["op"]
            if op == "add":
                self.adds += 1
                self.arrivals.arrived(msg["arrival"])
                self._fresh += msg["arrival"] >= self._since
                try:
                    eng.add_request(msg["req_id"], msg["ids"], SamplingParams(**msg["params"]), msg["arrival"])
                except ValueError as e:
                    dup = isinstance(e, DuplicateRequestError)
                    self.sock.send(dumps({"op": "reject", "req_id": msg["req_id"], "msg": str(e), "duplicate": dup}))
            elif op == "abort":
                for req_id in msg["req_ids"]:
                    eng.abort(req_id, notify=False)
            elif op == "stop":
                self.stopping = True


def warmup(engine: LLMEngine, config: Config) -> None:
    """Run a few requests through every code path once before serving (USE_WARMUP=1)."""
    vocab = engine.runner.vocab_size
    n = max(1, min(64, engine.max_model_len // 4))
    for i in range(min(4, config.batch_size)):
        ids = [(7 * i + k) % vocab for k in range(n)]
        engine.add_request(
            f"warmup-{i}", ids, SamplingParams(max_tokens=8, temperature=0.0 if i % 2 else 0.8, ignore_eos=True)
        )
    while engine.has_unfinished():
        engine.step()


def load(config: Config) -> LLMEngine:
    """The model and its engine, warmed up (USE_WARMUP=1)."""
    from llmserve.serving.compose import engine_over, load_model

    log.info("loading the model %s (its weights; on a GPU also the KV cache and CUDA graphs)", config.model_dir)
    runner, tokenizer, model_dir = load_model(config)
    # No text here (the server's work): the tokenizer serves structured output's grammars only.
    log.info("setting up the engine (KV cache, sampler, speculative decoding)")
    engine = engine_over(config, runner, model_dir, grammar_tokenizer=tokenizer)
    if config.use_warmup:
        t1 = time.monotonic()
        log.info("warming up")
        warmup(engine, config)
        log.info("warm-up done in %.1f s", time.monotonic() - t1)
    return engine


def main() -> None:
    die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = Config.from_env()
    t0 = time.monotonic()
    phases = start_status.track(config.log_dir, "engine core")
    try:
        engine = load(config)
    except BaseException as e:  # noqa: BLE001 - a load that fails says why, in one line, and is not retried
        start_status.untrack(phases)  # the lines below are no phase
        log.exception("loading failed")
        start_status.fail(config.log_dir, start_status.one_line(e))
        exit_now(LOAD_FAILED)
    start_status.untrack(phases)
    frozen = freeze_startup_objects()
    log.info(
        "engine core ready in %.1f s (overlapped steps: %s; %d startup objects frozen)",
        time.monotonic() - t0,
        engine.overlap,
        frozen,
    )
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sys.argv[1])
    limits = {"vocab_size": engine.runner.vocab_size, "max_model_len": engine.max_model_len}
    sock.send(dumps({"op": "ready", "capacity_tokens": engine.capacity_tokens, **limits}))
    core = EngineCore(engine, sock)
    signal.signal(signal.SIGTERM, lambda *_: setattr(core, "stopping", True))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server stops us
    core.serve()
    sock.close(0)
    engine.shutdown()
    exit_now(0)


if __name__ == "__main__":
    main()
