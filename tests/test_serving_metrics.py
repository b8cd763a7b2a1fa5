"""The supervisor's metrics (no stack): a slow or dead Triton never delays a scrape, and the
llmserve_* metrics stay live while Triton's are served from the last good copy."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from llmserve.serving.metrics import EngineMetrics, TritonMetrics
from llmserve.serving.testing import wait_until


class FakeTriton:
    """A loopback /metrics whose answer and delay the test sets."""

    def __init__(self) -> None:
        self.body, self.delay = b"nv_inference_count 1\n", 0.0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_):
                pass

            def do_GET(self):
                time.sleep(fake.delay)
                body = fake.body
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake():
    f = FakeTriton()
    yield f
    f.close()


def stats(**kw) -> dict:
    msg = {"running": 0, "waiting": 0, "kv_blocks_used": 0, "kv_blocks_total": 8, "prompt_tokens": 0}
    return msg | {"generation_tokens": 0, "finished": [], "failed": []} | kw


def timed(f):
    t0 = time.monotonic()
    out = f()
    return out, time.monotonic() - t0


def test_slow_triton_never_delays_a_scrape_and_ours_stay_live(fake):
    engine = EngineMetrics()
    triton = TritonMetrics(fake.url, refresh=0.05, timeout=5.0, max_age=30.0).start()
    try:
        assert wait_until(lambda: b"nv_inference_count 1\n" in engine.exposition(triton))
        # Triton now takes 4 s per answer (2 s were seen on a busy 2-core machine) and has moved on.
        fake.delay, fake.body = 4.0, b"nv_inference_count 2\n"
        time.sleep(0.2)  # a slow fetch is under way
        for used in (3, 5, 0):
            engine.apply(stats(kv_blocks_used=used, cancelled=1))
            text, took = timed(lambda: engine.exposition(triton).decode())
            # Not a speed bound: a scrape that waited on the fetch would take the rest of its 4 s (3.8 s at the
            # first); one that does not takes milliseconds (1 s is a 10x margin over a slow one here).
            assert took < 1.0, took
            assert "nv_inference_count 1\n" in text  # the last good copy, first
            assert text.index("nv_inference_count") < text.index("llmserve_")
            assert f"llmserve_kv_blocks_used {used:.1f}" in text  # live, not from the copy's time
        assert "llmserve_request_cancelled_total 3.0" in text
        assert wait_until(lambda: b"nv_inference_count 2\n" in engine.exposition(triton), timeout=10)
    finally:
        triton.stop()


def test_triton_gone_is_dropped_after_max_age(fake):
    triton = TritonMetrics(fake.url, refresh=0.05, timeout=0.5, max_age=1.0).start()
    try:
        assert wait_until(lambda: triton.text() == b"nv_inference_count 1\n")
        fake.close()  # refused from now on
        t0 = time.monotonic()
        assert wait_until(lambda: b"unavailable" in triton.text())
        assert time.monotonic() - t0 > 0.5  # served the last copy for a while, then dropped it
        text = EngineMetrics().exposition(triton)
        assert text.startswith(b"# Triton metrics unavailable\n") and b"llmserve_" in text
    finally:
        triton.stop()
