"""download_model.py against a local HTTP server (with Range support) that the test runs."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "download_model.py"
MODEL = "org/Model-1/weight_only_int8"


class Store:
    """Files served under /models/<path>; `cut` truncates the next reply of a path after n bytes."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.cut: dict[str, int] = {}
        self.log: list[tuple[str, str | None]] = []  # (path, Range header)


def make_handler(store: Store):
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a) -> None:
            pass

        def do_GET(self) -> None:
            path = self.path.removeprefix("/models/")
            rng = self.headers.get("Range")
            store.log.append((path, rng))
            data = store.files.get(path)
            if data is None:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            start = int(rng.split("=")[1].split("-")[0]) if rng else 0
            if start >= len(data) and rng:
                self.send_response(416)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = data[start:]
            self.send_response(206 if rng else 200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            cut = store.cut.pop(path, None)
            if cut is not None:  # die mid-transfer
                self.wfile.write(body[:cut])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)
                return
            self.wfile.write(body)

    return H


@pytest.fixture
def server():
    store = Store()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(store))
    httpd.daemon_threads = True
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield store, f"http://127.0.0.1:{httpd.server_address[1]}/models"
    httpd.shutdown()
    httpd.server_close()


def publish(store: Store, prefix: str, files: dict[str, bytes], md5_override: dict[str, str] | None = None) -> None:
    lines = []
    for name, data in files.items():
        store.files[f"{prefix}/{name}"] = data
        lines.append(f"{name}:{(md5_override or {}).get(name, hashlib.md5(data).hexdigest())}")
    store.files[f"{prefix}/file_list.txt"] = ("\n".join(lines) + "\n").encode()


def run(base: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MODEL_BASE_URL=base)
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


def model_files() -> dict[str, bytes]:
    return {
        "config.json": os.urandom(100),
        "tokenizer.json": os.urandom(3000),
        "rank_0/model.pdiparams": os.urandom(3_000_000 + int.from_bytes(os.urandom(2), "little")),
        "rank_0/model.json": os.urandom(5000),
    }


def test_download_verifies_and_skips_present_files(server, tmp_path):
    store, base = server
    files = model_files()
    publish(store, MODEL, files)
    r = run(base, "--model_name", MODEL, "--dir", str(tmp_path), "--nnodes", "1")
    assert r.returncode == 0, r.stderr
    for name, data in files.items():
        assert (tmp_path / name).read_bytes() == data
    assert not list(tmp_path.rglob("*.part"))
    # A second run fetches nothing but the list.
    store.log.clear()
    r = run(base, "--model_name", MODEL, "--dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert [p for p, _ in store.log] == [f"{MODEL}/file_list.txt"]


def test_interrupted_download_resumes_with_range(server, tmp_path):
    store, base = server
    files = model_files()
    publish(store, MODEL, files)
    big = f"{MODEL}/rank_0/model.pdiparams"
    cut = 1_000_000 + int.from_bytes(os.urandom(2), "little")
    store.cut[big] = cut
    r = run(base, "--model_name", MODEL, "--dir", str(tmp_path))
    assert r.returncode != 0  # the transfer died
    assert not (tmp_path / "rank_0/model.pdiparams").exists()  # never half a file under its name
    kept = (tmp_path / "rank_0/model.pdiparams.part").stat().st_size
    assert 0 < kept <= cut
    store.log.clear()
    r = run(base, "--model_name", MODEL, "--dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "rank_0/model.pdiparams").read_bytes() == files["rank_0/model.pdiparams"]
    assert (big, f"bytes={kept}-") in store.log


def test_md5_mismatch_fails_and_leaves_no_file(server, tmp_path):
    store, base = server
    files = {"config.json": os.urandom(64)}
    publish(store, MODEL, files, md5_override={"config.json": "0" * 32})
    r = run(base, "--model_name", MODEL, "--dir", str(tmp_path))
    assert r.returncode == 1
    assert "md5" in r.stderr
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize("bad", ["../evil.txt", "/etc/evil", "a/../../evil"])
def test_paths_escaping_dir_are_refused(server, tmp_path, bad):
    store, base = server
    store.files[f"{MODEL}/file_list.txt"] = f"{bad}:{'a' * 32}\n".encode()
    out = tmp_path / "out"
    r = run(base, "--model_name", MODEL, "--dir", str(out))
    assert r.returncode == 1
    assert "refusing" in r.stderr
    assert not (tmp_path / "evil.txt").exists()


def test_model_name_escaping_is_refused(server, tmp_path):
    _, base = server
    r = run(base, "--model_name", "../../etc", "--dir", str(tmp_path))
    assert r.returncode == 1 and "refusing model name" in r.stderr


def test_multi_node_and_speculative_model(server, tmp_path):
    store, base = server
    master, slave, mtp = model_files(), {"rank_1/model.pdiparams": os.urandom(2000)}, {"mtp.pdiparams": os.urandom(999)}
    publish(store, f"{MODEL}/master", master)
    publish(store, f"{MODEL}/slave", slave)
    publish(store, f"{MODEL}/mtp", mtp)
    r = run(base, "--model_name", MODEL, "--dir", str(tmp_path / "m"), "--nnodes", "2", "--mode", "slave")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "m/rank_1/model.pdiparams").read_bytes() == slave["rank_1/model.pdiparams"]
    assert not (tmp_path / "m/config.json").exists()
    r = run(
        base,
        "--model_name",
        MODEL,
        "--dir",
        str(tmp_path / "n"),
        "--nnodes",
        "2",
        "--speculate_model_path",
        str(tmp_path / "s"),
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "n/config.json").read_bytes() == master["config.json"]
    assert (tmp_path / "s/mtp.pdiparams").read_bytes() == mtp["mtp.pdiparams"]


def test_missing_model_is_a_clear_error(server, tmp_path):
    _, base = server
    r = run(base, "--model_name", "no/such/model", "--dir", str(tmp_path))
    assert r.returncode == 1 and "HTTP 404" in r.stderr


def test_the_seeds_deepseek_names_are_checked_against_their_table(server, tmp_path):
    store, base = server
    two = "deepseek-ai/DeepSeek-R1-MTP-2nodes/weight_only_int8"
    r = run(base, "--model_name", two, "--dir", str(tmp_path / "a"))  # a 2-node model on one node
    assert r.returncode == 1 and "2-node model" in r.stderr and "--nnodes 2" in r.stderr
    r = run(base, "--model_name", "deepseek-ai/DeepSeek-R1/weight_only_int8", "--dir", str(tmp_path / "b"))
    assert r.returncode == 1 and "a8w8_fp8_wint4, weight_only_int4" in r.stderr  # the one-node formats listed
    assert not store.log  # refused before any request
    ranks = {f"rank_{i}/model.pdiparams": os.urandom(64) for i in range(8)}
    publish(store, "deepseek-ai/DeepSeek-R1-MTP/weight_only_int4", {"config.json": b"{}", **ranks})
    r = run(base, "--model_name", "deepseek-ai/DeepSeek-R1-MTP/weight_only_int4", "--dir", str(tmp_path / "c"))
    assert r.returncode == 0, r.stderr
    assert "config.json, rank_0 ... rank_7 (8 ranks)" in r.stdout and "warning" not in r.stdout
    assert "BLOCK_BS 36" in r.stdout and "MTP model (weight_only_int8) was not fetched" in r.stdout
    publish(store, f"{two}/slave", {"rank_8/model.pdiparams": b"x"})
    r = run(base, "--model_name", two, "--dir", str(tmp_path / "d"), "--nnodes", "2", "--mode", "slave")
    assert r.returncode == 0, r.stderr
    assert "rank_8 (warning: the seeds' table expects 8 rank directories a node, found 1)" in r.stdout
