"""The Triton Python-backend model (decoupled): a thin adapter to the engine process.

`execute` reads the native JSON request from `IN`, registers the request's
response sender and hands the request to an IO thread, which owns the ZMQ link
to the engine process (ZMQ sockets are single-threaded). The IO thread turns
each engine message (one per step, all requests) into one `OUT` response per
request; the last carries TRITONSERVER_RESPONSE_COMPLETE_FINAL.

If the engine process dies, its connection drops and every request in flight
ends at once with an error response (code 500); while it is down new requests
get 503. If it sends nothing for CHECK_HEALTH_INTERVAL (hung), its requests end
with 500 too, and their aborts are queued on the link: should the engine
resume, it drops them instead of running them on for no one. Cancelled gRPC
streams abort their requests in the engine. If this stub dies (or tritonserver,
taking it along), the engine sees the link's connection close and aborts its
requests by itself.

This module must stay light: it runs in the Triton stub, not in the engine.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils
import zmq

from llmserve.config import Config
from llmserve.protocol import error_response
from llmserve.serving.ipc import EngineLink

log = logging.getLogger("llmserve.triton")

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# How often cancelled gRPC streams are looked for: each check asks Triton once per request in
# flight, so this trades abort latency (<= this) against IPC round trips.
CANCEL_CHECK_S = 0.1


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.cfg = Config.from_env()
        self.ctx = zmq.Context()
        self.senders: dict[str, object] = {}  # req_id -> response sender
        self.lock = threading.Lock()
        # execute() -> IO thread: an inproc pipe, the push end guarded by the lock.
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.bind("inproc://adapter")
        self.connected = False
        self.stop = threading.Event()
        self.ready = threading.Event()
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
            req_id = request.request_id() or None
            try:
                raw = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().reshape(-1)[0]
                body = json.loads(raw)
                if not isinstance(body, dict):
                    raise ValueError("the request must be a JSON object")
            except Exception as e:
                self._respond(sender, error_response(req_id, 400, f"IN must hold one JSON object: {e}"), final=True)
                continue
            req_id = str(body.get("req_id") or req_id or uuid.uuid4())
            body["req_id"] = req_id
            with self.lock:
                state = "dup" if req_id in self.senders else ("ok" if self.connected else "down")
                if state == "ok":
                    self.senders[req_id] = sender
                    self.push.send(json.dumps({"op": "add", "body": body}).encode())
            if state == "dup":
                self._respond(
                    sender, error_response(req_id, 409, f"req_id {req_id!r} is already in flight"), final=True
                )
            elif state == "down":
                self._respond(sender, error_response(req_id, 503, "the engine is not ready"), final=True)
        return None

    def finalize(self) -> None:
        self.stop.set()
        self.io.join(5)
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
            if link.sock in events:
                last_msg = now
                for msg in link.recv_all():
                    if msg.get("op") == "out":
                        self._deliver(msg["items"])
            if self.connected and now - last_msg > self.cfg.check_health_interval and self.senders:
                log.warning("no heartbeat from the engine for %.1f s", now - last_msg)
                # The connection is still up (a stopped or busy process keeps it): the aborts wait in
                # it and reach the engine if it resumes; if it is killed instead, they are dropped.
                # Adds still in the pipe go first, or an abort could overtake its request.
                failed = self._fail_all(500, "the engine is not responding")
                self._forward(pull, link)
                for req_id in failed:
                    link.send({"op": "abort", "req_id": req_id})
                last_msg = now
            if now >= next_cancel_check:
                self._check_cancelled(pull, link)
                next_cancel_check = now + CANCEL_CHECK_S
        pull.close(0)
        link.close()

    @staticmethod
    def _forward(pull, link: EngineLink) -> None:
        """execute()'s requests, from the inproc pipe to the engine."""
        while True:
            try:
                link.sock.send(pull.recv(zmq.NOBLOCK), zmq.NOBLOCK)
            except zmq.Again:
                break

    def _deliver(self, items: list[dict]) -> None:
        for item in items:
            final = bool(item.get("is_end"))
            with self.lock:
                sender = self.senders.pop(item["req_id"], None) if final else self.senders.get(item["req_id"])
            if sender is not None:
                self._respond(sender, item, final)

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
            self._respond(sender, error_response(req_id, code, msg), final=True)
        return list(senders)

    @staticmethod
    def _respond(sender, item: dict, final: bool) -> None:
        out = pb_utils.Tensor("OUT", np.array([json.dumps(item, ensure_ascii=False).encode()], dtype=np.object_))
        try:
            sender.send(pb_utils.InferenceResponse(output_tensors=[out]), flags=FINAL if final else 0)
        except Exception as e:  # the client went away
            log.debug("sending to %s failed: %s", item.get("req_id"), e)
