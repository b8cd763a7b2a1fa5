"""The FastAPI app of the push-mode HTTP front end.

Routes
  POST /v1/chat/completions   native when the body holds a native-only field or no `model`, else OpenAI chat
  POST /v1/completions        OpenAI completions
  GET  /v1/models             OpenAI model list
  GET  /v1/models/{model}     one model, for any name `model` may take
  POST /v1/responses          OpenAI Responses API; GET / DELETE /v1/responses/{id} (http/responses_api.py)
  GET  /health, /v2/health/live, /v2/health/ready   no auth
The same OpenAI routes also live under /v1/chat/completions/ (the seeds'
`base_url`, to which the openai client appends `completions`,
`chat/completions`, `models` and `responses`).

A pure-ASGI door in front of everything checks `API_KEY` and caps the body
size before any JSON is parsed. Every request goes to Triton over gRPC.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import re
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmserve.config import Config
from llmserve.engine.heap import freeze_startup_objects
from llmserve.http.errors import ApiError, Style, error_body, error_response
from llmserve.http.native import handle_native
from llmserve.http.openai import handle_chat, handle_completions
from llmserve.http.responses_api import handle_responses
from llmserve.http.responses_store import ResponseStore
from llmserve.http.server import PARENT_ENV, die_with_parent
from llmserve.http.triton_client import Backend, TritonBackend
from llmserve.protocol.native import NativeRequest, is_native_body, served_model_names
from llmserve.protocol.openai import ChatCompletionRequest, CompletionRequest
from llmserve.protocol.responses_api import ResponsesRequest
from llmserve.serving import http_failures as failures

log = logging.getLogger("llmserve.http")

MAX_BODY_BYTES = 4 << 20
OPEN_PATHS = frozenset({"/health", "/v2/health/live", "/v2/health/ready"})
SHARED_PATH = "/v1/chat/completions"  # also the seeds' base_url: the openai client appends its paths to it
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a JSON escape of a UTF-16 surrogate


def _style(path: str) -> Style:
    return "both" if path.rstrip("/") == SHARED_PATH else "openai"


class FrontDoor:
    """ASGI middleware: bearer-token check, then a body-size cap (the body is read here and replayed),
    then the completion routes' handlers called directly (`routes`: exact path -> endpoint, for POST):
    FastAPI's routing, dependency solving and the middleware below cost a fifth of the worker's CPU per
    request, which a burst pays before its first tokens. Everything else goes through FastAPI."""

    def __init__(self, app, api_key: str, max_body_bytes: int, routes: dict[str, Callable] | None = None) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body = max_body_bytes
        self.routes = routes or {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        headers = dict(scope["headers"])
        if self.api_key and path not in OPEN_PATHS:
            auth = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                msg = "missing or invalid API key: send `Authorization: Bearer <API_KEY>`"
                return await error_response(_style(path), 401, msg)(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_big = f"the request body exceeds {self.max_body} bytes"
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return await error_response(_style(path), 413, too_big)(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return await error_response(_style(path), 413, too_big)(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # then http.disconnect, for disconnect detection

        endpoint = self.routes.get(path) if scope["method"] == "POST" else None
        if endpoint is None:
            return await self.app(scope, replay, send)
        response = await endpoint(Request(scope, replay))
        await response(scope, replay, send)


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def _json_body(request: Request) -> dict:
    """The body as a JSON object."""
    # Only JSON media types: a browser sends text/plain or a form cross-site without asking first.
    ctype = request.headers.get("content-type", "")
    if not _is_json(ctype):
        raise ApiError(415, f"the body must be JSON: send Content-Type: application/json (got {ctype or 'none'!r})")
    raw = await request.body()
    if not raw.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: it is nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if not _SURROGATE_ESCAPE.search(raw):  # only a \u escape makes a lone surrogate: skip the check
        return body
    try:  # what goes on to Triton must encode: no lone surrogates ("\ud800")
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError as e:
        raise ApiError(400, f"the request body holds invalid Unicode (a lone surrogate escape): {e.reason}") from None
    except (RecursionError, ValueError) as e:
        raise ApiError(400, f"the request body cannot be forwarded: {e}") from None
    return body


def _schema_ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


_ERRORS = {
    str(code): {"description": why}
    for code, why in [
        (400, "invalid request (the message names the field)"),
        (401, "missing or wrong API key"),
        (408, "timed out"),
        (409, "duplicate req_id in flight"),
        (404, "unknown model"),
        (413, "native: input over MAX_SEQ_LEN; body too large"),
        (415, "the body is not JSON (Content-Type)"),
        (429, "queue full (MAX_CACHED_TASK_NUM)"),
        (503, "not ready"),
    ]
}


def _body_doc(schema: dict, ok: dict[str, str]) -> dict:
    """OpenAPI extras: the request body schema and the answers (`ok`: media type -> description)."""
    answers = {"200": {"description": "; ".join(ok.values()), "content": {m: {} for m in ok}}} | _ERRORS
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": answers,
    }


def create_app(
    config: Config | None = None,
    backend_factory: Callable[[Config], Backend] | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """The app; uvicorn calls it with no arguments in each worker (factory=True)."""
    cfg = config or Config.from_env()
    make_backend = backend_factory or (lambda c: TritonBackend(f"{c.local_host}:{c.service_grpc_port}", c.edge_token))
    names = served_model_names(cfg.model_dir, cfg.served_model_name)
    model_id = names[0]

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        die_with_parent()
        failures.setup(cfg.log_dir)
        app.state.backend = make_backend(cfg)  # gRPC aio channels belong to this worker's loop
        app.state.responses = ResponseStore()  # this worker's kept responses (previous_response_id)
        if os.environ.get(PARENT_ENV):  # served (not an app a test built): a full collection would
            freeze_startup_objects()  # stall every stream of this worker
        yield
        await app.state.backend.close()

    app = FastAPI(
        title="llmserve",
        version="0.1.0",
        description="Native (PaddleNLP-style) and OpenAI-compatible LLM serving over Triton.",
        lifespan=lifespan,
    )

    async def guarded(style: Style, request: Request, handler) -> Response:
        try:
            return await handler()
        except ApiError as e:
            return error_response(style, e.status, e.message, e.param)
        except Exception as e:  # a bug, not bad input: say so, keep serving
            log.exception("%s %s failed", request.method, request.url.path)
            failures.count(500)
            return error_response(style, 500, f"internal error: {type(e).__name__}: {e}")

    def backend(request: Request) -> Backend:
        return request.app.state.backend

    # ---- health (no auth) ------------------------------------------------------------
    @app.get("/health", tags=["health"])
    @app.get("/v2/health/live", tags=["health"])
    async def live() -> dict:
        return {"status": "ok"}

    @app.get("/v2/health/ready", tags=["health"])
    async def ready(request: Request) -> Response:
        if await backend(request).ready():
            return JSONResponse({"status": "ready"})
        return JSONResponse({"error_code": 1, "error_msg": "the inference server is not ready"}, status_code=503)

    # ---- OpenAI ---------------------------------------------------------------------------
    @app.get("/v1/models", tags=["openai"])
    @app.get(SHARED_PATH + "/models", include_in_schema=False)
    async def models() -> dict:
        created = int(time.time())
        return {
            "object": "list",
            "data": [{"id": model_id, "object": "model", "created": created, "owned_by": "llmserve"}],
        }

    @app.get("/v1/models/{model:path}", tags=["openai"])
    @app.get(SHARED_PATH + "/models/{model:path}", include_in_schema=False)
    async def model(model: str) -> Response:
        # Every name a request's `model` may take answers (the served one as its id), as clients
        # call models.retrieve with the name they send.
        if model not in names:
            msg = f"The model `{model}` does not exist; this server serves `{model_id}`."
            return error_response("openai", 404, msg, "model")
        return JSONResponse({"id": model, "object": "model", "created": int(time.time()), "owned_by": "llmserve"})

    openai_ok = {"application/json": "completion (stream: false)", "text/event-stream": "SSE chunks, then [DONE]"}
    completions_doc = _body_doc(_schema_ref("CompletionRequest"), openai_ok)

    @app.post("/v1/completions", tags=["openai"], openapi_extra=completions_doc, summary="OpenAI completions")
    @app.post(SHARED_PATH + "/completions", include_in_schema=False)
    async def completions(request: Request) -> Response:
        async def run():
            return await handle_completions(request, await _json_body(request), backend(request), cfg)

        return await guarded("openai", request, run)

    @app.post(SHARED_PATH + "/chat/completions", include_in_schema=False)
    async def chat_alt(request: Request) -> Response:
        async def run():
            return await handle_chat(request, await _json_body(request), backend(request), cfg)

        return await guarded("openai", request, run)

    responses_ok = {"application/json": "a Response (stream: false)", "text/event-stream": "Responses events"}
    responses_doc = _body_doc(_schema_ref("ResponsesRequest"), responses_ok)

    @app.post("/v1/responses", tags=["openai"], openapi_extra=responses_doc, summary="OpenAI Responses API (create)")
    @app.post(SHARED_PATH + "/responses", include_in_schema=False)
    async def responses(request: Request) -> Response:
        async def run():
            body = await _json_body(request)
            return await handle_responses(request, body, backend(request), cfg, request.app.state.responses)

        return await guarded("openai", request, run)

    def kept_response(request: Request, response_id: str) -> dict:
        kept = request.app.state.responses.get(response_id)
        if kept is None:
            msg = f"no response {response_id!r} is kept by this HTTP worker (see previous_response_id in docs/api.md)"
            raise ApiError(404, msg, "response_id")
        return kept.response

    @app.get("/v1/responses/{response_id}", tags=["openai"], summary="A kept response")
    @app.get(SHARED_PATH + "/responses/{response_id}", include_in_schema=False)
    async def get_response(request: Request, response_id: str) -> Response:
        async def run():
            return JSONResponse(kept_response(request, response_id))

        return await guarded("openai", request, run)

    @app.delete("/v1/responses/{response_id}", tags=["openai"], summary="Forget a kept response")
    @app.delete(SHARED_PATH + "/responses/{response_id}", include_in_schema=False)
    async def delete_response(request: Request, response_id: str) -> Response:
        async def run():
            kept_response(request, response_id)
            request.app.state.responses.delete(response_id)
            return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

        return await guarded("openai", request, run)

    # ---- the shared route: native or OpenAI chat -------------------------------------------
    shared_ok = openai_ok | {"application/x-ndjson": "native stream: one JSON object per line"}
    shared_schema = {"oneOf": [_schema_ref("NativeRequest"), _schema_ref("ChatCompletionRequest")]}
    shared_doc = _body_doc(shared_schema, shared_ok)

    @app.post(
        SHARED_PATH,
        tags=["native", "openai"],
        openapi_extra=shared_doc,
        summary="Native request (NDJSON stream) or OpenAI chat completion (SSE stream)",
        description="Native when the body holds a native-only field (text, req_id, max_dec_len, min_dec_len, topp, "
        "*_score, return_usage, timeout) or has no `model`; otherwise OpenAI chat completions.",
    )
    async def chat(request: Request) -> Response:
        try:
            body = await _json_body(request)
        except ApiError as e:
            return error_response("both", e.status, e.message, e.param)
        if is_native_body(body):
            return await guarded("native", request, lambda: handle_native(request, body, backend(request)))
        return await guarded("openai", request, lambda: handle_chat(request, body, backend(request), cfg))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return JSONResponse(error_body("both", exc.status_code, str(exc.detail)), status_code=exc.status_code)

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (NativeRequest, CompletionRequest, ChatCompletionRequest, ResponsesRequest):
                s = model.model_json_schema(ref_template="#/components/schemas/{model}")
                comps.update(s.pop("$defs", {}))
                comps[model.__name__] = s
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    routes = {
        SHARED_PATH: chat,
        SHARED_PATH + "/chat/completions": chat_alt,
        SHARED_PATH + "/completions": completions,
        "/v1/completions": completions,
        "/v1/responses": responses,
        SHARED_PATH + "/responses": responses,
    }
    app.add_middleware(FrontDoor, api_key=cfg.api_key, max_body_bytes=max_body_bytes, routes=routes)
    return app
