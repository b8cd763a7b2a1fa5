"""The supervisor's HTTP servers: health probes in KServe v2 shape (HEALTH_HTTP_PORT) and metrics.

HEALTH_HTTP_PORT answers GET (and HEAD) only; inference goes to Triton's gRPC port:

- /v2/health/live: 200 while the supervisor runs.
- /v2/health/ready, /v2/models/{model}/ready, /v2/models/{model}/versions/{v}/ready: 200 when
  Triton, the model and the engine are all up, else 500 {"error", "error_code", "error_msg"}
  with error_code 1 not ready | 2 engine down | 3 engine hung (`error` for KServe clients such
  as tritonclient.http, the two native keys as documented before).
- /v2: server metadata {"name", "version", "extensions"}.
- /v2/models/{model}[/versions/{v}]: model metadata {"name", "versions", "platform", "inputs",
  "outputs"}, as Triton reports it (503 until Triton has served it once).
- anything else: KServe's {"error": "..."}: 404 for an unknown model, version or path, 405
  for another method. tritonclient.http reads `error` from every non-200 answer.
"""

from __future__ import annotations

import json
import re
from http.server import BaseHTTPRequestHandler
from typing import Any, Protocol
from urllib.parse import unquote

import llmserve


class Probed(Protocol):
    """What the probes read of the process that serves them (serving/supervisor.py's Supervisor)."""

    model_name: str
    model_versions: Any
    model_metadata: dict | None
    metrics: Any
    triton_metrics: Any

    def health(self) -> tuple[int, str]: ...


SERVER_NAME = "llmserve"
_MODEL_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?(/ready)?$")


def model_metadata(meta) -> dict:
    """Triton's gRPC ModelMetadataResponse in KServe's HTTP/JSON shape (shapes as numbers, not strings)."""

    def tensors(ts) -> list[dict]:
        return [{"name": t.name, "datatype": t.datatype, "shape": [int(d) for d in t.shape]} for t in ts]

    return {
        "name": meta.name,
        "versions": list(meta.versions),
        "platform": meta.platform,
        "inputs": tensors(meta.inputs),
        "outputs": tensors(meta.outputs),
    }


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, fmt: str, *args: Any) -> None:
        pass

    def handle(self) -> None:
        try:
            super().handle()
        except ConnectionError:  # the client hung up before its answer (a probe's timeout): no one to tell
            self.close_connection = True

    def _reply(self, status: int, body: bytes, ctype: str = "application/json", headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj: dict, headers: dict | None = None) -> None:
        self._reply(status, json.dumps(obj).encode(), headers=headers)

    def _method_not_allowed(self) -> None:
        msg = (
            f"{self.command} {self.path.split('?')[0]}: this port answers GET only (health, metadata, metrics); "
            "inference goes to Triton's gRPC port (SERVICE_GRPC_PORT) or the HTTP front end (SERVICE_HTTP_PORT)"
        )
        self._json(405, {"error": msg}, {"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _method_not_allowed

    @property
    def supervisor(self) -> Probed:
        return self.server.supervisor  # type: ignore[attr-defined]


class HealthHandler(_Handler):
    def do_GET(self) -> None:
        sup = self.supervisor
        path = self.path.split("?")[0].rstrip("/")
        if path == "/v2/health/live":
            self._json(200, {"status": "live"})
        elif path == "/v2/health/ready":
            self._ready(sup)
        elif path == "/v2":
            self._json(200, {"name": SERVER_NAME, "version": llmserve.__version__, "extensions": []})
        elif (m := _MODEL_PATH.match(path)) and path != "/v2/models/stats":  # stats: Triton's, over gRPC
            model, version, ready = unquote(m[1]), m[2] and unquote(m[2]), m[3]
            if model != sup.model_name:
                self._json(404, {"error": f"Request for unknown model: '{model}' is not found"})
            elif version is not None and version not in sup.model_versions:
                self._json(404, {"error": f"Request for unknown model: '{model}' version {version} is not found"})
            elif ready:
                self._ready(sup)
            elif sup.model_metadata is None:
                self._json(503, {"error": f"model '{model}': Triton is not up yet, its metadata is not known"})
            else:
                self._json(200, sup.model_metadata)
        else:
            self._json(404, {"error": f"not found: {path or '/'} (this port serves /v2/health/*, /v2, /v2/models/*)"})

    do_HEAD = do_GET

    def _ready(self, sup: Probed) -> None:
        code, msg = sup.health()
        if code == 0:
            self._json(200, {"status": "ready"})
        else:
            self._json(500, {"error": msg, "error_code": code, "error_msg": msg})


class MetricsHandler(_Handler):
    def do_GET(self) -> None:
        sup = self.supervisor
        if self.path.split("?")[0].rstrip("/") not in ("", "/metrics"):
            self._reply(404, b"not found: scrape /metrics\n", "text/plain")
            return
        body = sup.metrics.exposition(sup.triton_metrics)
        self._reply(200, body, "text/plain; version=0.0.4; charset=utf-8")

    do_HEAD = do_GET
