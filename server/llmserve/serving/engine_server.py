"""The engine server: the engine's front process, behind a ZMQ ROUTER (see ipc.py for the wire).

It owns everything about a request except running it: admission (parsing, tokenizing,
limits, queue bound, duplicates), the text (incremental detokenizing, stop strings),
response formatting, timeouts and clients. The model runs in the engine core process
(engine_core.py), which it spawns and feeds pre-tokenized requests; the core sends
back one binary message per step with every request's new tokens. So the per-request
Python work of a step runs here, beside the device's next step, not before it.

Its loop never waits on a step: it polls the clients and the core, answers each
client with ONE message per round (every request's new items), sends heartbeats
every HEARTBEAT_S, and tells how long the core has had work without finishing a
step (`stalled`): a long step is not a hang, a step that makes no progress for
CHECK_HEALTH_INTERVAL is.

A client that is gone (its process died: a Triton stub, or tritonserver with
it) is noticed at the next send to it (ROUTER_MANDATORY: its routing id is no
longer routable), at the latest at the next heartbeat; its requests are aborted
then, freeing their KV blocks, instead of running on for no one. A message a
client cannot take yet (its queue is full) is kept and sent with the next round.

Run: `python -m llmserve.serving.engine_server` (the supervisor does).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator

import zmq

from llmserve.config import Config
from llmserve.engine.output_processor import TextState
from llmserve.protocol import cancelled_response, native
from llmserve.protocol.native import NativeError
from llmserve.serving import intake_trace, preflight, responses
from llmserve.serving.core_records import CoreOut, KvLoad
from llmserve.serving.engine_core import CoreLink, spec_sum
from llmserve.serving.ipc import HEARTBEAT_S, dumps, endpoint, loads
from llmserve.serving.responses import Live

log = logging.getLogger("llmserve.engine_server")

# A burst's bodies are parsed (and their texts encoded together) this many at a time, each slice admitted
# before the next is parsed: the core starts on the first requests while the rest are parsed (256 bodies
# of 512 ids took 18-41 ms to parse on a 2-core VM, all before the first was admitted).
ADMIT_SLICE = 16


def _request(rec) -> native.NativeRequest | Exception:
    """The request of a record from the adapter (or its 400: not a record)."""
    try:
        return native.from_record(rec)
    except Exception as e:  # noqa: BLE001 - answered in order, as a rejection
        return NativeError(native.BAD_REQUEST, f"not a request record: {e}")


class EngineServer:
    def __init__(self, config: Config, core: CoreLink, tokenizer, sock: zmq.Socket) -> None:
        self.cfg = config
        self.core = core
        self.tokenizer = tokenizer
        self.speller = responses.Speller(tokenizer)
        self.stream = not config.disable_streaming
        info = core.info
        self.vocab_size = info["vocab_size"]
        # The context a request may fill: MAX_SEQ_LEN, or less when the model or the KV cache holds less.
        self.context = min(config.max_seq_len, info["max_model_len"], info["capacity_tokens"])
        self.model_names = native.served_model_names(config.model_dir, config.served_model_name)
        self.live: dict[str, Live] = {}  # by req_id
        self.by_core_id: dict[str, Live] = {}
        self.next_core_id = 0
        self.adapters: set[bytes] = set()
        self.monitors: set[bytes] = set()
        self.outbox: dict[bytes, list[dict]] = {}
        self.kv = KvLoad(0, 0, 0, 0)  # the core's last
        self.adds_sent = self.core_adds = 0  # adds sent to the core / taken in by it (its last report)
        self.last_progress = time.monotonic()  # the core's last step, or when it last got work
        # Metric deltas since the last stats message.
        self.d_prompt = self.d_gen = 0
        self.d_spec: list | None = None  # speculative decoding's counters (the core's "spec"), None: zeros
        self.finished: list[list] = []  # [finish_reason, ttft, tpot, e2e]
        # Rounds that took step messages from the core, the step messages, and the seconds spent on
        # them (logged at shutdown): more steps than rounds means this loop fell behind the core.
        self.core_rounds, self.core_steps, self.core_s = 0, 0, 0.0
        self.failed: list[int] = []  # error codes
        self.cancelled = 0  # aborted by their client, by an adapter that gave up on them, or as its client died
        self.gone: set[bytes] = set()  # clients found unroutable (disconnected) since the last _reap
        self.stopping = False
        self.draining = False  # SIGUSR1 (the supervisor, on SIGTERM): finish what runs, refuse new work
        self.sock = sock
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(core.sock, zmq.POLLIN)
        self.next_hb = self.next_check = 0.0

    # ---- loop ------------------------------------------------------------------
    def serve(self) -> None:
        log.info("engine serving on %s (pid %d)", endpoint(self.cfg.inter_proc_port), os.getpid())
        while not self.stopping and self.run_once():
            pass
        self._shutdown()

    def run_once(self, timeout_ms: int = 50) -> bool:
        """One round: take what clients and the core sent, answer, expire, beat. False: the core died."""
        events = dict(self.poller.poll(timeout_ms))
        if self.sock in events:
            self._drain()
        if self.core.sock in events:
            self._from_core()
        now = time.monotonic()
        if now >= self.next_check:
            self._expire(now)
            if not self.core.alive():
                log.error("the engine core exited (code %s)", self.core.proc.returncode)
                return False
            self.next_check = now + 0.1
        self._flush()
        if now >= self.next_hb:
            self._heartbeat()
            self.next_hb = now + HEARTBEAT_S
        if self.gone:
            self._reap()
        return True

    def stalled(self, now: float) -> float:
        """Seconds the core has had work without finishing a step (0 when idle)."""
        return now - self.last_progress if self.live else 0.0

    # ---- clients -> core -------------------------------------------------------
    def _drain(self) -> None:
        msgs = []
        for _ in range(10_000):
            try:
                client, raw = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            msgs.append((client, loads(raw)))
        # A burst's prompts are parsed and encoded a slice at a time, each admitted in order as it is parsed.
        parsed = self._parse_slices([m["request"] for _, m in msgs if m.get("op") == "add"])
        for client, msg in msgs:
            op = msg.get("op")
            if op == "add":
                self._add(client, msg.get("req_id"), next(parsed))
            elif op == "abort":
                lv = self._end(msg["req_id"])
                if lv is None:
                    continue
                self.cancelled += 1
                if lv.client != client:  # another adapter asked (triton/model.py: _abort): its own ends it
                    self.outbox.setdefault(lv.client, []).append(cancelled_response(lv.req.req_id))
            elif op == "hello":
                (self.monitors if msg.get("role") == "monitor" else self.adapters).add(client)
                log.info("%s connected: %s", msg.get("role"), client.decode(errors="replace"))
                self.next_hb = 0.0  # stats now: the supervisor's readiness waits for the adapter count

    def _parse_slices(self, records: list) -> Iterator:
        """native.tokenize_burst's entries for `records`, ADMIT_SLICE at a time as they are taken."""
        for i in range(0, len(records), ADMIT_SLICE):
            yield from native.tokenize_burst([_request(r) for r in records[i : i + ADMIT_SLICE]], self.tokenizer)

    def _add(self, client: bytes, req_id: str | None, parsed) -> None:
        """Admit one request (answering a rejection at once) and hand it to the core: checked against the
        model's limits here, where they are known (its fields were checked where it entered: native.parse).
        `parsed` is native.tokenize_burst's entry for its record, `req_id` (beside it) names the rejection
        of a record that is not one."""
        try:
            if isinstance(parsed, Exception):
                raise parsed
            req, ids = parsed
            req_id = req.req_id
            if self.draining:
                raise NativeError(native.NOT_READY, "the server is shutting down: not taking new requests")
            if req_id in self.live:
                raise NativeError(native.DUPLICATE, f"req_id {req_id!r} is already in flight", "req_id")
            # Beyond the batch's BATCH_SIZE slots: a burst the core has not scheduled yet is not a queue.
            in_core = self.kv.running + self.kv.waiting + self.adds_sent - self.core_adds  # with those on the way
            queued = in_core - self.cfg.batch_size
            if queued >= self.cfg.max_cached_task_num:
                raise NativeError(
                    native.QUEUE_FULL, f"the queue is full (MAX_CACHED_TASK_NUM={self.cfg.max_cached_task_num})"
                )
            native.check_model(req.model, self.model_names)
            if isinstance(ids, Exception):  # the prompt's (a chat template's): after the checks above
                raise ids
            params = native.admit(req, ids, self.context, self.cfg.max_dec_len, self.vocab_size)
            now = time.monotonic()
            core_id = str(self.next_core_id + 1)
            msg = dumps({"op": "add", "req_id": core_id, "ids": ids, "params": params.as_dict(), "arrival": now})
        except NativeError as e:
            self._reject(client, req_id, e.code, e.msg, e.param)
            return
        except Exception as e:
            # A feature whose package is not installed here (preflight.py): 501 naming it, no traceback.
            if isinstance(e, ImportError) and (missing := preflight.request_error(e)) is not None:
                self._reject(client, req_id, preflight.NOT_IMPLEMENTED, missing)
                return
            log.exception("admitting %s failed", req_id)  # a bug: answer it, keep serving
            self._reject(client, req_id, native.INTERNAL, f"internal error: {e}")
            return
        if not self.live:
            self.last_progress = now  # the core was idle: its work starts now
        self.next_core_id += 1
        self.core.sock.send(msg)
        self.adds_sent += 1
        lv = Live(client, req, core_id, TextState(params, self.tokenizer), ids, now, now + req.timeout)
        if req.echo and req.prompt_logprobs is None:  # else it comes with the prompt's logprobs
            lv.prompt = self.speller.prompt(ids, None)
        self.live[req_id] = self.by_core_id[core_id] = lv
        self.d_prompt += len(ids)
        intake_trace.mark("server", req_id)

    def _end(self, req_id: str) -> Live | None:
        """Forget a request in flight and abort it in the core (which then sends nothing more for it)."""
        lv = self.live.pop(req_id, None)
        if lv is not None:
            del self.by_core_id[lv.core_id]
            self.core.send({"op": "abort", "req_ids": [lv.core_id]})
        return lv

    def _forget(self, lv: Live) -> None:
        """A request the core has ended (or refused): nothing to abort."""
        del self.live[lv.req.req_id], self.by_core_id[lv.core_id]

    def _reject(self, client: bytes, req_id: str | None, code: int, msg: str, param: str | None = None) -> None:
        self.failed.append(code)
        self.outbox.setdefault(client, []).append(native.error_response(req_id, code, msg, param))

    # ---- core -> clients -------------------------------------------------------
    def _from_core(self) -> None:
        t, steps = time.perf_counter(), self.core_steps
        while True:
            try:
                msg = loads(self.core.sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            op = msg["op"]
            if op == "step":
                self.core_steps += 1
                self.last_progress = time.monotonic()
                self.kv, self.core_adds = KvLoad._make(msg["kv"]), msg["adds"]
                self.d_spec = spec_sum(self.d_spec, msg.get("spec"))
                self._on_outputs(msg["outs"])
            elif op == "reject":
                lv = self.by_core_id.get(msg["req_id"])
                if lv is not None:
                    self._forget(lv)
                    code = native.DUPLICATE if msg["duplicate"] else native.BAD_REQUEST
                    self._reject(lv.client, lv.req.req_id, code, msg["msg"])
        if self.core_steps > steps:
            self.core_rounds += 1
            self.core_s += time.perf_counter() - t

    def _on_outputs(self, outs: list[list]) -> None:
        """The core's step outputs (core_records.CoreOut, carried as arrays)."""
        now = time.monotonic()
        for out in map(CoreOut._make, outs):
            lv = self.by_core_id.get(out.req_id)
            if lv is None:  # ended here already (stop string, cancel, timeout): its tokens are dropped
                continue
            req_id = lv.req.req_id
            reason, lps = out.finish_reason, out.logprobs  # reason: "stop" once a stop string ends it
            if reason == "abort":
                self._forget(lv)
                self._reject(lv.client, req_id, native.INTERNAL, out.error or "the engine aborted the request")
                continue
            if out.prompt_logprobs is not None:
                lv.prompt = self.speller.prompt(lv.prompt_ids, out.prompt_logprobs)
            # Token by token: a stop string ends the request at the token that completes it; tokens
            # after it are neither sent nor counted.
            logprobs, text_state = [], lv.text_state
            taken = 0
            for t in out.token_ids:
                if lps is not None:  # where its text starts: the same however the tokens were split
                    lp, top = lps[taken]
                    logprobs.append(self.speller.entry(t, lp, top, len(text_state.text)))
                taken += 1
                if text_state.append([t]) is not None:
                    reason = "stop"
                    self.core.send({"op": "abort", "req_ids": [out.req_id]})
                    break
            new_ids = out.token_ids[:taken]
            lv.num_output_tokens += taken
            self.d_gen += taken
            new_text = text_state.flush_text(finished=reason is not None)
            lv.text += new_text
            if not self.stream:  # the final message carries them all
                lv.token_ids += new_ids
                lv.logprobs += logprobs
            if lv.first_token_time is None and new_ids:
                lv.first_token_time = now
                intake_trace.mark("server_first", req_id)
            if reason is not None:
                self._forget(lv)
                self._send(
                    lv, responses.item(lv, self.stream, new_ids, new_text, logprobs, reason, out.num_cached_tokens)
                )
                n = lv.num_output_tokens
                ttft = (lv.first_token_time or now) - lv.arrival
                tpot = (now - lv.first_token_time) / (n - 1) if n > 1 and lv.first_token_time else None
                self.finished.append([reason, ttft, tpot, now - lv.arrival])
            elif self.stream and (new_ids or new_text or lv.prompt):
                self._send(
                    lv, responses.item(lv, self.stream, new_ids, new_text, logprobs, None, out.num_cached_tokens)
                )

    def _send(self, lv: Live, item: dict) -> None:
        self.outbox.setdefault(lv.client, []).append(item)

    def _expire(self, now: float) -> None:
        for req_id in [r for r, lv in self.live.items() if now >= lv.deadline]:
            lv = self._end(req_id)
            self._reject(lv.client, req_id, native.TIMEOUT, f"the request timed out after {lv.req.timeout:g} s")

    def _flush(self) -> None:
        kept = {}
        for client, items in self.outbox.items():
            if not self._to(client, {"op": "out", "items": items}):
                kept[client] = items  # its queue is full: sent with the next round, in order
        self.outbox = kept

    def _to(self, client: bytes, msg: dict) -> bool:
        """False when the client cannot take it now (its queue is full)."""
        try:
            self.sock.send_multipart([client, dumps(msg)], zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:  # its connection is gone: the process died
                self.gone.add(client)
        return True

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
                self._end(req_id)
            self.cancelled += len(orphans)
            log.log(
                logging.WARNING if orphans else logging.INFO,
                "client %s disconnected: aborted its %d request(s) in flight",
                client.decode(errors="replace"),
                len(orphans),
            )

    def _heartbeat(self) -> None:
        stalled = self.stalled(time.monotonic())
        # Also to whoever owns a request without having said hello: a dead owner is noticed here.
        for a in self.adapters | {lv.client for lv in self.live.values()}:
            self._to(a, {"op": "hb", "stalled": stalled})
        if not self.monitors:
            return
        msg = {
            "op": "stats",
            "pid": os.getpid(),
            "adapters": len(self.adapters),
            "live": len(self.live),
            "draining": self.draining,
            "stalled": stalled,
            **self.kv._asdict(),
            "prompt_tokens": self.d_prompt,
            "generation_tokens": self.d_gen,
            "finished": self.finished,
            "failed": self.failed,
            "cancelled": self.cancelled,
        }
        if self.d_spec:  # as the core's step messages carry it: absent when no drafts were verified
            msg["spec"] = self.d_spec
        for m in self.monitors:
            self._to(m, msg)
        self.d_prompt = self.d_gen = self.cancelled = 0
        self.finished, self.failed, self.d_spec = [], [], None

    def _shutdown(self) -> None:
        if self.core.alive():
            for req_id in list(self.live):
                lv = self._end(req_id)
                self._reject(lv.client, req_id, native.NOT_READY, "the server is shutting down")
        else:  # nothing to abort (a send to its PAIR socket would wait for ever): fail what it held at once
            for lv in list(self.live.values()):
                self._forget(lv)
                msg = "the engine core exited (restarting); the request was lost"
                self._reject(lv.client, lv.req.req_id, native.INTERNAL, msg)
        self._flush()
        log.info(
            "core messages: %d steps in %d rounds, %.1f s handling them", self.core_steps, self.core_rounds, self.core_s
        )
        self.sock.close(linger=500)
        self.core.close()
