"""The Triton Python-backend model (decoupled): a thin adapter to the engine process.

`execute` reads the request from `IN`: the HTTP front end's msgpack record (validated there: it carries
EDGE_TOKEN in RECORD_PARAM), or a direct gRPC client's native JSON, validated here, once
(protocol/native.py). It registers the request's response sender and hands the record to an IO thread,
which owns the ZMQ link to the engine process (ZMQ sockets are single-threaded). The engine sends one
message per step with every request's new tokens; the IO thread answers each request with `OUT`
responses, the last one carrying TRITONSERVER_RESPONSE_COMPLETE_FINAL, numbered by it (`send_idx`).
Within a turn, the responses of requests that end go first (`finals_first`): their clients send the next
request on them.

Coalescing: each turn of the IO loop takes every engine message waiting, and `coalesce` merges each
request's consecutive token items into one response (texts, token_ids and logprobs concatenated; the last
item's is_end, tokens_all, finish_reason, usage win). At pace that is one response per request and step;
when this thread falls behind, a request gets one response holding all its tokens so far, so the backlog
is cleared in one go. Nothing is dropped or reordered; an error item ends its request after the tokens
before it.

Health: the engine server sends a heartbeat every HEARTBEAT_S from its loop (which never waits on a step)
with `stalled`: how long the core has had work without finishing a step. The requests in flight end with
500 ("the engine is not responding") when nothing arrived for CHECK_HEALTH_INTERVAL, or when a heartbeat
says a step has made no progress for longer than that. Their aborts are queued on the link: should the
engine resume, it drops them. If the engine process dies, every request in flight ends at once with a 500;
while it is down new requests get 503. Cancelled gRPC streams abort their requests in the engine, and so
do abort requests (ABORT_PARAM: the HTTP front end's requests share one stream; the engine ends a request
that another instance of this model owns at that instance). If this stub dies (or tritonserver), the
engine sees the link close and aborts its requests by itself.

This module must stay light: it runs in the Triton stub, not in the engine.
The per-response path is one json.dumps; nothing else is done per token.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import sys
import threading
import time
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils
import zmq

from llmserve.config import Config
from llmserve.protocol import ABORT_PARAM, RECORD_PARAM, cancelled_response, error_response
from llmserve.serving import intake_trace
from llmserve.serving.ipc import EngineLink, dumps, loads

log = logging.getLogger("llmserve.triton")

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# How often cancelled gRPC streams are looked for: each check asks Triton once per request in
# flight, so this trades abort latency (<= this) against IPC round trips.
CANCEL_CHECK_S = 0.1
FORWARD_EVERY = 8  # responses sent between two looks for new requests to forward (_deliver)
# The IO thread runs Python for ~0.2 ms a response; execute() (Triton's thread) needs the GIL to hand a
# new request over. At the default 5 ms switch interval it could wait that long for it.
GIL_SWITCH_S = 0.001
_LISTS = ("token_ids", "logprobs")


def coalesce(items: list[dict]) -> list[dict]:
    """Merge each request's consecutive token items into one, in the order of first appearance.

    A merged item holds the concatenated `token` texts, `token_ids` and `logprobs`; every
    other field (is_end, tokens_all, finish_reason, usage, ...) is the last item's. An item
    with is_end or an error_code ends its request's group: an error stays an item of its own,
    after the tokens merged before it, and whatever follows with the same req_id starts anew.
    The input items are not modified (a merged item is a copy).
    """
    out: list[dict] = []
    groups: dict = {}  # req_id -> [index in out, copied?] of its open (not final) group
    for item in items:
        rid = item.get("req_id")
        g = groups.get(rid)
        if item.get("error_code"):
            if g is not None:
                del groups[rid]
            out.append(item)
            continue
        if g is None:
            if not item.get("is_end"):
                groups[rid] = [len(out), False]
            out.append(item)
            continue
        m = out[g[0]]
        if not g[1]:  # copy before the first merge: the caller's items stay as they were
            m = out[g[0]] = dict(m)
            for k in _LISTS:
                if k in m:
                    m[k] = list(m[k])
            g[1] = True
        text = m.get("token", "")
        for k, v in item.items():
            if k in _LISTS:
                if v:
                    m.setdefault(k, []).extend(v)
            else:
                m[k] = v
        m["token"] = text + item.get("token", "")
        if item.get("is_end"):
            del groups[rid]
    return out


def finals_first(items: list[dict]) -> list[dict]:
    """The items of requests that end in this batch first (each request's items in their order).

    Sending a response waits for tritonserver to take it (~0.15 ms); at 64 streams a stub that is a
    few ms. A client whose request ended sends its next one on the final response, and the engine
    waits a little for such successors (serving/arrival_wait.py): the finals should not queue
    behind other streams' tokens."""
    ending = {i.get("req_id") for i in items if i.get("is_end") or i.get("error_code")}
    if not ending or len(ending) == len(items):
        return items
    return [i for i in items if i.get("req_id") in ending] + [i for i in items if i.get("req_id") not in ending]


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        sys.setswitchinterval(GIL_SWITCH_S)
        self.cfg = Config.from_env()
        self.token = self.cfg.edge_token  # the HTTP front end's: its records are not validated again
        self.ctx = zmq.Context()
        self.senders: dict[str, object] = {}  # req_id -> response sender
        self.send_idx: dict[str, int] = {}  # req_id -> its next send_idx (IO thread only)
        self.lock = threading.Lock()
        # execute() -> IO thread: an inproc pipe, the push end guarded by the lock.
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.bind("inproc://adapter")
        self.connected = False
        self.stop = threading.Event()
        self.ready = threading.Event()
        # The IO thread's work, logged when the model is unloaded: where a stream's tokens get merged.
        self.io_stats = dict(rounds=0, items=0, responses=0, deliver_s=0.0, cancel_checks=0, cancel_s=0.0)
        self.io = threading.Thread(target=self._io_loop, name="llmserve-io", daemon=True)
        self.io.start()
        self.ready.wait(5)
        # Report the model ready only once the engine link is up (when the engine is), so
        # that a restarted Triton does not take requests before it can forward them.
        deadline = time.monotonic() + 10
        while not self.connected and time.monotonic() < deadline:
            time.sleep(0.05)
        log.info("adapter up: engine at 127.0.0.1:%d", self.cfg.inter_proc_port)

    # ---- Triton entry points ------------------------------------------------
    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            req_id = request.request_id() or str(uuid.uuid4())
            try:
                raw = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().reshape(-1)[0]
                params = request.parameters() or ""
                if ABORT_PARAM in params:
                    body = json.loads(raw)
                    self._abort(sender, body.get("req_id") if isinstance(body, dict) else None)
                    continue
                if RECORD_PARAM in params:  # the HTTP front end's: validated there when it holds our token
                    rec = loads(raw)
                    trusted = self.token and hmac.compare_digest(str(json.loads(params)[RECORD_PARAM]), self.token)
                    rec, refused = (rec, None) if trusted else self._edge(rec, req_id)
                else:  # a direct gRPC client's JSON: checked here, once
                    rec, refused = self._edge(json.loads(raw), req_id)
                if refused is not None:
                    self._respond(sender, refused, final=True)
                    continue
                req_id = rec["req_id"]
                intake_trace.mark("adapter", req_id)
                msg = dumps({"op": "add", "req_id": req_id, "request": rec})
            except Exception as e:  # not JSON (or msgpack) at all
                self._respond(sender, error_response(req_id, 400, f"IN must hold one JSON object: {e}"), final=True)
                continue
            with self.lock:
                state = "dup" if req_id in self.senders else ("ok" if self.connected else "down")
                if state == "ok":
                    self.senders[req_id] = sender
                    self.push.send(msg)
            if state == "dup":
                self._respond(
                    sender, error_response(req_id, 409, f"req_id {req_id!r} is already in flight"), final=True
                )
            elif state == "down":
                self._respond(sender, error_response(req_id, 503, "the engine is not ready"), final=True)
        return None

    @staticmethod
    def _edge(body, req_id: str) -> tuple[dict | None, dict | None]:
        from llmserve.protocol.native import edge_record  # pydantic: direct gRPC clients' requests only

        return edge_record(body, req_id)

    def _abort(self, sender, req_id) -> None:
        """An abort request (ABORT_PARAM): handed to the IO thread through the pipe, so after this
        instance's own add of it, and so that only the IO thread answers requests in flight (two threads
        sending on one response sender crashed tritonserver with SIGBUS): see `_abort_in_flight`."""
        if isinstance(req_id, str) and req_id:
            with self.lock:
                if self.connected:
                    self.push.send_multipart([b"abort", req_id.encode()])
        try:
            sender.send(flags=FINAL)  # nothing to answer: an empty final response
        except Exception:
            pass

    def finalize(self) -> None:
        self.stop.set()
        self.io.join(5)
        st = self.io_stats
        log.info(
            "adapter IO: %d rounds with outputs, %d items -> %d responses, %.1f s delivering; %d cancel checks, %.1f s",
            st["rounds"],
            st["items"],
            st["responses"],
            st["deliver_s"],
            st["cancel_checks"],
            st["cancel_s"],
        )
        self._fail_all(503, "the server is shutting down")

    # ---- IO thread -------------------------------------------------------------
    def _io_loop(self) -> None:
        link = EngineLink(self.cfg.inter_proc_port, "adapter", f"triton-{os.getpid()}-{uuid.uuid4().hex[:6]}", self.ctx)
        pull = self.ctx.socket(zmq.PULL)
        pull.connect("inproc://adapter")
        poller = zmq.Poller()
        link.register(poller)
        poller.register(pull, zmq.POLLIN)
        self.ready.set()
        limit = self.cfg.check_health_interval
        last_msg = time.monotonic()
        next_cancel_check = 0.0
        while not self.stop.is_set():
            events = dict(poller.poll(100))
            now = time.monotonic()
            if link.monitor in events:
                for ev in link.events():
                    if ev == "connected":
                        last_msg = now
                        with self.lock:
                            self.connected = True
                        log.info("engine connected")
                    else:
                        with self.lock:
                            self.connected = False
                        log.warning("engine disconnected: failing %d requests in flight", len(self.senders))
                        self._fail_all(500, "the engine process died; the request was lost")
            if pull in events:
                self._forward(pull, link)
            hung = None
            if link.sock in events:
                msgs = link.recv_all()
                if msgs:
                    last_msg = now
                items: list[dict] = []
                stalled = 0.0  # the latest word: a heartbeat's `stalled`, or an output (a step ended)
                for msg in msgs:
                    op = msg.get("op")
                    if op == "out":
                        items += msg["items"]
                        stalled = 0.0
                    elif op == "hb":
                        stalled = msg.get("stalled") or 0.0
                if items:
                    t = time.perf_counter()
                    self._deliver(items, lambda: self._forward(pull, link))
                    st = self.io_stats
                    st["rounds"] += 1
                    st["items"] += len(items)
                    st["deliver_s"] += time.perf_counter() - t
                if stalled > limit:
                    hung = f"the engine is not responding (a step has made no progress for {stalled:.1f} s)"
            if not hung and self.connected and now - last_msg > limit and self.senders:
                hung = "the engine is not responding"
                last_msg = now  # requests that come next get their own CHECK_HEALTH_INTERVAL
            if hung and self.senders:
                log.warning("%s: failing %d request(s) in flight", hung, len(self.senders))
                # The connection is still up (a stopped or stuck process keeps it): the aborts wait in
                # it and reach the engine if it resumes; if it is killed instead, they are dropped.
                # Adds still in the pipe go first, or an abort could overtake its request.
                failed = self._fail_all(500, hung)
                self._forward(pull, link)
                for req_id in failed:
                    link.send({"op": "abort", "req_id": req_id})
            if now >= next_cancel_check:
                t = time.perf_counter()
                self._check_cancelled(pull, link)
                self.io_stats["cancel_checks"] += 1
                self.io_stats["cancel_s"] += time.perf_counter() - t
                next_cancel_check = now + CANCEL_CHECK_S
        pull.close(0)
        link.close()

    def _forward(self, pull, link: EngineLink) -> None:
        """execute()'s requests, from the inproc pipe to the engine (an abort: `_abort_in_flight`)."""
        while True:
            try:
                frames = pull.recv_multipart(zmq.NOBLOCK)
                if len(frames) == 1:
                    link.sock.send(frames[0], zmq.NOBLOCK)
                else:
                    self._abort_in_flight(frames[1].decode(), link)
            except zmq.Again:
                break

    def _abort_in_flight(self, req_id: str, link: EngineLink) -> None:
        """The engine aborts `req_id`; a request of this instance's ends here with CANCELLED, one of
        another instance's there, when the engine tells it (engine_server.py)."""
        with self.lock:
            sender = self.senders.pop(req_id, None)
        link.send({"op": "abort", "req_id": req_id})
        if sender is not None:
            self.send_idx.pop(req_id, None)
            self._respond(sender, cancelled_response(req_id), final=True)

    def _deliver(self, items: list[dict], forward) -> None:
        """Send the engine's items, merged per request (see `coalesce`), each numbered (send_idx).
        `forward()`, every FORWARD_EVERY responses: execute()'s requests that came meanwhile go on to
        the engine at once, not after the round (~0.2 ms a response: at 64 streams a round is ~14 ms,
        and the requests that follow the finals sent first come within it)."""
        out, merged = [], finals_first(coalesce(items))
        with self.lock:
            for item in merged:
                rid = item.get("req_id")
                final = bool(item.get("is_end") or item.get("error_code"))
                sender = self.senders.pop(rid, None) if final else self.senders.get(rid)
                if sender is not None:
                    out.append((sender, item, final))
                elif rid is None:  # others are for requests that ended here (cancelled, failed)
                    log.warning("an engine reply with no req_id cannot be routed: %s", item.get("error_msg"))
        idx = self.send_idx
        for n, (sender, item, final) in enumerate(out, 1):
            rid = item["req_id"]
            if item.get("error_code"):  # an error has no send_idx (as the engine's own rejections)
                idx.pop(rid, None)
            else:
                item["send_idx"] = idx.pop(rid, 0) if final else idx.get(rid, 0)
                if not final:
                    idx[rid] = item["send_idx"] + 1
            self._respond(sender, item, final)
            if n % FORWARD_EVERY == 0:
                forward()
        self.io_stats["responses"] += len(out)

    def _check_cancelled(self, pull, link: EngineLink) -> None:
        with self.lock:
            senders = list(self.senders.items())
        # is_cancelled() asks the Triton process: keep it outside the lock execute() needs.
        cancelled = []
        for r, s in senders:
            try:
                if s.is_cancelled():
                    cancelled.append((r, s))
            except Exception:  # a sender that finished meanwhile
                pass
        with self.lock:
            cancelled = [(r, s) for r, s in cancelled if self.senders.pop(r, None) is s]
        if cancelled:
            log.info("%d request(s) cancelled by the client: aborting them", len(cancelled))
            self._forward(pull, link)  # an abort must not overtake its request's add
        for req_id, sender in cancelled:
            self.send_idx.pop(req_id, None)
            link.send({"op": "abort", "req_id": req_id})
            try:
                sender.send(flags=FINAL)
            except Exception:
                pass

    def _fail_all(self, code: int, msg: str) -> list[str]:
        """End every request in flight with an error; returns their req_ids."""
        with self.lock:
            senders, self.senders = self.senders, {}
        for req_id, sender in senders.items():
            self.send_idx.pop(req_id, None)
            self._respond(sender, error_response(req_id, code, msg), final=True)
        return list(senders)

    @staticmethod
    def _respond(sender, item: dict, final: bool) -> None:
        out = pb_utils.Tensor("OUT", np.array([json.dumps(item, ensure_ascii=False).encode()], dtype=np.object_))
        try:
            sender.send(pb_utils.InferenceResponse(output_tensors=[out]), flags=FINAL if final else 0)
        except Exception as e:  # the client went away
            log.debug("sending to %s failed: %s", item.get("req_id"), e)
