"""Security: API_KEY guards every route but health (the routes are read from the app itself, so a
new route is covered without touching this test), and the key never reaches a log.
Header and body size limits: test_reliability_fuzz.py. download_model.py paths/md5: test_download_model.py.
"""

from __future__ import annotations

import secrets
import subprocess
import sys

import pytest
import requests

from llmserve.config import Config
from llmserve.http.app import OPEN_PATHS, create_app
from llmserve.serving.testing import http_stack

KEY = "sk-test-" + secrets.token_hex(16)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = http_stack(tmp_path_factory.mktemp("security"), API_KEY=KEY, PUSH_MODE_HTTP_WORKERS=1, MAX_DEC_LEN=64)
    s.start()
    yield s
    assert s.stop().returncode == 0


def app_routes() -> list[tuple[str, str]]:
    """(method, path) of every route of the front end's app."""
    app = create_app(Config.from_env({}), backend_factory=lambda c: None)
    out = []
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or {"GET"}):
            if method != "HEAD":
                out.append((method, route.path))
    return out


def test_the_app_has_the_routes_we_expect():
    paths = {p for _, p in app_routes()}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/openapi.json"} <= paths
    assert OPEN_PATHS <= paths


@pytest.mark.parametrize("method, path", app_routes())
def test_every_route_but_health_needs_the_key(stack, method, path):
    url = stack.http_base + path
    body = {"model": "default", "prompt": "hi", "max_tokens": 2} if method == "POST" else None
    if path in OPEN_PATHS:
        assert requests.request(method, url, timeout=10).status_code == 200
        return
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        r = requests.request(method, url, json=body, headers=headers, timeout=10)
        assert r.status_code == 401, (method, path, headers, r.status_code)
        assert "API key" in r.text and KEY not in r.text
    r = requests.request(method, url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code != 401 and r.status_code < 500, (method, path, r.status_code, r.text[:300])


def test_the_key_is_never_logged(stack):
    import openai

    client = openai.Client(base_url=stack.http_base + "/v1", api_key=KEY)
    assert client.completions.create(model="default", prompt="hi", max_tokens=3).choices
    with pytest.raises(openai.AuthenticationError):
        openai.Client(base_url=stack.http_base + "/v1", api_key=KEY + "x").models.list()
    r = requests.post(
        stack.http_base + "/v1/chat/completions",
        json={"text": "bad", "temperature": -1},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=10,
    )
    assert r.status_code == 400
    # `llmserve config` shows that a key is set, not the key.
    cfg = subprocess.run(
        [sys.executable, "-m", "llmserve.cli", "config"], env=stack.env, capture_output=True, text=True, timeout=60
    )
    assert "API_KEY" in cfg.stdout and KEY not in cfg.stdout + cfg.stderr
    files = [*stack.log_dir.iterdir(), *stack.work_dir.glob("start.*")]
    assert any(f.name == "http.log" for f in files)
    for f in files:
        if f.is_file():
            assert KEY not in f.read_text(errors="replace"), f"the API key is in {f}"
