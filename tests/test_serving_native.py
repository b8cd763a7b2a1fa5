"""The native request: parsing, defaults, aliases, limits and error codes (no server)."""

from __future__ import annotations

import random

import pytest

from llmserve.protocol import native
from llmserve.protocol.native import NativeError


def test_defaults_follow_the_seeds():
    r = native.parse({"text": "hi"})
    # penalty_score unset: the model's generation_config.json default, else the seeds' 1.0 (the engine's).
    assert (r.min_dec_len, r.topp, r.temperature, r.penalty_score) == (1, 0.7, 0.95, None)
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
        ({"messages": [{"role": "", "content": "b"}]}, "role"),  # any other role: the chat template decides
        ({"messages": []}, "empty"),
        ({"text": "a", "history": [["q", "a"]]}, "history: unknown field"),
        ({"text": "a", "seed": 1 << 63}, "seed"),
        ({"text": "a", "logit_bias": {"3": -100.5}}, "logit_bias"),
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
    p = native.admit(req, [1] * n, max_seq, max_dec)
    assert p.max_tokens == min(max_dec, max_seq - n)  # default: what is left, within MAX_DEC_LEN
    with pytest.raises(NativeError) as e:
        native.admit(req, [1] * max_seq, max_seq, max_dec)
    assert e.value.code == 413 and e.value.param == "text"
    assert e.value.msg.startswith(f"This model's maximum context length is {max_seq} tokens")
    for field in ("max_dec_len", "min_dec_len"):
        with pytest.raises(NativeError) as e:
            native.admit(native.parse({"text": "a", field: max_dec + 1}), [1] * 5, max_seq, max_dec)
        assert e.value.code == 400 and e.value.param == field and "MAX_DEC_LEN" in e.value.msg
    # An explicit max_dec_len that does not fit after the prompt is refused, not cut short.
    m = rng.randint(max_seq - n + 1, max_seq)
    with pytest.raises(NativeError) as e:
        native.admit(native.parse({"text": "a", "max_dec_len": m}), [1] * n, max_seq, max_seq)
    assert e.value.code == 400 and e.value.param == "max_dec_len" and f"you requested {n + m} tokens" in e.value.msg
    assert native.admit(native.parse({"text": "a", "max_dec_len": max_seq - n}), [1] * n, max_seq, max_seq)


def test_admit_checks_the_vocabulary():
    vocab = random.randint(100, 1000)
    for body, field in (
        ({"input_ids": [1, vocab]}, "input_ids"),
        ({"text": "a", "eos_token_ids": [vocab + 5]}, "eos_token_ids"),
        ({"text": "a", "logit_bias": {str(vocab): 1.0}}, "logit_bias"),
    ):
        req = native.parse(body)
        with pytest.raises(NativeError) as e:
            native.admit(req, req.input_ids or [1], 100, 50, vocab)
        assert e.value.code == 400 and e.value.param == field and e.value.msg.startswith(f"{field}: token id")
    p = native.admit(
        native.parse({"text": "a", "logit_bias": {"3": -100, "7": 2.5}, "top_k": 10**6}), [1], 100, 50, vocab
    )
    assert p.logit_bias == {3: -100.0, 7: 2.5} and p.top_k == vocab


def test_seed_takes_the_int64_range():
    for seed in (-1, -(1 << 63), (1 << 63) - 1, 0):
        p = native.admit(native.parse({"text": "a", "seed": seed}), [1], 100, 50)
        assert p.seed == seed & 0xFFFFFFFFFFFFFFFF  # two's complement: distinct seeds stay distinct


def test_served_model_names():
    names = native.served_model_names("/models/llama-8b/", "")
    assert names[0] == "llama-8b" and {"default", "/models/llama-8b/"} <= set(names)
    assert native.served_model_names("", "")[0] == "default"
    assert native.served_model_names("/m/x", "prod")[0] == "prod"
    native.check_model(None, names)
    native.check_model("default", names)
    with pytest.raises(NativeError) as e:
        native.check_model("gpt-4", names)
    assert e.value.code == 404 and e.value.param == "model"


def test_prompt_token_ids_uses_the_chat_template_for_messages_and_system():
    class Tok:  # a plain text: its length; a rendered chat (no special tokens added): its characters
        def encode(self, text, add_special_tokens=True):
            return [len(text)] if add_special_tokens else [ord(c) for c in text]

        def apply_chat_template(self, messages):
            return "".join(m["role"][0] for m in messages)

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
    from llmserve.serving import tritonserver as launcher

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


def test_tokenize_burst_gives_each_request_its_own_ids_or_error():
    """A burst's records taken and encoded at once: each body's ids are what prompt_token_ids gives it alone
    (text with special tokens, a chat rendering without, input_ids as given); a body that does not
    parse and a chat template's error stay with their own request."""
    from llmserve.engine.tokenizer import load_tokenizer
    from llmserve.models.demo import DEMO_HF_DIR

    tok = load_tokenizer(str(DEMO_HF_DIR))
    bodies = [
        {"text": "def f(x):\n    return x"},
        {"messages": [{"role": "user", "content": "import os"}]},
        {"input_ids": [5, 6, 7]},
        "{not json",
        {"text": "class A:\n    pass", "system": "be brief"},
        {"messages": [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}, 1]},
        {"text": "for i in range(3):"},
    ]
    reqs = []
    for body in bodies:  # as the engine server gets them: the records of those that parse (native.record)
        try:
            reqs.append(native.from_record(native.record(native.parse(body))))
        except NativeError as e:
            reqs.append(e)
    got = native.tokenize_burst(reqs, tok)
    assert len(got) == len(bodies)
    for body, entry in zip(bodies, got):
        try:
            req = native.parse(body)
        except NativeError:
            assert isinstance(entry, NativeError)
            continue
        assert entry[0].model_dump(exclude={"req_id"}) == req.model_dump(exclude={"req_id"})  # ids: fresh uuids
        try:
            want = native.prompt_token_ids(req, tok)
        except NativeError as e:
            assert isinstance(entry[1], NativeError) and entry[1].msg == e.msg
            continue
        assert entry[1] == want
    assert sum(isinstance(e, tuple) and isinstance(e[1], list) for e in got) >= 4  # the valid ones encoded
