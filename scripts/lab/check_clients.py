"""Third-party clients too heavy for CI (litellm, guidellm) against the real stack: a lab check.

    python scripts/lab/check_clients.py --client-python /path/to/clients-venv/bin/python [--only litellm]

Starts the demo stack (start_server.sh on free loopback ports, one HTTP worker), then runs each
client's checks with `--client-python`: a venv of its own with `pip install litellm guidellm`, since
guidellm needs torch, transformers, datasets and numpy >= 2 (the project venv pins numpy 1.26 for
Paddle) and litellm (200 MB installed, 13 s to import on the 2-core CI machine) would downgrade
importlib_metadata and python-dateutil there. Prints one line per check, PASS or FAIL with what was
seen, and exits 1 if any failed. The last result is in docs/clients.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "server"))
from llmserve.runners.model_dir import ensure_demo_model  # noqa: E402
from llmserve.serving.testing import http_stack  # noqa: E402

PROMPT = "def fib(n):"
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}

# Run in the client's python; prints one JSON line per check.
LITELLM = r"""
import json, os, litellm
base, want, prompt, tool = os.environ["BASE"] + "/v1", os.environ["WANT"], os.environ["PROMPT"], json.loads(os.environ["TOOL"])
kw = dict(model="openai/default", api_base=base, api_key="x", max_tokens=16, temperature=0)
msgs = [{"role": "user", "content": prompt}]
def report(check, ok, detail):
    print(json.dumps({"check": check, "ok": bool(ok), "detail": detail}), flush=True)
def run(check, fn):
    try:
        fn()
    except Exception as e:
        report(check, False, f"{type(e).__name__}: {e}"[:400])
def text():
    r = litellm.completion(messages=msgs, **kw)
    got = r.choices[0].message.content
    report("litellm completion (greedy text)", got == want, {"got": got, "usage": r.usage.model_dump()})
def stream():
    got = "".join(c.choices[0].delta.content or "" for c in litellm.completion(messages=msgs, stream=True, **kw))
    report("litellm completion stream", got == want, got)
def tools():
    r = litellm.completion(messages=[{"role": "user", "content": "weather in Oslo?"}], tools=[tool],
                           tool_choice={"type": "function", "function": {"name": "get_weather"}}, **{**kw, "max_tokens": 96})
    calls = r.choices[0].message.tool_calls or []
    ok = len(calls) == 1 and calls[0].function.name == "get_weather" and "city" in json.loads(calls[0].function.arguments)
    report("litellm tool call", ok, [c.function.model_dump() for c in calls])
def context():
    try:
        litellm.completion(messages=[{"role": "user", "content": "x " * 40000}], **kw)
        report("litellm context window error", False, "no error")
    except litellm.ContextWindowExceededError as e:
        report("litellm context window error", True, type(e).__name__)
def text_completion():
    r = litellm.text_completion(prompt=prompt, **kw)
    report("litellm text_completion", bool(r.choices[0].text), r.choices[0].text)
for name, fn in [("text", text), ("stream", stream), ("tools", tools), ("context", context), ("tc", text_completion)]:
    run("litellm " + name, fn)
"""


def litellm_checks(py: str, env: dict) -> list[dict]:
    r = subprocess.run([py, "-c", LITELLM], env=env, capture_output=True, text=True, timeout=600)
    out = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    if r.returncode != 0 or not out:
        out.append({"check": "litellm", "ok": False, "detail": r.stderr[-800:]})
    return out


def guidellm_checks(py: str, env: dict, base: str, tokenizer: str) -> list[dict]:
    """A short synchronous run (8 requests of 16 prompt and 8 output tokens) with guidellm's default
    request shape (chat completions, streamed, stream_options.continuous_usage_stats)."""
    out_json = Path(tempfile.mkdtemp(prefix="guidellm-")) / "out.json"
    cmd = [str(Path(py).parent / "guidellm"), "run", "--backend", f"kind=openai_http,target={base},model=default",
           "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=8",
           "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
           "--output", f"kind=json,path={out_json}", "--disable-console-interactive"]  # fmt: skip
    t0 = time.monotonic()
    r = subprocess.run(cmd, env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=600)
    took = round(time.monotonic() - t0, 1)
    if r.returncode != 0 or not out_json.exists():
        return [{"check": "guidellm run", "ok": False, "detail": f"rc {r.returncode}: {r.stderr[-800:]}"}]
    bench = json.loads(out_json.read_text())["benchmarks"][0]
    made = bench["scheduler_metrics"]["requests_made"]
    errors = [e.get("info", {}).get("error") for e in bench["requests"].get("errored") or []][:1]
    detail = {"successful": made["successful"], "errored": made["errored"], "seconds": took, "first_error": errors}
    checks = [{"check": "guidellm run (8 requests)", "ok": made["successful"] == 8, "detail": detail}]
    # What the server says to guidellm's stream_options, for the report.
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    probe = requests.post(base + "/v1/chat/completions", json=body, timeout=60)
    checks.append({
        "check": "stream_options.continuous_usage_stats accepted",
        "ok": probe.status_code == 200,
        "detail": f"{probe.status_code}: {probe.text[:300]}",
    })  # fmt: skip
    return checks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--client-python", default=sys.executable, help="a python with litellm and guidellm")
    ap.add_argument("--only", default="litellm,guidellm", help="comma-separated: litellm, guidellm")
    ap.add_argument("--json", type=Path, help="write the checks here too")
    args = ap.parse_args()
    only = set(args.only.split(","))
    tokenizer = ensure_demo_model()
    with tempfile.TemporaryDirectory(prefix="check-clients-") as tmp:
        stack = http_stack(Path(tmp), PUSH_MODE_HTTP_WORKERS=1, API_KEY="", MAX_DEC_LEN=256)
        with stack:
            base = stack.http_base
            chat = {"model": "default", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16}
            want = requests.post(base + "/v1/chat/completions", json={**chat, "temperature": 0}, timeout=60).json()
            env = dict(os.environ, BASE=base, PROMPT=PROMPT, TOOL=json.dumps(TOOL))
            env["WANT"] = want["choices"][0]["message"]["content"]
            env.pop("PYTHONPATH", None)  # the client's venv, not this project
            checks = []
            if "litellm" in only:
                checks += litellm_checks(args.client_python, env)
            if "guidellm" in only:
                checks += guidellm_checks(args.client_python, env, base, tokenizer)
    version = subprocess.run(
        [args.client_python, "-m", "pip", "list", "--format=json"], capture_output=True, text=True, timeout=120
    )
    versions = {p["name"]: p["version"] for p in json.loads(version.stdout or "[]")}
    print("clients:", ", ".join(f"{n} {versions.get(n, '-')}" for n in ("litellm", "guidellm", "openai")))
    for c in checks:
        print(("PASS " if c["ok"] else "FAIL ") + c["check"] + ": " + json.dumps(c["detail"])[:400])
    if args.json:
        args.json.write_text(json.dumps({"versions": versions, "checks": checks}, indent=1))
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
