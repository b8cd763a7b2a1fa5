"""The native request: parsing, defaults, aliases, limits and error codes (no server)."""

from __future__ import annotations

import random

import pytest

from llmserve.protocol import native
from llmserve.protocol.native import NativeError


def test_defaults_follow_the_seeds():
    r = native.parse({"text": "hi"})
    assert (r.min_dec_len, r.topp, r.temperature, r.penalty_score) == (1, 0.7, 0.95, 1.0)
    assert (r.frequency_score, r.presence_score, r.stream, r.timeout, r.return_usage) == (0, 0, False, 300, False)
    assert r.req_id and r.req_id != native.parse({"text": "hi"}).req_id  # random each time


def test_aliases_and_single_values():
    r = native.parse(b'{"text": "x", "max_tokens": 7, "top_p": 0.5, "stop": "END", "eos_token_ids": 3}')
    assert (r.max_dec_len, r.topp, r.stop_sequences, r.eos_token_ids) == (7, 0.5, ["END"], [3])


@pytest.mark.parametrize(
    "body, word",
    [
        (b"{nope", "JSON"),
        (b"[1, 2]", "JSON object"),
        ({"text": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one"),
        ({"max_dec_len": 3}, "exactly one"),
        ({"text": "a", "temperature": -0.1}, "temperature"),
        ({"text": "a", "topp": 1.01}, "topp"),
        ({"text": "a", "max_dec_len": 0}, "max_dec_len"),
        ({"text": "a", "penalty_score": 0}, "penalty_score"),
        ({"messages": [{"role": "robot", "content": "b"}]}, "role"),
        ({"messages": []}, "empty"),
    ],
)
def test_invalid_requests_are_400(body, word):
    with pytest.raises(NativeError) as e:
        native.parse(body)
    assert e.value.code == 400 and word in e.value.msg


def test_admit_limits_and_defaults():
    rng = random.Random()
    max_seq, max_dec = rng.randint(200, 400), rng.randint(50, 150)
    req = native.parse({"text": "a"})
    n = rng.randint(1, max_seq - 1)
    p = native.admit(req, n, max_seq, max_dec)
    assert p.max_tokens == min(max_dec, max_seq - n)  # default: what is left, within MAX_DEC_LEN
    with pytest.raises(NativeError) as e:
        native.admit(req, max_seq, max_seq, max_dec)
    assert e.value.code == 413
    for field in ("max_dec_len", "min_dec_len"):
        with pytest.raises(NativeError) as e:
            native.admit(native.parse({"text": "a", field: max_dec + 1}), 5, max_seq, max_dec)
        assert e.value.code == 400 and field in e.value.msg and "MAX_DEC_LEN" in e.value.msg


def test_admit_maps_fields_to_sampling_params():
    body = {"text": "a", "max_dec_len": 9, "min_dec_len": 2, "topp": 0.3, "temperature": 0.5, "penalty_score": 1.3}
    body |= {"frequency_score": 0.2, "presence_score": 0.1, "seed": 42, "stop_sequences": ["x"], "eos_token_ids": [7]}
    p = native.admit(native.parse(body), 4, 100, 50)
    assert (p.max_tokens, p.min_tokens, p.top_p, p.temperature) == (9, 2, 0.3, 0.5)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty, p.seed) == (1.3, 0.2, 0.1, 42)
    assert (p.stop, p.stop_token_ids) == (["x"], [7])
    for greedy in ({"temperature": 0}, {"topp": 0}):
        assert native.admit(native.parse({"text": "a", **greedy}), 4, 100, 50).greedy


def test_prompt_token_ids_uses_the_chat_template_for_messages_and_system():
    class Tok:
        def encode(self, text):
            return [len(text)]

        def encode_chat(self, messages):
            return [ord(m["role"][0]) for m in messages]

    tok = Tok()
    assert native.prompt_token_ids(native.parse({"text": "abc"}), tok) == [3]
    assert native.prompt_token_ids(native.parse({"text": "abc", "system": "s"}), tok) == [ord("s"), ord("u")]
    msgs = {"messages": [{"role": "user", "content": "q"}], "system": "s"}
    assert native.prompt_token_ids(native.parse(msgs), tok) == [ord("s"), ord("u")]
    assert native.prompt_token_ids(native.parse({"input_ids": [5, 6]}), tok) == [5, 6]


def test_native_or_openai_body():
    assert native.is_native_body({"text": "x", "model": "m"})
    assert native.is_native_body({"messages": []})
    assert not native.is_native_body({"model": "m", "messages": [], "max_tokens": 3})


def test_launcher_uses_an_image_s_own_tritonserver(tmp_path, monkeypatch):
    """TRITONSERVER_BIN / TRITON_BACKEND_DIR (a Triton container) replace the wheel's server and backends."""
    from llmserve.triton import launcher

    wheel = launcher.triton_command(grpc_port=1, metrics_port=2, work_dir=tmp_path / "w")
    backends = tmp_path / "backends"
    (backends / "python").mkdir(parents=True)
    monkeypatch.setenv("TRITONSERVER_BIN", wheel.argv[0])
    monkeypatch.setenv("TRITON_BACKEND_DIR", str(backends))
    own = launcher.triton_command(grpc_port=1, metrics_port=2, work_dir=tmp_path / "w2")
    assert own.argv[0] == wheel.argv[0] and f"--backend-directory={backends}" in own.argv
    assert not (tmp_path / "w2").exists()  # nothing copied from the wheel
    monkeypatch.setenv("TRITONSERVER_BIN", str(tmp_path / "missing"))
    with pytest.raises(launcher.TritonNotFound, match="TRITONSERVER_BIN"):
        launcher.triton_command(grpc_port=1, metrics_port=2, work_dir=tmp_path / "w3")
