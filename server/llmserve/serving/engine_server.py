"""The engine process: LLMEngine behind a ZMQ ROUTER (see ipc.py for the wire).

One thread runs everything, in a loop: take new requests and aborts, run one
engine step, send each client ONE message with every request's new tokens,
expire timed-out requests, and send heartbeats. Admission (parsing, limits,
queue bound, duplicates) happens here, so every front end gets the same errors.

A client that is gone (its process died: a Triton stub, or tritonserver with
it) is noticed at the next send to it (ROUTER_MANDATORY: its routing id is no
longer routable), at the latest at the next heartbeat; its requests are aborted
then, freeing their KV blocks, instead of running on for no one.

Run: `python -m llmserve.serving.engine_server` (the supervisor does).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field

import zmq

from llmserve.config import Config
from llmserve.engine.llm_engine import DuplicateRequestError, LLMEngine, build_engine
from llmserve.engine.output import RequestOutput
from llmserve.protocol import native
from llmserve.protocol.native import NativeError
from llmserve.serving.ipc import HEARTBEAT_S, dumps, endpoint, loads

log = logging.getLogger("llmserve.engine_server")


@dataclass
class Live:
    """A request in flight: who asked, and what was sent so far."""

    client: bytes
    req: native.NativeRequest
    num_prompt_tokens: int
    arrival: float
    deadline: float
    send_idx: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # without streaming only (sent at the end)
    logprobs: list[dict] = field(default_factory=list)  # the same, when asked: one entry per token
    first_token_time: float | None = None


class EngineServer:
    def __init__(self, config: Config, engine: LLMEngine) -> None:
        self.cfg = config
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.stream = not config.disable_streaming
        self.limit_tokens = min(engine.max_model_len, engine.capacity_tokens)
        self.live: dict[str, Live] = {}
        self.adapters: set[bytes] = set()
        self.monitors: set[bytes] = set()
        self.outbox: dict[bytes, list[dict]] = {}
        # Metric deltas since the last stats message.
        self.d_prompt = self.d_gen = 0
        self.finished: list[list] = []  # [finish_reason, ttft, tpot, e2e]
        self.failed: list[int] = []  # error codes
        self.cancelled = 0  # aborted by their client, by an adapter that gave up on them, or as its client died
        self.gone: set[bytes] = set()  # clients found unroutable (disconnected) since the last _reap
        self.stopping = False
        self.draining = False  # SIGUSR1 (the supervisor, on SIGTERM): finish what runs, refuse new work
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # A send to a client whose connection is gone raises EHOSTUNREACH instead of vanishing: that is
        # how a dead client (a killed Triton stub) is noticed, and its requests aborted (see _reap).
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)

    # ---- loop ------------------------------------------------------------------
    def serve(self) -> None:
        self.sock.bind(endpoint(self.cfg.inter_proc_port))
        log.info("engine serving on %s (pid %d)", endpoint(self.cfg.inter_proc_port), os.getpid())
        next_hb = next_expiry = 0.0
        while not self.stopping:
            busy = self.engine.has_unfinished()
            if self.sock.poll(0 if busy else 50):
                self._drain()
            if self.engine.has_unfinished():
                self._on_outputs(self.engine.step())
            now = time.monotonic()
            if now >= next_expiry:
                self._expire(now)
                next_expiry = now + 0.1
            self._flush()
            if now >= next_hb:
                self._heartbeat()
                next_hb = now + HEARTBEAT_S
            if self.gone:
                self._reap()
        self._shutdown()

    def _drain(self) -> None:
        waiting = self.engine.stats().waiting
        for _ in range(10_000):
            try:
                client, raw = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = loads(raw)
            op = msg.get("op")
            if op == "add":
                waiting += self._add(client, msg["body"], waiting)
            elif op == "abort":
                if self.live.pop(msg["req_id"], None) is not None:
                    self.engine.abort(msg["req_id"], "cancelled by the client")
                    self.cancelled += 1
            elif op == "hello":
                (self.monitors if msg.get("role") == "monitor" else self.adapters).add(client)
                log.info("%s connected: %s", msg.get("role"), client.decode(errors="replace"))

    def _add(self, client: bytes, body: dict, waiting: int) -> int:
        """Admit one request; returns 1 when it was queued, 0 when rejected."""
        req_id = body.get("req_id") if isinstance(body, dict) else None
        try:
            req = native.parse(body)
            req_id = req.req_id
            if self.draining:
                raise NativeError(native.NOT_READY, "the server is shutting down: not taking new requests")
            if req_id in self.live:
                raise NativeError(native.DUPLICATE, f"req_id {req_id!r} is already in flight")
            if waiting >= self.cfg.max_cached_task_num:
                raise NativeError(
                    native.QUEUE_FULL, f"the queue is full (MAX_CACHED_TASK_NUM={self.cfg.max_cached_task_num})"
                )
            ids = native.prompt_token_ids(req, self.tokenizer)
            params = native.admit(req, len(ids), self.cfg.max_seq_len, self.cfg.max_dec_len)
            if len(ids) >= self.limit_tokens:  # the model or the KV cache is smaller than MAX_SEQ_LEN
                limit = self.limit_tokens - 1
                raise NativeError(
                    native.TOO_LONG, f"the input has {len(ids)} tokens; this engine serves at most {limit}"
                )
            now = time.monotonic()
            self.engine.add_request(req_id, ids, params, arrival_time=now)
        except NativeError as e:
            self._reject(client, req_id, e.code, e.msg)
            return 0
        except DuplicateRequestError as e:
            self._reject(client, req_id, native.DUPLICATE, str(e))
            return 0
        except ValueError as e:
            self._reject(client, req_id, native.BAD_REQUEST, str(e))
            return 0
        except Exception as e:  # a bug: answer it, keep serving
            log.exception("admitting %s failed", req_id)
            self._reject(client, req_id, native.INTERNAL, f"internal error: {e}")
            return 0
        self.live[req_id] = Live(client, req, len(ids), now, now + req.timeout)
        self.d_prompt += len(ids)
        return 1

    def _reject(self, client: bytes, req_id: str | None, code: int, msg: str) -> None:
        self.failed.append(code)
        self.outbox.setdefault(client, []).append(native.error_response(req_id, code, msg))

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            lv = self.live.get(out.req_id)
            if lv is None:  # aborted by us (cancel, timeout): already answered
                continue
            self.d_gen += len(out.new_token_ids)
            lv.text += out.new_text
            logprobs = [
                {"token_id": t, "logprob": lp.logprob, "top": lp.top}
                for t, lp in zip(out.new_token_ids, out.logprobs or ())
            ]
            if not self.stream:  # the final message carries them all
                lv.token_ids += out.new_token_ids
                lv.logprobs += logprobs
            if lv.first_token_time is None and out.new_token_ids:
                lv.first_token_time = now
            if out.finished and out.finish_reason == "abort":
                del self.live[out.req_id]
                self._reject(lv.client, out.req_id, native.INTERNAL, out.error or "the engine aborted the request")
            elif out.finished:
                del self.live[out.req_id]
                self._send(lv, out, logprobs)
                n = out.num_output_tokens
                ttft = (lv.first_token_time or now) - lv.arrival
                tpot = (now - lv.first_token_time) / (n - 1) if n > 1 and lv.first_token_time else None
                self.finished.append([out.finish_reason or "stop", ttft, tpot, now - lv.arrival])
            elif self.stream and (out.new_token_ids or out.new_text):
                self._send(lv, out, logprobs)

    def _send(self, lv: Live, out: RequestOutput, logprobs: list[dict]) -> None:
        """One message: this output's tokens (and their logprobs) when streaming, else all of them."""
        stream = self.stream
        item = {
            "req_id": out.req_id,
            "token": out.new_text if stream else lv.text,
            "token_ids": out.new_token_ids if stream else lv.token_ids,
            "is_end": int(out.finished),
            "send_idx": lv.send_idx,
            "error_code": 0,
            "error_msg": "",
        }
        if lv.req.logprobs is not None:  # an entry per token
            item["logprobs"] = logprobs if stream else lv.logprobs
        if out.finished:
            item["tokens_all"] = lv.text
            item["finish_reason"] = out.finish_reason
            if lv.req.return_usage:
                item["usage"] = native.usage(lv.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
        lv.send_idx += 1
        self.outbox.setdefault(lv.client, []).append(item)

    def _expire(self, now: float) -> None:
        for req_id in [r for r, lv in self.live.items() if now >= lv.deadline]:
            lv = self.live.pop(req_id)
            self.engine.abort(req_id, "timeout")
            self._reject(lv.client, req_id, native.TIMEOUT, f"the request timed out after {lv.req.timeout:g} s")

    def _flush(self) -> None:
        for client, items in self.outbox.items():
            self._to(client, {"op": "out", "items": items})
        self.outbox.clear()

    def _to(self, client: bytes, msg: dict) -> None:
        try:
            self.sock.send_multipart([client, dumps(msg)], zmq.NOBLOCK)
        except zmq.Again:
            pass  # its queue is full (SNDHWM): dropped
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:  # its connection is gone: the process died
                self.gone.add(client)

    def _reap(self) -> None:
        """Forget the clients that are gone and abort their requests: no one will read the output.

        Only a closed connection makes a routing id unroutable; a client restarted (a new Triton
        stub) has a new one, so its requests are never among these."""
        gone, self.gone = self.gone, set()
        for client in gone:
            self.adapters.discard(client)
            self.monitors.discard(client)
            self.outbox.pop(client, None)
            orphans = [r for r, lv in self.live.items() if lv.client == client]
            for req_id in orphans:
                del self.live[req_id]
                self.engine.abort(req_id, "the client is gone")
            self.cancelled += len(orphans)
            log.log(
                logging.WARNING if orphans else logging.INFO,
                "client %s disconnected: aborted its %d request(s) in flight",
                client.decode(errors="replace"),
                len(orphans),
            )

    def _heartbeat(self) -> None:
        # Also to whoever owns a request without having said hello: a dead owner is noticed here.
        for a in self.adapters | {lv.client for lv in self.live.values()}:
            self._to(a, {"op": "hb"})
        if not self.monitors:
            return
        st = self.engine.stats()
        msg = {
            "op": "stats",
            "pid": os.getpid(),
            "adapters": len(self.adapters),
            "live": len(self.live),
            "draining": self.draining,
            "running": st.running,
            "waiting": st.waiting,
            "kv_blocks_used": st.kv_blocks_used,
            "kv_blocks_total": st.kv_blocks_total,
            "prompt_tokens": self.d_prompt,
            "generation_tokens": self.d_gen,
            "finished": self.finished,
            "failed": self.failed,
            "cancelled": self.cancelled,
        }
        for m in self.monitors:
            self._to(m, msg)
        self.d_prompt = self.d_gen = self.cancelled = 0
        self.finished, self.failed = [], []

    def _shutdown(self) -> None:
        for req_id, lv in list(self.live.items()):
            self.engine.abort(req_id, "shutdown")
            self._reject(lv.client, req_id, native.NOT_READY, "the server is shutting down")
        self.live.clear()
        self._flush()
        self.sock.close(linger=500)
        self.engine.shutdown()


def warmup(engine: LLMEngine, config: Config) -> None:
    """Run a few requests through every code path once before serving (USE_WARMUP=1)."""
    from llmserve.engine.sampling_params import SamplingParams

    vocab = engine.runner.vocab_size
    n = max(1, min(64, engine.max_model_len // 4))
    for i in range(min(4, config.batch_size)):
        ids = [(7 * i + k) % vocab for k in range(n)]
        engine.add_request(
            f"warmup-{i}", ids, SamplingParams(max_tokens=8, temperature=0.0 if i % 2 else 0.8, ignore_eos=True)
        )
    while engine.has_unfinished():
        engine.step()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = Config.from_env()
    t0 = time.monotonic()
    engine = build_engine(config)
    if config.use_warmup:
        t1 = time.monotonic()
        warmup(engine, config)
        log.info("warm-up done in %.1f s", time.monotonic() - t1)
    log.info("engine ready in %.1f s", time.monotonic() - t0)
    server = EngineServer(config, engine)

    def stop(*_):
        server.stopping = True

    def drain(*_):
        server.draining = True
        log.info("draining: new requests get 503, %d in flight finish", len(server.live))

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGUSR1, drain)
    server.serve()


if __name__ == "__main__":
    main()
