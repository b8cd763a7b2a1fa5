"""Demo tokenizer training, the Tokenizer wrapper's backends, HF equivalence, chat templates."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import new_seed

from llmserve.engine.tokenizer import ChatTemplateError, TokenizerNotFoundError, load_tokenizer
from llmserve.models.demo_tokenizer import (
    BOS,
    EOS,
    IM_END,
    IM_START,
    build_demo_tokenizer,
    train_demo_sentencepiece,
    train_demo_tokenizer,
)

# Pools for random text: common and rare CJK (rare ones split into byte tokens), other scripts, emoji with ZWJ.
POOLS = [
    "the quick brown fox jumps over lazy dogs",
    "今天天气很好我们去公园散步鬱龘齉爨饕餮魑魅魍魉",
    "今日はいい天気ですねカタカナ",
    "오늘은날씨가정말좋네요",
    "Привет мир ёжик",
    "àéîõüçñßøå",
    "😀🎉🍕👨‍👩‍👧‍👦🇯🇵👍🏽❤️",
    "0123456789 +-*/=()[]{}<>.,;:!?'\"\n\t",
]


def random_text(rng: random.Random, max_len: int = 40) -> str:
    """Plain text: never a special token's string (the pools can spell "<s>", about once in 10^5 texts, which
    every backend encodes as the special token, as HF's tokenizers do); tests that want specials add them."""
    while True:
        text = "".join(rng.choice(rng.choice(POOLS)) for _ in range(rng.randint(1, max_len)))
        if not any(special in text for special in (BOS, EOS, IM_START, IM_END)):
            return text


@pytest.fixture(scope="module")
def rng(request) -> random.Random:
    return random.Random(new_seed(request, 32))


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("demo_tok")
    train_demo_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("sp_tok")
    train_demo_sentencepiece(d)
    return d


def test_training_is_deterministic(tmp_path):
    train_demo_tokenizer(tmp_path / "a")
    train_demo_tokenizer(tmp_path / "b")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


@pytest.mark.parametrize("size", [300, 2048, 6000])
def test_vocab_has_exactly_the_requested_size(size):
    tok = build_demo_tokenizer(size)
    assert tok.get_vocab_size(with_added_tokens=True) == size
    assert [tok.token_to_id(t) for t in (BOS, EOS, IM_START, IM_END)] == [0, 1, 2, 3]
    assert sorted(tok.get_vocab().values()) == list(range(size))  # no holes: every id decodes
    padded = tok.token_to_id("<|reserved_0|>")  # the corpus holds fewer merges than 6000 ids need
    assert (padded is not None) == (size == 6000) and tok.decode([5, 6, size - 1], skip_special_tokens=True)


def test_demo_special_tokens_and_eos_rule(demo_dir):
    tok = load_tokenizer(demo_dir)
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id) == (2048, 0, 1)
    assert tok.eos_token_ids == frozenset({1, 3})  # </s> and <|im_end|>
    assert tok.model_max_length == 8192
    ids = tok.encode("Hello world")
    assert ids[0] != tok.bos_token_id  # add_bos_token is false for the demo
    assert tok.encode(f"{IM_START}user\nhi{IM_END}")[0] == 2
    assert tok.decode([0, *ids, 3, 1]) == "Hello world"
    assert tok.decode([0, *ids, 3], skip_special_tokens=False) == f"{BOS}Hello world{IM_END}"
    assert tok.convert_ids_to_tokens([3, 0]) == [IM_END, BOS]
    assert tok.token_to_id(IM_END) == 3 and tok.token_to_id("no such token") is None


def test_demo_byte_level_roundtrip_and_token_bytes(demo_dir, rng):
    tok = load_tokenizer(demo_dir)
    rare = tok.encode("龘")  # not in the corpus: several byte tokens, none decodes alone
    assert len(rare) > 1 and all("\ufffd" in tok.decode([i]) for i in rare)
    for _ in range(200):
        text = random_text(rng)
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert b"".join(tok.decode_token_bytes(i) for i in ids) == text.encode()


def test_hf_autotokenizer_matches_ours(demo_dir, rng):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(demo_dir))
    ours, via_hf = load_tokenizer(demo_dir), load_tokenizer(demo_dir, use_hf=True)
    assert (hf.bos_token_id, hf.eos_token_id, len(hf)) == (ours.bos_token_id, ours.eos_token_id, ours.vocab_size)
    assert via_hf.eos_token_ids == ours.eos_token_ids and via_hf.vocab_size == ours.vocab_size
    for _ in range(100):
        text = random_text(rng)
        if rng.random() < 0.5:
            text = f"{IM_START}{text}{rng.choice([IM_END, EOS, BOS])}{random_text(rng, 5)}"
        for add in (True, False):
            ids = ours.encode(text, add_special_tokens=add)
            assert hf.encode(text, add_special_tokens=add) == ids == via_hf.encode(text, add_special_tokens=add)
        for skip in (True, False):
            assert hf.decode(ids, skip_special_tokens=skip) == ours.decode(ids, skip) == via_hf.decode(ids, skip)
        assert [via_hf.decode_token_bytes(i) for i in ids] == [ours.decode_token_bytes(i) for i in ids]
    messages = [
        {"role": "system", "content": random_text(rng)},
        {"role": "user", "content": random_text(rng)},
        {"role": "assistant", "content": random_text(rng)},
        {"role": "user", "content": random_text(rng)},
    ]
    for gen in (True, False):
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected
        assert via_hf.apply_chat_template(messages, add_generation_prompt=gen) == expected
        assert ours.encode_chat(messages, gen) == hf.encode(expected, add_special_tokens=False)


def test_chat_template_renders_chatml(demo_dir):
    tok = load_tokenizer(demo_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "你好"},
    ]
    body = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n你好<|im_end|>\n"
    )
    assert tok.apply_chat_template(messages) == body + "<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == body
    ids = tok.encode_chat(messages)
    assert ids.count(2) == 5 and ids.count(3) == 4 and ids[-1] != 3


@pytest.mark.parametrize(
    "messages, match",
    [
        ([{"role": "wizard", "content": "x"}], "unknown role: wizard"),  # the template's raise_exception
        ([{"content": "x"}], r"messages\[0\]\.role must be a string"),
        ([{"role": "user", "content": "a"}, {"role": 7, "content": "x"}], r"messages\[1\]\.role"),
        ([{"role": "user"}], r"messages\[0\]\.content must be a string"),
        ([{"role": "user", "content": None}], r"content must be a string"),
        ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], r"content must be a string, got list"),
        (["hello"], r"messages\[0\] must be an object"),
        ([], "non-empty list"),
        ("hello", "non-empty list"),
    ],
)
def test_chat_template_errors(demo_dir, messages, match):
    tok = load_tokenizer(demo_dir)
    with pytest.raises(ValueError, match=match) as info:
        tok.apply_chat_template(messages)
    assert isinstance(info.value, ChatTemplateError)


def _write_config(d: Path, **changes) -> None:
    path = d / "tokenizer_config.json"
    config = json.loads(path.read_text()) | changes
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


def _copy_demo(demo_dir: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in demo_dir.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_template_sources_and_variables(demo_dir, tmp_path):
    d = _copy_demo(demo_dir, tmp_path / "tok")
    msgs = [{"role": "user", "content": "hi"}]
    _write_config(d, chat_template=None)
    tok = load_tokenizer(d)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template(msgs)
    # chat_template.jinja (transformers >= 4.43 saves it there); bos/eos variables; loop controls.
    (d / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    tok = load_tokenizer(d)
    assert tok.apply_chat_template(msgs + [{"role": "skip", "content": "x"}]) == "<s>[user]hi</s>[assistant]"
    # A list of named templates: "default" is used.
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages|length }}"}]
    _write_config(d, chat_template=named)
    assert load_tokenizer(d).apply_chat_template(msgs) == "D1"
    _write_config(d, chat_template="{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        load_tokenizer(d).apply_chat_template(msgs)
    # Sandboxed: templates cannot reach Python internals.
    _write_config(d, chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        load_tokenizer(d).apply_chat_template(msgs)


def test_add_bos_and_eos_from_config(demo_dir, tmp_path):
    d = _copy_demo(demo_dir, tmp_path / "tok")
    plain = load_tokenizer(d).encode("Hello", add_special_tokens=False)
    _write_config(d, add_bos_token=True, add_eos_token=True)
    tok = load_tokenizer(d)
    assert tok.encode("Hello") == [0, *plain, 1]
    assert tok.encode("Hello", add_special_tokens=False) == plain


def test_eos_ids_from_generation_config(demo_dir, tmp_path):
    d = _copy_demo(demo_dir, tmp_path / "tok")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    (d / "config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert load_tokenizer(d).eos_token_ids == frozenset({1, 3, 7, 9})


def test_missing_tokenizer_lists_expected_and_found(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerNotFoundError, match=r"tokenizer\.json.*tokenizer\.model.*found \['config\.json'\]"):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")


def test_sentencepiece_backend(sp_dir, rng):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    tok = load_tokenizer(sp_dir)
    n = sp.get_piece_size()
    assert type(tok._backend).__name__ == "_SentencePieceBackend"
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id) == (n + 2, 1, 2)
    assert tok.eos_token_ids == frozenset({2, n + 1})  # </s> and the added <|im_end|>
    rare = tok.encode("龘", add_special_tokens=False)
    assert len(rare) > 1 and all(sp.is_byte(i) for i in rare[-3:])  # byte fallback
    for _ in range(100):
        text = random_text(rng).replace("\n", " ")
        ids = tok.encode(text)
        assert ids[0] == 1 and ids[1:] == sp.encode(text)  # bos (LlamaTokenizer default), then SentencePiece
        assert tok.decode(ids) == sp.decode(ids[1:]) == text
        assert b"".join(tok.decode_token_bytes(i) for i in ids[1:]).removeprefix(b" ") == text.encode()
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == n and ids.count(n + 1) == 1 and 1 not in ids
    assert tok.decode(ids, skip_special_tokens=False) == chat
    # Each text segment gets SentencePiece's dummy-prefix space (Llama-2 / HF legacy=True): kept out of sight
    # while specials split the decode, visible once they are skipped.
    assert tok.decode(ids) == "user\nhi \n assistant\n"
    assert tok.decode([1, *sp.encode("a b"), 2], skip_special_tokens=False) == "<s>a b</s>"
    assert tok.convert_ids_to_tokens(n + 1) == IM_END and tok.token_to_id("<s>") == 1
    assert tok.decode([*sp.encode("ok"), 10**6]) == "ok"  # ids past the vocabulary are ignored


def test_tokenizer_json_wins_over_sentencepiece(demo_dir, sp_dir, tmp_path):
    d = _copy_demo(demo_dir, tmp_path / "both")
    (d / "tokenizer.model").write_bytes((sp_dir / "tokenizer.model").read_bytes())
    assert type(load_tokenizer(d)._backend).__name__ == "_FastBackend"


def test_encode_batch_is_encode_of_each(demo_dir, sp_dir, tmp_path, rng):
    """Every backend (tokenizer.json, with add_bos/add_eos from the config too, SentencePiece, HF's
    AutoTokenizer): a burst encoded at once gives each text's own ids, with and without special tokens."""
    bos_eos = _copy_demo(demo_dir, tmp_path / "bos")
    _write_config(bos_eos, add_bos_token=True, add_eos_token=True)
    toks = [load_tokenizer(demo_dir), load_tokenizer(bos_eos), load_tokenizer(sp_dir), load_tokenizer(demo_dir, True)]
    texts = [random_text(rng, 200) for _ in range(24)] + ["<|im_start|>user\nhi<|im_end|>", "x"]
    for tok in toks:
        for special in (True, False):
            assert tok.encode_batch(texts, special) == [tok.encode(t, special) for t in texts], (tok, special)
        assert tok.encode_batch(texts[:1]) == [tok.encode(texts[0])] and tok.encode_batch([]) == []
