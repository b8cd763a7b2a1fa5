"""The 5xx the HTTP front end answers itself (a bug before or during a stream, Triton unreachable) are
counted in llmserve_request_failure_total as the engine's are (serving/http_failures.py, issue 46.1)."""

from __future__ import annotations

from collections import Counter


def test_front_end_500s_are_counted_in_the_failure_metric(tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from llmserve.config import Config
    from llmserve.http.app import create_app
    from llmserve.serving import http_failures as failures
    from llmserve.serving.metrics import EngineMetrics

    class Broken:
        """A backend whose stream fails before its first item, or (after `good` items) in the middle."""

        def __init__(self, good: int) -> None:
            self.good = good

        async def ready(self) -> bool:
            return True

        async def close(self) -> None:
            pass

        async def stream(self, body: dict):
            for k in range(self.good):
                yield {"req_id": body["req_id"], "token": "x", "token_ids": [k], "is_end": 0, "error_code": 0}
            raise RuntimeError("a bug")

    monkeypatch.setenv(failures.SUPERVISOR_ENV, "4242")  # the files are named by the supervisor's pid
    monkeypatch.setattr(failures, "_counts", Counter())
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}
    for good, body, status in [
        (0, chat, 500),
        (0, {"text": "hi"}, 500),
        (2, chat | {"stream": True}, 200),  # the 200 is sent; the bug cuts the stream
    ]:
        app = create_app(Config(log_dir=str(tmp_path)), backend_factory=lambda cfg, g=good: Broken(g))
        with TestClient(app, raise_server_exceptions=False) as c:
            assert c.post("/v1/chat/completions", json=body).status_code == status
    # A Triton that cannot be reached: the front end's own 503 (the engine never saw the request).
    from llmserve.serving.testing import free_ports

    cfg = Config(log_dir=str(tmp_path), service_grpc_port=free_ports(1)[0])
    with TestClient(create_app(cfg), raise_server_exceptions=False) as c:
        assert c.post("/v1/chat/completions", json=chat).status_code == 503
    assert failures.totals(str(tmp_path), 4242) == {"500": 3, "503": 1}
    assert failures.totals(str(tmp_path), 4243) == {}  # another supervisor's stack counts its own
    metrics = EngineMetrics(str(tmp_path))
    monkeypatch.setattr("os.getpid", lambda: 4242)
    for _ in range(2):  # folded in once, however often scraped
        text = metrics.exposition().decode()
        assert 'llmserve_request_failure_total{error_code="500"} 3.0' in text, text
        assert 'llmserve_request_failure_total{error_code="503"} 1.0' in text, text
