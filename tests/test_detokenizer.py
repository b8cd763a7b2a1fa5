"""IncrementalDetokenizer: multi-byte characters split over tokens, special tokens, SentencePiece spaces."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from conftest import new_seed

from llmserve.engine.detokenizer import MAX_INVISIBLE, MAX_PENDING, IncrementalDetokenizer
from llmserve.engine.tokenizer import Tokenizer, load_tokenizer
from llmserve.models.demo_tokenizer import train_demo_sentencepiece, train_demo_tokenizer

POOLS = [
    "the quick brown fox jumps over lazy dogs   ",
    "今天天气很好我们去公园散步鬱龘齉爨饕餮魑魅魍魉",
    "今日はいい天気ですねカタカナ",
    "오늘은날씨가정말좋네요",
    "Привет мир ёжик",
    "àéîõüçñßøå",
    "😀🎉🍕👨‍👩‍👧‍👦🇯🇵👍🏽❤️🫠",
    "0123456789 +-*/=()[]{}<>.,;:!?'\"\n",
]


def random_text(rng: random.Random, max_len: int = 30) -> str:
    return "".join(rng.choice(rng.choice(POOLS)) for _ in range(rng.randint(1, max_len)))


@pytest.fixture(scope="module")
def rng(request) -> random.Random:
    return random.Random(new_seed(request, 32))


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Tokenizer:
    d: Path = tmp_path_factory.mktemp("demo_tok")
    train_demo_tokenizer(d)
    return load_tokenizer(d)


@pytest.fixture(scope="module")
def spm(tmp_path_factory) -> Tokenizer:
    d: Path = tmp_path_factory.mktemp("sp_tok")
    train_demo_sentencepiece(d)
    return load_tokenizer(d)


def stream(tok: Tokenizer, ids: list[int], rng: random.Random, skip: bool = True, **kw) -> list[str]:
    """Feed ids in random chunks (1-3 tokens, as with speculative decoding); return every delta."""
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip, **kw)
    deltas, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3])
        deltas.append(det.step(ids[i : i + n]))
        i += n
        assert det.text == "".join(deltas)
    deltas.append(det.finish())
    return deltas


def check_well_formed(tok: Tokenizer, ids: list[int], rng: random.Random, skip: bool = True) -> list[str]:
    deltas = stream(tok, ids, rng, skip)
    assert not any("\ufffd" in d for d in deltas), deltas
    assert "".join(deltas) == tok.decode(ids, skip), (ids, deltas)
    return deltas


def test_multibyte_characters_are_held_until_complete(bpe):
    ids = bpe.encode("龘")  # not in the training corpus: one byte per token
    det = IncrementalDetokenizer(bpe)
    assert [det.step([i]) for i in ids] == [""] * (len(ids) - 1) + ["龘"]
    ids = bpe.encode("ok 🫠!")
    det = IncrementalDetokenizer(bpe)
    deltas = [det.step([i]) for i in ids]
    assert "".join(deltas) == "ok 🫠!" and "" in deltas and det.finish() == ""


@pytest.mark.parametrize("name", ["bpe", "spm"])
def test_random_multilingual_streams(name, request, rng):
    tok = request.getfixturevalue(name)
    split = 0
    for _ in range(150):
        ids = tok.encode(random_text(rng), add_special_tokens=False)
        split += any("\ufffd" in tok.decode([i]) for i in ids)
        check_well_formed(tok, ids, rng)
    assert split > 20  # the streams really did split characters over tokens


@pytest.mark.parametrize("name", ["bpe", "spm"])
def test_streams_mixing_special_tokens(name, request, rng):
    tok = request.getfixturevalue(name)
    specials = sorted(tok.special_token_ids)
    for _ in range(100):
        # Skipped specials may fall anywhere, even inside a character.
        ids = tok.encode(random_text(rng), add_special_tokens=False)
        for _ in range(rng.randint(1, 4)):
            ids.insert(rng.randint(0, len(ids)), rng.choice(specials))
        deltas = check_well_formed(tok, ids, rng, skip=True)
        assert not any(tok.decode([s], False) in "".join(deltas) for s in specials)
        # Kept specials sit between pieces of text (inside a character they would break it).
        ids = []
        for _ in range(rng.randint(1, 4)):
            ids += tok.encode(random_text(rng, 8), add_special_tokens=False) + [rng.choice(specials)]
        deltas = check_well_formed(tok, ids, rng, skip=False)
        assert "".join(deltas).count(tok.decode([ids[-1]], False)) >= 1


@pytest.mark.parametrize("name", ["bpe", "spm"])
def test_random_token_ids(name, request, rng):
    """Any id sequence, malformed bytes included (a random model emits them): joined deltas equal decode."""
    tok = request.getfixturevalue(name)
    pieces = [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])]  # byte tokens, pieces of characters
    malformed = 0
    for _ in range(1500):
        pool = pieces if rng.random() < 0.7 else range(tok.vocab_size)
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
        deltas = stream(tok, ids, rng)
        assert "".join(deltas) == tok.decode(ids), (ids, deltas)
        malformed += "\ufffd" in tok.decode(ids)
    assert malformed > 500


def test_sentencepiece_spaces_mid_stream(spm, rng):
    sp = spm._backend.sp
    pieces = [sp.piece_to_id(p) for p in ("▁", "▁", "▁the", "▁a", "s")]
    assert sp.unk_id() not in pieces
    for _ in range(200):  # runs of bare "▁" pieces: SentencePiece strips them only at the start of the text
        ids = [rng.choice(pieces) for _ in range(rng.randint(1, 12))]
        check_well_formed(spm, ids, rng)
    ids = spm.encode("Hello  world,   fine", add_special_tokens=False)
    det = IncrementalDetokenizer(spm)
    assert "".join(det.step([i]) for i in ids) == "Hello  world,   fine"


def test_sentencepiece_default_normalization(tmp_path, rng):
    """SentencePiece's defaults (NFKC, remove_extra_whitespaces) strip every leading "▁" piece, not just the
    first: a window decoded on its own would lose spaces. Also: a bare tokenizer.model, no tokenizer_config."""
    import io

    import sentencepiece

    from llmserve.models.demo_tokenizer import corpus_lines

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_lines()), model_writer=model, vocab_size=800, hard_vocab_limit=False,
        byte_fallback=True, character_coverage=0.98, num_threads=1, minloglevel=2,
    )  # fmt: skip
    (tmp_path / "spiece.model").write_bytes(model.getvalue())
    tok = load_tokenizer(tmp_path)
    sp = tok._backend.sp
    assert sp.decode([sp.piece_to_id("▁"), sp.piece_to_id("▁the")]) == "the"  # both spaces stripped
    assert (tok.bos_token_id, tok.eos_token_ids) == (sp.bos_id(), frozenset({sp.eos_id()}))
    pieces = [sp.piece_to_id(p) for p in ("▁", "▁", "▁the", "▁a", "s")]
    for _ in range(200):
        check_well_formed(tok, [rng.choice(pieces) for _ in range(rng.randint(1, 12))], rng)
    for _ in range(50):
        check_well_formed(tok, tok.encode(random_text(rng)), rng)


def test_prompt_context_keeps_the_first_leading_space(spm):
    prompt = spm.encode("The capital of France is")
    out = spm.encode("Paris", add_special_tokens=False)  # "▁Paris"-like pieces, as a model would emit them
    assert spm.convert_ids_to_tokens(out[0]).startswith("▁")
    assert IncrementalDetokenizer(spm).step(out) == "Paris" == spm.decode(out)
    assert IncrementalDetokenizer(spm, prompt_ids=prompt).step(out) == " Paris"


def test_invalid_bytes_come_out_at_finish_or_when_held_too_long(bpe):
    lead = bpe.encode("龘")[0]  # a lone UTF-8 lead byte
    ids = bpe.encode("ab") + [lead]
    det = IncrementalDetokenizer(bpe)
    assert det.step(ids) == "ab" and det.finish() == "\ufffd" and det.text == bpe.decode(ids)
    det = IncrementalDetokenizer(bpe)  # an eos after the broken byte does not release it; finish does
    assert det.step([lead, 1]) == "" and det.finish() == "\ufffd"
    # Lead bytes only: every prefix ends in U+FFFD. All but the last 3 are final and shown at once; past
    # MAX_PENDING tokens the window is cut.
    det = IncrementalDetokenizer(bpe)
    deltas, longest = [], 0
    for _ in range(3 * MAX_PENDING):
        deltas.append(det.step([lead]))
        longest = max(longest, len(det._window))
    assert deltas[:4] == ["", "", "", "\ufffd"] and longest <= MAX_PENDING + 5
    assert det.text == "\ufffd" * len(det.text) and len(det.text) >= 3 * MAX_PENDING - 3
    assert det.step(bpe.encode(" ok")).endswith(" ok") and det.text == "\ufffd" * (3 * MAX_PENDING) + " ok"
    assert det.finish() == ""


def test_window_stays_bounded(bpe, rng):
    text = " ".join(random_text(rng, 10) for _ in range(300))
    ids = bpe.encode(text)
    det = IncrementalDetokenizer(bpe)
    longest = 0
    for i in ids:
        det.step([i])
        longest = max(longest, len(det._window))
    assert det.text + det.finish() == text and longest <= 12
    # A long run of skipped special tokens (no text) is cut from the window too.
    det = IncrementalDetokenizer(bpe)
    assert det.step(bpe.encode("hi")) == "hi"
    assert [det.step([1]) for _ in range(3 * MAX_INVISIBLE)] == [""] * (3 * MAX_INVISIBLE)
    assert len(det._window) <= MAX_INVISIBLE + 3 and det.step(bpe.encode(" there")) == " there"


def test_hf_backend_streams(tmp_path, rng):
    pytest.importorskip("transformers")
    train_demo_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path, use_hf=True)
    for _ in range(30):
        check_well_formed(tok, tok.encode(random_text(rng)), rng)
