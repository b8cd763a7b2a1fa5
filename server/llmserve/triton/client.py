"""A minimal tritonclient gRPC client for the `model` (one native JSON in, a stream out).

    for msg in stream_generate("127.0.0.1:8811", {"text": "hello", "max_dec_len": 16}):
        print(msg["token"], end="")

Each message is a native streaming response; the last has `is_end: 1`. Many
requests may share one client (`TritonStream`), each on the same gRPC stream.
"""

from __future__ import annotations

import json
import queue
import threading
import uuid
from collections.abc import Iterator

import numpy as np
import tritonclient.grpc as grpcclient

from llmserve.serving.grpc_channel import channel_args
from llmserve.serving.tritonserver import MODEL_NAME


def _input(data: bytes) -> grpcclient.InferInput:
    inp = grpcclient.InferInput("IN", [1], "BYTES")
    inp.set_data_from_numpy(np.array([data], dtype=np.object_))
    return inp


class TritonStream:
    """One gRPC stream; `submit` returns a queue that receives the request's messages."""

    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url, channel_args=channel_args())
        self.queues: dict[str, queue.Queue] = {}
        self.lock = threading.Lock()
        self.client.start_stream(callback=self._on_response)

    def _on_response(self, result, error) -> None:
        if error is not None:
            # A stream-level error: hand it to everyone waiting.
            with self.lock:
                qs = list(self.queues.values())
            for q in qs:
                q.put({"is_end": 1, "error_code": 500, "error_msg": f"gRPC: {error}"})
            return
        msg = json.loads(result.as_numpy("OUT").reshape(-1)[0])
        rid = result.get_response().id
        with self.lock:
            q = self.queues.get(rid)
            if q is not None and msg.get("is_end"):
                del self.queues[rid]
        if q is not None:
            q.put(msg)

    def submit(self, body: dict) -> queue.Queue:
        body = dict(body)
        rid = str(body.setdefault("req_id", str(uuid.uuid4())))
        return self.submit_raw(json.dumps(body).encode(), rid)

    def submit_raw(self, data: bytes, rid: str = "", parameters: dict | None = None) -> queue.Queue:
        # The Triton request id routes responses; a duplicate native req_id gets its own.
        tid = f"{rid or uuid.uuid4()}#{uuid.uuid4().hex[:8]}"
        q: queue.Queue = queue.Queue()
        with self.lock:
            self.queues[tid] = q
        self.client.async_stream_infer(MODEL_NAME, [_input(data)], request_id=tid, parameters=parameters)
        return q

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def collect(q: queue.Queue, timeout: float = 60) -> list[dict]:
    """Every message of one submitted request, up to and including the one with `is_end`."""
    msgs = []
    while True:
        msgs.append(q.get(timeout=timeout))
        if msgs[-1].get("is_end"):
            return msgs


def stream_generate(url: str, body: dict, timeout: float = 600) -> Iterator[dict]:
    s = TritonStream(url)
    try:
        q = s.submit(body)
        while True:
            msg = q.get(timeout=timeout)
            yield msg
            if msg.get("is_end"):
                return
    finally:
        s.close()
