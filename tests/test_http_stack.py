"""The HTTP front end on the real stack: start_server.sh (Triton + engine + 2 HTTP workers) on free loopback ports.

The seeds' snippets run as written (host and port changed), greedy text
matches `llmserve generate`, 64 concurrent streams complete, bad input gets a
4xx (never a 5xx, never a hang), a dropped stream frees its KV blocks, and
API_KEY guards everything but health.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from llmserve.serving.testing import PORT_VARS as STACK_PORT_VARS
from llmserve.serving.testing import free_ports

ROOT = Path(__file__).resolve().parents[1]
PORT_VARS = (*STACK_PORT_VARS, "SERVICE_HTTP_PORT")


def wait_http(url: str, timeout: float = 60.0, headers: dict | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(requests.RequestException):
            if requests.get(url, timeout=2, headers=headers).status_code == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout} s")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("stack_log")
    ports = dict(zip(PORT_VARS, map(str, free_ports(len(PORT_VARS)))))
    env = dict(os.environ, **ports, LOG_DIR=str(log_dir), LLMSERVE_HOST="127.0.0.1", PUSH_MODE_HTTP_WORKERS="2")
    # MAX_DEC_LEN 4096: room for requests that outlast any disconnect (test_disconnect_frees_kv_blocks).
    env |= {"MAX_SEQ_LEN": "4096", "MAX_DEC_LEN": "4096", "BLOCK_BS": "8", "BATCH_SIZE": "64", "API_KEY": ""}
    env["LLMSERVE_INTAKE_TRACE"] = str(log_dir / "intake.txt")  # test_intake_trace_marks_every_layer_in_order
    env.pop("MODEL_DIR", None)
    env["LLMSERVE_START_TIMEOUT"] = "300"  # the first run may build the demo model
    started = subprocess.run([str(ROOT / "start_server.sh")], env=env, capture_output=True, text=True, timeout=400)
    if started.returncode != 0:
        logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in log_dir.glob("*.log"))
        pytest.fail(f"start_server.sh failed:\n{started.stdout}{started.stderr}\n{logs}")
    base = f"http://127.0.0.1:{ports['SERVICE_HTTP_PORT']}"
    try:
        wait_http(base + "/v2/health/ready")
        yield {"base": base, "env": env, "ports": ports, "log_dir": log_dir}
    finally:
        subprocess.run([str(ROOT / "stop_server.sh")], env=env, capture_output=True, timeout=120)


def run_snippet(code: str, port: str) -> list:
    """Exec a snippet with its port replaced; returns what it printed, as (object, end) pairs."""
    printed: list = []

    def fake_print(*args, end="\n", **_):
        printed.append((args[0] if len(args) == 1 else args, end))

    exec(code.replace('"9965"', f'"{port}"'), {"print": fake_print, "__name__": "__snippet__"})
    return printed


# The seeds' snippets, as written (seed 001; the port variable is what the test changes).
SEED_REQUESTS = """
import uuid
import json
import requests

push_mode_http_port = "9965"    # 服务配置的PUSH_MODE_HTTP_PORT
url = f"http://127.0.0.1:{push_mode_http_port}/v1/chat/completions"
req_id = str(uuid.uuid1())
data_single = {
    "text": "Hello, how are you?",
    "req_id": req_id,
    "max_dec_len": 64,
    "stream": True,
  }
# 逐token返回
res = requests.post(url, json=data_single, stream=True)
for line in res.iter_lines():
    print(json.loads(line))

# 多轮对话
data_multi = {
    "messages": [
      {"role": "user", "content": "Hello, who are you"},
      {"role": "system", "content": "I'm a helpful AI assistant."},
      {"role": "user", "content": "List 3 countries and their capitals."},
    ],
    "req_id": req_id,
    "max_dec_len": 64,
    "stream": True,
  }
# 逐token返回
res = requests.post(url, json=data_multi, stream=True)
for line in res.iter_lines():
    print(json.loads(line))
"""

SEED_OPENAI = """
import openai

push_mode_http_port = "9965"    # 服务配置的PUSH_MODE_HTTP_PORT
client = openai.Client(base_url=f"http://127.0.0.1:{push_mode_http_port}/v1/chat/completions", api_key="EMPTY_API_KEY")

# 非流式返回
response = client.completions.create(
    model="default",
    prompt="Hello, how are you?",
  max_tokens=50,
  stream=False,
)

print(response)
print("\\n")

# 流式返回
response = client.completions.create(
    model="default",
    prompt="Hello, how are you?",
  max_tokens=100,
  stream=True,
)

for chunk in response:
  if chunk.choices[0] is not None:
    print(chunk.choices[0].text, end='')
print("\\n")

# Chat completion
# 非流式返回
response = client.chat.completions.create(
    model="default",
    messages=[
        {"role": "user", "content": "Hello, who are you"},
        {"role": "system", "content": "I'm a helpful AI assistant."},
        {"role": "user", "content": "List 3 countries and their capitals."},
    ],
    temperature=0,
    max_tokens=64,
    stream=False,
)

print(response)
print("\\n")

# 流式返回
response = client.chat.completions.create(
    model="default",
    messages=[
        {"role": "user", "content": "Hello, who are you"},
        {"role": "system", "content": "I'm a helpful AI assistant."},
        {"role": "user", "content": "List 3 countries and their capitals."},
    ],
    temperature=0,
    max_tokens=64,
    stream=True,
)

for chunk in response:
  if chunk.choices[0].delta is not None:
    print(chunk.choices[0].delta.content, end='')
print("\\n")
"""


def split_streams(lines: list[dict]) -> list[list[dict]]:
    streams, cur = [], []
    for obj in lines:
        cur.append(obj)
        if obj.get("is_end"):
            streams.append(cur)
            cur = []
    assert not cur
    return streams


def test_seed_requests_snippet(stack):
    printed = [obj for obj, _ in run_snippet(SEED_REQUESTS, stack["ports"]["SERVICE_HTTP_PORT"])]
    single, multi = split_streams(printed)
    for stream in (single, multi):
        assert all(o["error_code"] == 0 and o["error_msg"] == "" for o in stream)
        assert [o["send_idx"] for o in stream] == list(range(len(stream)))
        assert "".join(o["token"] for o in stream) == stream[-1]["tokens_all"]
        assert 1 <= sum(len(o["token_ids"]) for o in stream) <= 64
    assert single[0]["req_id"] == multi[0]["req_id"]  # the seed reuses one req_id, one request at a time


def test_seed_openai_snippet(stack):
    import openai

    printed = run_snippet(SEED_OPENAI, stack["ports"]["SERVICE_HTTP_PORT"])
    completion, chat = [p for p, _ in printed if isinstance(p, openai.BaseModel)]
    # Streamed pieces are printed with end=''; two runs: the completion, then the chat.
    runs, cur = [], []
    for obj, end in printed:
        if end == "":
            cur.append(obj)
        elif cur:
            runs.append(cur)
            cur = []
    streamed_completion, streamed_chat = runs
    assert completion.object == "text_completion" and completion.usage.completion_tokens <= 50
    assert completion.choices[0].finish_reason in ("stop", "length") and completion.choices[0].text
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens > 10 and chat.usage.completion_tokens <= 64
    assert all(isinstance(p, str) for p in streamed_completion + streamed_chat)  # never a None delta
    assert len(streamed_completion) <= 100 and "".join(streamed_completion)
    # The streamed chat (temperature 0) spells the same text as the non-streamed one.
    assert "".join(streamed_chat) == chat.choices[0].message.content


def test_greedy_matches_llmserve_generate(stack):
    prompt = random.choice(["The weather today", "Once upon a time", "Hello, llm", "A list of cities:"])
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmserve.cli",
            "generate",
            "--prompt",
            prompt,
            "--max-tokens",
            "24",
            "--temperature",
            "0",
        ],
        env=stack["env"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    ref = json.loads(out.stdout.strip().splitlines()[-1])
    base = stack["base"]
    oa = requests.post(
        base + "/v1/completions", json={"model": "default", "prompt": prompt, "max_tokens": 24, "temperature": 0}
    ).json()
    assert oa["choices"][0]["text"] == ref["text"]
    assert oa["usage"]["completion_tokens"] == len(ref["token_ids"])
    # Native: top_k 1 is greedy (temperature must be > 0 there).
    nat = requests.post(base + "/v1/chat/completions", json={"text": prompt, "max_dec_len": 24, "top_k": 1}).json()
    assert nat["token_ids"] == ref["token_ids"] and nat["result"] == ref["text"]


def test_openai_features_end_to_end(stack):
    import openai

    client = openai.Client(base_url=stack["base"] + "/v1", api_key="x")
    assert client.models.list().data[0].id
    seed = random.randrange(1 << 20)
    kw = {"model": "default", "prompt": "Tell me", "max_tokens": 12, "temperature": 1.0, "seed": seed}
    a, b = (client.completions.create(**kw) for _ in range(2))
    assert a.choices[0].text == b.choices[0].text  # same seed, same text
    many = client.completions.create(**kw | {"n": 3, "prompt": ["x y", "z"]})
    assert sorted(c.index for c in many.choices) == list(range(6))
    # A stop string cuts the text before it and finishes with "stop".
    full = client.completions.create(model="default", prompt="Once", max_tokens=20, temperature=0).choices[0].text
    # From the middle on, the first two characters that are not all whitespace (a whitespace stop string would be
    # a different case: the text's first whitespace run may come before the middle).
    at = next((i for i in range(len(full) // 2, len(full) - 1) if full[i : i + 2].strip()), None)
    assert at is not None, f"no stop string to cut at in {full!r}"
    stop = full[at : at + 2]
    cut = client.completions.create(model="default", prompt="Once", max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    echo = client.completions.create(model="default", prompt="Once", max_tokens=3, temperature=0, echo=True)
    assert echo.choices[0].text.startswith("Once")
    # Token-id prompts are echoed through the front end's tokenizer.
    from llmserve.engine.tokenizer import load_tokenizer
    from llmserve.runners.model_dir import demo_model_dir

    tok = load_tokenizer(demo_model_dir())
    ids = tok.encode("Once upon a time", add_special_tokens=False)
    echo = client.completions.create(model="default", prompt=ids, max_tokens=3, temperature=0, echo=True)
    assert echo.choices[0].text.startswith(tok.decode(ids)) and echo.usage.prompt_tokens == len(ids)
    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 5
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")


def test_64_concurrent_streams(stack):
    url = stack["base"] + "/v1/chat/completions"
    n_tokens = 16

    def one(i: int) -> tuple[int, str]:
        body = {"text": f"request {i} {uuid.uuid4().hex[:6]}", "max_dec_len": n_tokens, "min_dec_len": n_tokens}
        with requests.post(url, json=body | {"stream": True}, stream=True, timeout=120) as r:
            assert r.status_code == 200, r.text
            lines = [json.loads(x) for x in r.iter_lines()]
        assert lines[-1]["is_end"] == 1 and all(x["error_code"] == 0 for x in lines)
        return sum(len(x["token_ids"]) for x in lines), lines[-1]["req_id"]

    t0 = time.monotonic()
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(64)))
    assert [n for n, _ in results] == [n_tokens] * 64
    assert len({r for _, r in results}) == 64
    assert time.monotonic() - t0 < 120


def test_intake_trace_marks_every_layer_in_order(stack):
    """LLMSERVE_INTAKE_TRACE: every process of the stack appends its marks to one file; each request
    has one mark a layer, in the order it met them; scripts/lab/intake_report.py summarizes the file."""
    from llmserve.serving.intake_trace import LAYERS

    url = stack["base"] + "/v1/chat/completions"
    ids = [f"trace-{i}-{uuid.uuid4().hex[:6]}" for i in range(8)]

    def one(rid: str) -> None:
        body = {"text": f"trace {rid}", "max_dec_len": 4, "stream": True, "req_id": rid}
        with requests.post(url, json=body, stream=True, timeout=120) as r:
            assert r.status_code == 200, r.text
            assert json.loads(list(r.iter_lines())[-1])["is_end"] == 1

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, ids))
    trace = Path(stack["env"]["LLMSERVE_INTAKE_TRACE"])
    marks: dict[str, list[tuple[str, float]]] = {}
    for line in trace.read_text().splitlines():
        t, layer, rid = line.split()
        marks.setdefault(rid, []).append((layer, float(t)))
    for rid in ids:
        got = dict(marks.get(rid, []))
        assert sorted(got) == sorted(LAYERS) and len(marks[rid]) == len(LAYERS), marks.get(rid)
        # In the order the request met them; `http_sent` (the writer's await returned) may follow the
        # adapter's mark, never the worker's own `http`.
        path = [got[la] for la in LAYERS if la != "http_sent"]
        assert path == sorted(path), marks[rid]
        assert got["http"] <= got["http_sent"] <= got["http_first"], marks[rid]
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts/lab/intake_report.py"), str(trace), "--gap", "3600"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    for hop in ("http->adapter", "adapter->server", "server_first->http_first", "http->http_sent"):
        assert hop in r.stdout, r.stdout


@pytest.mark.parametrize(
    "path, body, status, field",
    [
        ("/v1/chat/completions", {"text": "hi", "temperature": -1}, 400, "temperature"),
        ("/v1/chat/completions", {"text": "hi", "history": []}, 400, "history"),
        ("/v1/chat/completions", {"text": "hi", "topp": 1.5}, 400, "topp"),
        ("/v1/chat/completions", {"text": "hi", "max_dec_len": -1}, 400, "max_dec_len"),
        ("/v1/chat/completions", {"text": ""}, 400, "text"),
        ("/v1/chat/completions", {"text": "hi", "max_dec_len": 5000}, 400, "max_dec_len"),  # > MAX_DEC_LEN
        ("/v1/chat/completions", {"input_ids": [5] * 4100}, 413, "4100 input tokens"),  # > MAX_SEQ_LEN
        ("/v1/completions", {"model": "m", "prompt": "x", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"model": "m", "prompt": [], "max_tokens": 3}, 400, "prompt"),
        ("/v1/chat/completions", {"model": "m", "messages": "hi"}, 400, "messages"),
    ],
)
def test_validation_on_the_stack(stack, path, body, status, field):
    for stream in (False, True):
        r = requests.post(stack["base"] + path, json=body | {"stream": stream}, timeout=30)
        assert r.status_code == status, r.text
        err = r.json()
        msg = err["error"]["message"] if "error" in err else err["error_msg"]
        assert field in msg


def test_transport_errors_on_the_stack(stack):
    url = stack["base"] + "/v1/chat/completions"
    r = requests.post(url, data=b"{oops", headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400 and "JSON" in r.json()["error_msg"]
    r = requests.post(url, data=b"x" * (5 << 20), headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413


def metric(stack, name: str) -> float:
    text = requests.get(f"http://127.0.0.1:{stack['ports']['METRICS_HTTP_PORT']}/metrics", timeout=5).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def wait_metric(stack, name: str, pred, timeout: float = 10.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        v = metric(stack, name)
        if pred(v) or time.monotonic() > deadline:
            return v
        time.sleep(0.1)


def test_duplicate_req_id_is_409(stack):
    """A duplicate of a req_id in flight gets 409 and leaves the original alone: it goes on streaming,
    its blocks are freed when its client hangs up, and the req_id then serves a new request."""
    url = stack["base"] + "/v1/chat/completions"
    req_id = uuid.uuid4().hex
    # ~1000 tokens keeps it in flight for seconds even on a busy machine.
    body = {"text": "long one", "req_id": req_id, "max_dec_len": 1000, "min_dec_len": 1000, "stream": True}
    assert wait_metric(stack, "llmserve_kv_blocks_used", lambda v: v == 0) == 0
    with requests.post(url, json=body, stream=True, timeout=60) as first:
        # Hold on to the line iterator: a discarded one, once collected, closes the connection
        # (urllib3), which cancels the original just as the duplicate is sent.
        lines = first.iter_lines()
        assert json.loads(next(lines))["error_code"] == 0  # in flight now
        r = requests.post(url, json={"text": "again", "req_id": req_id}, timeout=30)
        assert r.status_code == 409 and r.json()["error_code"] == 409
        more = [json.loads(next(lines)) for _ in range(5)]
        assert all(m["req_id"] == req_id and m["error_code"] == 0 and not m["is_end"] for m in more)
        assert wait_metric(stack, "llmserve_kv_blocks_used", lambda v: v > 0) > 0
    assert wait_metric(stack, "llmserve_kv_blocks_used", lambda v: v == 0) == 0
    assert wait_metric(stack, "llmserve_requests_running", lambda v: v == 0) == 0
    r = requests.post(url, json={"text": "again", "req_id": req_id, "max_dec_len": 8, "min_dec_len": 8}, timeout=30)
    assert r.status_code == 200 and r.json()["req_id"] == req_id and len(r.json()["token_ids"]) == 8


def counter(stack, name: str) -> float:
    """A counter's total over all its labels (0 before its first sample)."""
    text = requests.get(f"http://127.0.0.1:{stack['ports']['METRICS_HTTP_PORT']}/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_kv_blocks(stack, stream):
    url = stack["base"] + "/v1/chat/completions"
    # 4000 tokens take seconds even on a fast machine: far longer than a disconnect takes to abort.
    n_tokens = 4000
    body = {"text": "a long answer please", "max_dec_len": n_tokens, "min_dec_len": n_tokens, "stream": stream}
    assert wait_metric(stack, "llmserve_kv_blocks_used", lambda v: v == 0) == 0
    assert wait_metric(stack, "llmserve_requests_running", lambda v: v == 0) == 0
    time.sleep(0.6)  # earlier requests' stats reach the supervisor within one heartbeat
    names = ("llmserve_request_cancelled_total", "llmserve_request_success_total", "llmserve_generation_tokens_total")
    before = {k: counter(stack, k) for k in names}
    if stream:
        r = requests.post(url, json=body, stream=True, timeout=60)
        lines = r.iter_lines()
        for _ in range(3):
            assert json.loads(next(lines))["error_code"] == 0
        assert wait_metric(stack, "llmserve_kv_blocks_used", lambda v: v > 0) > 0
        r.close()  # the client hangs up mid-stream
    else:
        with pytest.raises(requests.exceptions.ReadTimeout):
            requests.post(url, json=body, timeout=1.5)
    t0 = time.monotonic()
    assert wait_metric(stack, "llmserve_kv_blocks_used", lambda v: v == 0) == 0
    assert wait_metric(stack, "llmserve_requests_running", lambda v: v == 0) == 0
    assert time.monotonic() - t0 < 5
    time.sleep(0.6)  # one more stats heartbeat
    delta = {k: counter(stack, k) - before[k] for k in names}
    # Aborted by the disconnect, not run to the end.
    assert delta["llmserve_request_cancelled_total"] == 1, delta
    assert delta["llmserve_request_success_total"] == 0, delta
    assert delta["llmserve_generation_tokens_total"] < n_tokens, delta


def test_api_key_on_real_triton(stack, tmp_path):
    """A second front end with API_KEY, on the stack's Triton."""
    (port,) = free_ports(1)
    env = dict(stack["env"], API_KEY="k-" + uuid.uuid4().hex, SERVICE_HTTP_PORT=str(port), PUSH_MODE_HTTP_WORKERS="1")
    log = open(tmp_path / "http_key.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "llmserve.http"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(base + "/health", timeout=30)
        assert requests.get(base + "/v2/health/ready", timeout=5).status_code == 200
        for path in ("/v1/models", "/openapi.json"):
            assert requests.get(base + path, timeout=5).status_code == 401
        r = requests.post(base + "/v1/chat/completions", json={"text": "hi"}, timeout=10)
        assert r.status_code == 401 and r.json()["error_code"] == 401
        import openai

        bad = openai.Client(base_url=base + "/v1", api_key="wrong")
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="default", prompt="hi", max_tokens=2)
        good = openai.Client(base_url=base + "/v1", api_key=env["API_KEY"])
        assert good.completions.create(model="default", prompt="hi", max_tokens=2).choices[0].text is not None
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()


def doc_blocks(lang: str) -> list[str]:
    text = (ROOT / "docs" / "api.md").read_text()
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def test_docs_python_examples_run(stack):
    blocks = doc_blocks("python")
    assert len(blocks) >= 3
    port = stack["ports"]["SERVICE_HTTP_PORT"]
    for code in blocks:
        printed = run_snippet(code.replace(":9965", f":{port}"), port)
        assert printed, code
        for obj, _ in printed:
            if isinstance(obj, dict):
                assert obj.get("error_code", 0) == 0, obj


def test_docs_curl_examples_run(stack):
    blocks = doc_blocks("bash")
    assert len(blocks) >= 3
    port = stack["ports"]["SERVICE_HTTP_PORT"]
    for code in blocks:
        out = subprocess.run(
            ["bash", "-c", code.replace(":9965", f":{port}")], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0 and out.stdout, (code, out.stderr)
        if '"stream": true' in code:
            assert out.stdout.rstrip().endswith("data: [DONE]")
        else:
            body = json.loads(out.stdout)
            assert body.get("error_code", 0) == 0 and "error" not in body, body


def test_logprobs_end_to_end(stack):
    """Chat top_logprobs and completions logprobs come from the engine's sampler, one entry per token."""
    import math

    import openai

    client = openai.Client(base_url=stack["base"] + "/v1", api_key="x")
    chat = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens > 0
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(lp <= 0 for lp in tops)
        assert math.isclose(entry.logprob, tops[0], abs_tol=1e-5)  # greedy picks the most likely token
    comp = client.completions.create(model="default", prompt="Once", max_tokens=5, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == comp.usage.completion_tokens
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    streamed = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        stream=True,
    )
    got = [
        e.logprob for ch in streamed if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content
    ]
    assert got == [pytest.approx(e.logprob, abs=1e-6) for e in content]


# ---- OpenAI conformance (issue 12), on the real stack ----------------------------------------
@pytest.fixture(scope="module")
def demo_tokenizer(demo_dir):
    from llmserve.engine.tokenizer import load_tokenizer

    return load_tokenizer(demo_dir)


def _client(stack):
    import openai

    return openai.Client(base_url=stack["base"] + "/v1", api_key="x", max_retries=0)


def test_context_overflow_is_what_openai_clients_expect(stack):
    import openai

    client = _client(stack)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:  # the prompt fills the context (MAX_SEQ_LEN 4096)
            client.completions.create(model="default", prompt=[7] * 4096, max_tokens=1, stream=stream)
        err = e.value.body
        assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
        assert "This model's maximum context length is 4096 tokens" in err["message"], err
        with pytest.raises(openai.BadRequestError) as e:  # prompt + max_tokens beyond it: refused, not cut short
            client.completions.create(model="default", prompt=[7] * 4000, max_tokens=200, stream=stream)
        assert "you requested 4200 tokens (4000 in the input, 200 in the completion)" in e.value.body["message"]
    ok = client.completions.create(model="default", prompt=[7] * 4000, max_tokens=96, temperature=0)
    assert ok.usage.completion_tokens <= 96
    # The native protocol keeps its code.
    r = requests.post(stack["base"] + "/v1/chat/completions", json={"input_ids": [7] * 4096}, timeout=30)
    assert r.status_code == 413 and "maximum context length is 4096" in r.json()["error_msg"]


def test_model_names(stack):
    import openai

    client = _client(stack)
    listed = client.models.list().data[0].id
    for name in {listed, "default"}:
        assert client.completions.create(model=name, prompt="hi", max_tokens=2).choices[0].text is not None
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "gpt-4o" in e.value.body["message"]


def test_fields_are_honoured_or_refused_on_the_stack(stack):
    import openai

    client = _client(stack)
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    refused = [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"extra_body": {"guided_json": {"type": "strnig"}}}, "guided_json"),  # checked where it is admitted
        ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                "parallel_tool_calls": False,
            },
            "parallel_tool_calls",
        ),  # fmt: skip
        ({"tool_choice": "required"}, "tool_choice"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"seed": 1 << 64}, "seed"),
        ({"max_tokens": 5000}, "max_tokens"),  # MAX_DEC_LEN is 4096 here
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"logit_bias": {"999999": 5}}, "logit_bias"),  # outside the vocabulary: checked by the engine
        ({"extra_body": {"frobnicate": True}}, "frobnicate"),
    ]
    for extra, param in refused:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**(chat | extra))
        assert e.value.body["param"] == param and param in e.value.body["message"], (extra, e.value.body)
        assert "max_dec_len" not in e.value.body["message"]
    r = requests.post(
        stack["base"] + "/v1/chat/completions",
        data=json.dumps(chat),
        headers={"content-type": "text/plain"},
        timeout=10,
    )
    assert r.status_code == 415
    # A negative seed is a seed like any other: the same text twice, another than seed 5's.
    texts = [
        client.completions.create(model="default", prompt="Once", max_tokens=12, seed=s).choices[0].text
        for s in (-5, -5, 5)
    ]
    assert texts[0] == texts[1] and texts[0] != texts[2]


def test_logit_bias_and_ignore_eos_are_honoured(stack, demo_tokenizer):
    url = stack["base"] + "/v1/chat/completions"
    base = {"input_ids": [11, 12, 13, 14], "temperature": 0, "max_dec_len": 6}
    plain = requests.post(url, json=base, timeout=60).json()["token_ids"]
    first = plain[0]
    banned = requests.post(url, json=base | {"logit_bias": {str(first): -100}}, timeout=60).json()["token_ids"]
    assert banned[0] != first and first not in banned
    forced_id = (first + 17) % 500 + 3
    forced = requests.post(url, json=base | {"logit_bias": {str(forced_id): 100}}, timeout=60).json()["token_ids"]
    assert forced == [forced_id] * 6
    # The end token forced: it ends the request as soon as min_tokens (1 by default) allows, unless
    # ignore_eos (then max_tokens of it).
    eos = demo_tokenizer.eos_token_id
    client = _client(stack)
    kw = {"model": "default", "prompt": [11, 12], "max_tokens": 5, "temperature": 0, "logit_bias": {str(eos): 100}}
    r = client.completions.create(**kw)
    assert r.usage.completion_tokens == 2 and r.choices[0].finish_reason == "stop"
    r = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def _lp(choice) -> tuple:
    lp = choice.logprobs
    return lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset


def test_logprobs_conformance(stack, demo_tokenizer):
    client = _client(stack)
    prompt = "def fibonacci(n):"
    n_prompt = len(demo_tokenizer.encode(prompt))
    # echo + logprobs: the prompt's tokens first, the first with a null logprob.
    r = client.completions.create(model="default", prompt=prompt, max_tokens=5, echo=True, logprobs=2, temperature=0)
    tokens, lps, tops, offsets = _lp(r.choices[0])
    assert len(tokens) == n_prompt + r.usage.completion_tokens and lps[0] is None and tops[0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lps[1:])
    assert r.choices[0].text.startswith(prompt) and offsets == sorted(offsets) and offsets[n_prompt] == len(prompt)
    # logprobs=0: the chosen token alone.
    r = client.completions.create(model="default", prompt=prompt, max_tokens=4, logprobs=0, temperature=0)
    assert [list(t) for t in r.choices[0].logprobs.top_logprobs] == [[t] for t in r.choices[0].logprobs.tokens]
    # Streamed and whole responses agree token for token, with sampling (seeded) and with tokens that
    # split UTF-8 characters (a lone lead byte forced by logit_bias).
    lead = next(i for i in range(demo_tokenizer.vocab_size) if demo_tokenizer.decode_token_bytes(i) == b"\xe4")
    for extra in ({"seed": 3, "temperature": 1.0}, {"temperature": 0, "logit_bias": {str(lead): 100.0}}):
        kw = {"model": "default", "prompt": prompt, "max_tokens": 24, "logprobs": 1, "echo": True} | extra
        whole = client.completions.create(**kw).choices[0]
        chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True) if c.choices]
        text = "".join(c.text for c in chunks)
        parts = [_lp(c) for c in chunks if c.logprobs]
        streamed = tuple(sum((list(p[k]) for p in parts), []) for k in range(4))
        assert text == whole.text and streamed == tuple(list(x) for x in _lp(whole)), extra
        assert all(o <= len(whole.text) for o in whole.logprobs.text_offset)
    assert "\ufffd" in "".join(whole.logprobs.tokens)  # the forced lead bytes were generated


def test_cached_tokens_are_reported(stack):
    client = _client(stack)
    prompt = [random.randrange(10, 400) for _ in range(300)]
    first = client.completions.create(model="default", prompt=prompt, max_tokens=2)
    again = client.completions.create(model="default", prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 256  # whole blocks of the same prompt


def test_structured_output_through_the_openai_client(stack):
    """response_format json_schema (chat, streamed and not) and guided_choice (completions) through
    Triton and the engine: what comes back follows the schema, streamed deltas included."""
    import jsonschema

    client = _client(stack)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    chat = {"model": "default", "messages": [{"role": "user", "content": "x = "}], "max_tokens": 64}
    r = client.chat.completions.create(**chat, response_format=rf, temperature=1.0, seed=7)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    chunks = client.chat.completions.create(**chat, response_format=rf, stream=True, temperature=1.0, seed=8)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)
    choices = ["alpha", "beta gamma"]
    c = client.completions.create(
        model="default", prompt="import ", max_tokens=16, n=4, extra_body={"guided_choice": choices}
    )
    assert all(x.text in choices and x.finish_reason == "stop" for x in c.choices), c.choices


def test_tool_calls_through_the_openai_client(stack):
    """tool_choice required / a named function: the call is grammar-made, so even the demo (a code
    model that knows no tools) returns one valid call; streamed: name first, then its arguments;
    the call and the tool's answer go back into the conversation."""
    import jsonschema

    client = _client(stack)
    city = {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"}  # a random model's strings: short, no escapes
    params = {"type": "object", "properties": {"city": city}, "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}},
             {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                          "additionalProperties": False}}}]  # fmt: skip
    messages = [{"role": "user", "content": "weather in Oslo?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model="default", messages=messages, tools=tools, tool_choice=named, max_tokens=128, temperature=1.0, seed=3
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), params)

    stream = client.chat.completions.create(
        model="default", messages=messages, tools=tools, tool_choice="required", parallel_tool_calls=False,
        max_tokens=128, temperature=1.0, seed=4, stream=True,
    )  # fmt: skip
    deltas, finish, content = [], None, ""
    for chunk in stream:
        for ch in chunk.choices:
            deltas += ch.delta.tool_calls or []
            content += ch.delta.content or ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls", (finish, content, deltas)
    assert deltas[0].function.name in ("get_weather", "now") and deltas[0].id and deltas[0].index == 0
    args = "".join(d.function.arguments or "" for d in deltas)
    assert isinstance(json.loads(args), dict) and all(d.index == 0 for d in deltas)

    back = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "12 C, rain"},
    ]
    r = client.chat.completions.create(model="default", messages=back, tools=tools, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
