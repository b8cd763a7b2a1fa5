"""Speculative decoding's counters on their way out: the engine core's step messages (deltas), the
engine server's stats messages, the supervisor's llmserve_spec_decode_* Prometheus counters, and
`llmserve bench`'s acceptance rate and mean accepted length (from the engine's stats or a scrape)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmserve.bench import backends
from llmserve.bench.metrics import prometheus_counters, spec_summary, stats_counters
from llmserve.bench.report import format_table
from llmserve.config import Config
from llmserve.serving.engine_core import spec_sum
from llmserve.serving.metrics import EngineMetrics
from llmserve.serving.testing import record


def stats_msg(**kw) -> dict:
    msg = {"running": 0, "waiting": 0, "kv_blocks_used": 0, "kv_blocks_total": 8, "prompt_tokens": 0}
    return msg | {"generation_tokens": 0, "finished": [], "failed": []} | kw


def samples(m: EngineMetrics) -> dict[tuple[str, str | None], float]:
    """{(sample name, position label or None): value} of the llmserve_spec_decode_* samples."""
    out = {}
    for fam in text_string_to_metric_families(m.exposition().decode()):
        for s in fam.samples:
            if s.name.startswith("llmserve_spec_decode_") and s.name.endswith("_total"):
                out[(s.name, s.labels.get("position"))] = s.value
    return out


# ---- the wire: deltas and their sums ----------------------------------------------------------
def test_spec_sum_adds_and_subtracts_elementwise():
    a = [5, 9, 4, [5, 3, 1], [3, 1, 0]]
    b = [2, 4, 1, [2, 2], [1]]  # shorter lists: the missing positions are zeros
    assert spec_sum(a, b) == [7, 13, 5, [7, 5, 1], [4, 1, 0]]
    assert spec_sum(a, b, -1) == [3, 5, 3, [3, 1, 1], [2, 1, 0]]
    assert spec_sum(None, b) == [2, 4, 1, [2, 2], [1]]
    assert spec_sum(a, None) is a
    assert spec_sum(None, None) is None


# ---- the supervisor's Prometheus counters --------------------------------------------------------
def test_engine_metrics_spec_counters():
    m = EngineMetrics()
    m.apply(stats_msg(generation_tokens=3))  # no "spec" (no speculation, an older engine): fine
    got = samples(m)
    assert got == {
        ("llmserve_spec_decode_num_drafts_total", None): 0.0,
        ("llmserve_spec_decode_draft_tokens_total", None): 0.0,
        ("llmserve_spec_decode_accepted_tokens_total", None): 0.0,
    }
    m.apply(stats_msg(spec=[3, 7, 4, [3, 3, 1], [2, 2, 0]]))
    m.apply(stats_msg(cancelled=1))
    m.apply(stats_msg(spec=[1, 2, 1, [1, 1, 0], [1, 0, 0]]))
    got = samples(m)
    assert got[("llmserve_spec_decode_num_drafts_total", None)] == 4
    assert got[("llmserve_spec_decode_draft_tokens_total", None)] == 9
    assert got[("llmserve_spec_decode_accepted_tokens_total", None)] == 5
    drafted = {int(p): v for (n, p), v in got.items() if n == "llmserve_spec_decode_draft_tokens_per_pos_total"}
    accepted = {int(p): v for (n, p), v in got.items() if n == "llmserve_spec_decode_accepted_tokens_per_pos_total"}
    assert drafted == {0: 4, 1: 4, 2: 1}
    assert accepted == {0: 3, 1: 2, 2: 0}  # position 2 is there, at 0
    # The bench's reading of the same exposition (Triton's metrics first, as the endpoint serves them).
    text = b"# HELP nv_inference_count x\nnv_inference_count 7\n" + m.exposition()
    snap = prometheus_counters(text.decode())
    assert snap == {
        "generation_tokens": 3,
        "num_drafts": 4,
        "draft_tokens": 9,
        "accepted_tokens": 5,
        "draft_tokens_per_pos": [4, 4, 1],
        "accepted_tokens_per_pos": [3, 2, 0],
    }


# ---- the bench's arithmetic ---------------------------------------------------------------------
def test_spec_summary_from_two_snapshots():
    before = {
        "generation_tokens": 100,
        "num_drafts": 10,
        "draft_tokens": 25,
        "accepted_tokens": 12,
        "draft_tokens_per_pos": [10, 10],  # position 2 not seen yet
        "accepted_tokens_per_pos": [7, 5],
    }
    after = {
        "generation_tokens": 300,
        "num_drafts": 30,
        "draft_tokens": 75,
        "accepted_tokens": 42,
        "draft_tokens_per_pos": [30, 25, 20],
        "accepted_tokens_per_pos": [22, 12, 8],
    }
    s = spec_summary(before, after)
    assert s["num_drafts"] == 20 and s["draft_tokens"] == 50 and s["accepted_tokens"] == 30
    assert s["acceptance_rate"] == pytest.approx(30 / 50)
    assert s["mean_accepted_len"] == pytest.approx(1 + 30 / 20)
    assert s["acceptance_rate_per_pos"] == pytest.approx([15 / 20, 7 / 15, 8 / 20])
    # Nothing verified in between, or a snapshot missing (no endpoint): no figures.
    assert spec_summary(after, after) is None
    assert spec_summary(None, after) is None and spec_summary(before, None) is None
    # A position where nothing was proposed during the level: None, not a division by zero.
    later = after | {"num_drafts": 31, "draft_tokens": 76, "accepted_tokens": 42}
    later |= {"draft_tokens_per_pos": [31, 25, 20], "accepted_tokens_per_pos": [22, 12, 8]}
    assert spec_summary(after, later)["acceptance_rate_per_pos"] == [0.0, None, None]


def test_stats_counters_and_table():
    st = SimpleNamespace(
        generation_tokens=50,
        spec_verified=4,
        spec_draft_tokens=10,
        spec_accepted_tokens=6,
        spec_drafted_at=[4, 4, 2],
        spec_accepted_at=[3, 2, 1],
    )
    zero = SimpleNamespace(**{k: 0 for k in vars(st)} | {"spec_drafted_at": None, "spec_accepted_at": None})
    s = spec_summary(stats_counters(zero), stats_counters(st))
    assert s["acceptance_rate"] == pytest.approx(0.6) and s["mean_accepted_len"] == pytest.approx(2.5)
    assert s["acceptance_rate_per_pos"] == pytest.approx([0.75, 0.5, 0.5])
    summary = {"completed": 1, "failed": 0, "failures": {}, "duration_s": 1.0}
    summary |= {k: 0 for k in ("total_input_tokens", "total_output_tokens", "request_throughput")}
    summary |= {k: 0.0 for k in ("input_throughput", "output_throughput", "total_token_throughput")}
    summary |= {
        k: {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0} for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
    }
    plain = format_table(summary | {"spec_decode": None})
    assert "Speculative" not in plain and "acceptance" not in plain
    table = format_table(summary | {"spec_decode": s})
    assert "Draft acceptance rate:" in table and "0.600" in table
    assert "Mean accepted length (tokens/step):" in table and "2.500" in table
    assert "0.75 0.50 0.50" in table


class FakeMetrics:
    """A loopback /metrics whose successive answers the test sets (the last one repeats)."""

    def __init__(self, bodies: list[str]) -> None:
        self.bodies, self.scrapes = bodies, 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_):
                pass

            def do_GET(self):
                body = fake.bodies[min(fake.scrapes, len(fake.bodies) - 1)].encode()
                fake.scrapes += 1
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def exposition(gen: int, drafts: int, drafted: int, accepted: int) -> str:
    lines = [f"llmserve_generation_tokens_total {gen}.0", f"llmserve_spec_decode_num_drafts_total {drafts}.0"]
    lines += [f"llmserve_spec_decode_draft_tokens_total {drafted}.0"]
    lines += [f"llmserve_spec_decode_accepted_tokens_total {accepted}.0"]
    lines += [f"llmserve_spec_decode_num_drafts_created {time.time()}"]
    lines += [f'llmserve_spec_decode_draft_tokens_per_pos_total{{position="0"}} {drafts}.0']
    lines += [f'llmserve_spec_decode_accepted_tokens_per_pos_total{{position="0"}} {accepted}.0']
    return "\n".join(lines) + "\n"


def test_served_backend_scrapes_and_waits_for_the_heartbeat(monkeypatch):
    """Before and after a level: the second scrape waits until the server's generated-token counter
    has taken in the level's tokens (the counters come with the engine's next heartbeat)."""
    before, stale, fresh = exposition(10, 2, 4, 1), exposition(30, 2, 4, 1), exposition(50, 8, 16, 10)
    fake = FakeMetrics([before, stale, stale, fresh])
    b = backends.make_backend("native", "127.0.0.1", 1, vocab=None)
    b.metrics_url = fake.url

    async def go():
        first = await b.counters()
        second = await b.counters(first, tokens=40)
        return first, second

    try:
        first, second = asyncio.run(go())
    finally:
        fake.close()
    assert fake.scrapes == 4 and second["generation_tokens"] == 50
    s = spec_summary(first, second)
    assert (s["num_drafts"], s["draft_tokens"], s["accepted_tokens"]) == (6, 12, 9)
    assert s["acceptance_rate"] == pytest.approx(0.75) and s["mean_accepted_len"] == pytest.approx(2.5)

    # A server without the counters, or none at all: None at once; never caught up: the last after SETTLE_S.
    monkeypatch.setattr(backends, "SETTLE_S", 0.3)
    fake = FakeMetrics(["llmserve_generation_tokens_total 5.0\n", before])
    b.metrics_url = fake.url
    try:
        assert asyncio.run(b.counters()) is None
        t0 = time.monotonic()
        snap = asyncio.run(b.counters(prometheus_counters(before), tokens=1))
        assert snap["generation_tokens"] == 10 and 0.3 <= time.monotonic() - t0 < 2
    finally:
        fake.close()
    b.metrics_url = fake.url  # closed: refused
    assert asyncio.run(b.counters()) is None
    b.metrics_url = ""
    assert asyncio.run(b.counters()) is None


def test_bench_engine_backend_reports_speculation(tmp_path, monkeypatch, capsys):
    """`llmserve bench --backend engine` with SPECULATE_METHOD=ngram: each level's JSON has its own
    spec_decode, consistent with itself; without speculation, none and no table section."""
    from llmserve.cli import main

    monkeypatch.delenv("MODEL_DIR", raising=False)
    argv = ["bench", "--backend", "engine", "--num-prompts", "4", "--input-len", "24", "--output-len", "24"]
    argv += [
        "--max-concurrency",
        "1,4",
        "--no-progress",
        "--no-plots",
        "--out-dir",
        str(tmp_path),
        "--num-warmups",
        "1",
    ]
    monkeypatch.setenv("SPECULATE_METHOD", "ngram")
    monkeypatch.setenv("SPECULATE_ADAPTIVE", "0")  # drafts every step (the rule may measure them away)
    assert main(argv + ["--result-name", "spec"]) == 0
    out = capsys.readouterr().out
    assert out.count("Draft acceptance rate:") == 2 and out.count("Mean accepted length") == 2
    runs = json.loads((tmp_path / "spec.json").read_text())["runs"]
    for run in runs:
        s = run["spec_decode"]
        assert s["num_drafts"] > 0 and 0 <= s["accepted_tokens"] <= s["draft_tokens"]
        assert s["draft_tokens"] <= 3 * s["num_drafts"]  # k <= SPECULATE_MAX_DRAFT_TOKEN_NUM (3)
        assert s["acceptance_rate"] == pytest.approx(s["accepted_tokens"] / s["draft_tokens"])
        assert s["mean_accepted_len"] == pytest.approx(1 + s["accepted_tokens"] / s["num_drafts"])
        assert len(s["acceptance_rate_per_pos"]) == 3
        # Tokens per request: at most 1 + accepted per step, so the verifying steps bound the output.
        assert run["total_output_tokens"] >= s["num_drafts"] + s["accepted_tokens"]
    monkeypatch.setenv("SPECULATE_METHOD", "none")
    assert main(argv + ["--result-name", "plain"]) == 0
    assert "Speculative" not in capsys.readouterr().out
    assert [r["spec_decode"] for r in json.loads((tmp_path / "plain.json").read_text())["runs"]] == [None, None]


# ---- end to end: engine core -> engine server -> monitor ---------------------------------------
def test_engine_server_stats_carry_spec_deltas(tiny_hf_dir):
    """The served path with SPECULATE_METHOD=ngram: the monitor's stats messages, summed, give exactly
    the counters of the same request run in-process, and are reset after each message."""
    from llmserve.protocol import native
    from llmserve.serving.compose import build_engine
    from llmserve.serving.engine_process import start
    from llmserve.serving.testing import free_ports
    from llmserve.utils.wire import dumps, loads
    from tests.test_engine import dealer

    # A fixed k: the adaptive rule follows measured step times, which differ from run to run.
    settings = dict(model_dir=str(tiny_hf_dir), block_size=4, max_seq_len=256, speculate_method="ngram")
    settings |= dict(speculate_adaptive=False)
    ids = [5, 6, 7, 8, 9] * 6  # repetitive: the n-gram proposer drafts from the first decode step
    body = {"req_id": "r", "input_ids": ids, "max_dec_len": 40, "min_dec_len": 40, "temperature": 0}
    port = free_ports(1)[0]
    server = start(Config.from_env({}, inter_proc_port=port, **settings))
    client, monitor = dealer(port, b"c"), dealer(port, b"m")
    items: list[dict] = []
    stats: list[dict] = []
    try:
        monitor.send(dumps({"op": "hello", "role": "monitor"}))
        client.send(dumps({"op": "add", "req_id": "r", "request": record(body)}))
        deadline = time.monotonic() + 60
        done_at = None
        while done_at is None or time.monotonic() < done_at + 1.2:  # then 2 more heartbeats
            assert time.monotonic() < deadline, "timed out"
            assert server.run_once(20)
            while client.poll(0):
                items += loads(client.recv()).get("items", [])
            while monitor.poll(0):
                msg = loads(monitor.recv())
                if msg.get("op") == "stats":
                    stats.append(msg)
            if done_at is None and items and items[-1]["is_end"]:
                done_at = time.monotonic()
    finally:
        client.close(0)
        monitor.close(0)
        server._shutdown()
    assert items[-1]["error_code"] == 0, items[-1]
    served_ids = [t for x in items for t in x["token_ids"]]
    total = None
    for msg in stats:
        total = spec_sum(total, msg.get("spec"))
    assert total is not None, "no stats message carried speculative decoding's counters"
    verified, drafted, accepted, drafted_at, accepted_at = total
    assert verified > 0 and drafted > 0 and 0 <= accepted <= drafted
    assert sum(drafted_at) == drafted and sum(accepted_at) == accepted and drafted_at[0] == verified
    assert all(a <= d for a, d in zip(accepted_at, drafted_at))
    assert "spec" not in stats[-1]  # the idle heartbeats after the request: reset after sending
    assert sum(m["generation_tokens"] for m in stats) == len(served_ids) == 40

    # The same request in this process: the same tokens, the same counters.
    engine = build_engine(Config.from_env({}, **settings))
    try:
        req = native.parse(body)
        params = native.admit(req, ids, engine.max_model_len, 40, engine.runner.vocab_size)
        engine.add_request("r", ids, params)
        local_ids = []
        while engine.has_unfinished():
            local_ids += [t for o in engine.step() for t in o.new_token_ids]
        st = engine.stats()
    finally:
        engine.shutdown()
    assert local_ids == served_ids
    assert total == [
        st.spec_verified,
        st.spec_draft_tokens,
        st.spec_accepted_tokens,
        st.spec_drafted_at,
        st.spec_accepted_at,
    ]
