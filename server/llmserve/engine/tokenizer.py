"""One tokenizer API over `tokenizers` (tokenizer.json), SentencePiece (*.model) and HF.

`load_tokenizer(model_dir)` picks the backend from the files present:
tokenizer.json first, else tokenizer.model (or another *.model); `use_hf=True`
(USE_HF_TOKENIZER=1) loads `transformers.AutoTokenizer` instead.

Rules the engine relies on:
- bos/eos: tokenizer_config.json's `add_bos_token` / `add_eos_token` decide when
  present (as for Llama tokenizers); otherwise tokenizer.json's post-processor
  decides (as HF's generic fast tokenizer does); SentencePiece adds bos by default.
- `eos_token_ids` (generation stops at any of them) = the config's eos_token,
  + `eos_token_id` of generation_config.json and config.json in the same dir,
  + known end-of-turn tokens present in the vocabulary (END_OF_TURN_TOKENS,
  e.g. `<|im_end|>`), so chat generation stops at the end of the assistant turn.
- SentencePiece: text between added/control tokens is encoded segment by segment,
  each with SentencePiece's dummy-prefix space (Llama-2 reference / HF legacy=True).
- Chat prompts: render with `apply_chat_template`, then encode with
  `add_special_tokens=False` (the template writes its own special tokens), as
  `encode_chat` does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext

from llmserve.engine.chat_template import ChatTemplateError, check_messages, compile_chat_template

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<end_of_turn>", "<|end|>")
EXPECTED_FILES = "tokenizer.json (HF tokenizers) or a SentencePiece model (tokenizer.model or *.model)"
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class TokenizerNotFoundError(FileNotFoundError):
    """The model directory holds no tokenizer we can load."""


def _byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet: printable bytes map to themselves, others to U+0100 onward."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = _byte_decoder()


def _piece_bytes(piece: str) -> bytes:
    """Bytes of a SentencePiece-style piece: <0xNN> byte pieces, '▁' for spaces."""
    m = _BYTE_PIECE.match(piece)
    return bytes([int(m.group(1), 16)]) if m else piece.replace("▁", " ").encode()


class _FastBackend:
    """A `tokenizers.Tokenizer` (tokenizer.json)."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        added = tok.get_added_tokens_decoder()
        self.added = {i: t.content for i, t in added.items()}
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.byte_level = tok.decoder is not None and '"ByteLevel"' in tok.decoder.__getstate__().decode()

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def token_bytes(self, i: int) -> bytes:
        token = self.tok.id_to_token(i)
        if token is None:
            return b""
        if i in self.added:
            return token.encode()
        if self.byte_level and all(c in _BYTE_LEVEL for c in token):
            return bytes(_BYTE_LEVEL[c] for c in token)
        return _piece_bytes(token)


class _SentencePieceBackend:
    """A SentencePiece model plus the added tokens listed in tokenizer_config.json."""

    def __init__(self, path: Path, added: dict[int, tuple[str, bool]]) -> None:
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.n_pieces = self.sp.get_piece_size()
        self.added = {i: content for i, (content, _) in added.items()}
        control = {i for i in range(self.n_pieces) if self.sp.is_control(i)}
        self.special_ids = frozenset(control | {i for i, (_, special) in added.items() if special})
        self.vocab_size = max([self.n_pieces, *(i + 1 for i in self.added)])
        # Text that names an added or control token (e.g. "<|im_start|>", "<s>") becomes that token.
        self.literal = {self.sp.id_to_piece(i): i for i in control} | {c: i for i, c in self.added.items()}
        alternatives = sorted(self.literal, key=len, reverse=True)
        self.split_re = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")") if alternatives else None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        parts = self.split_re.split(text) if self.split_re else [text]
        ids: list[int] = []
        for k, part in enumerate(parts):
            if k % 2:
                ids.append(self.literal[part])
            elif part:
                ids.extend(self.sp.encode(part))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        out, run = [], []
        for i in ids:
            if i in self.special_ids or i in self.added:
                if not (skip_special_tokens and i in self.special_ids):
                    out.append(self.sp.decode(run))
                    out.append(self.id_to_token(i) or "")
                    run = []
            elif 0 <= i < self.n_pieces:
                run.append(i)
        out.append(self.sp.decode(run))
        return "".join(out)

    def id_to_token(self, i: int) -> str | None:
        if i in self.added:
            return self.added[i]
        return self.sp.id_to_piece(i) if 0 <= i < self.n_pieces else None

    def token_to_id(self, token: str) -> int | None:
        if token in self.literal:
            return self.literal[token]
        i = self.sp.piece_to_id(token)
        return i if self.sp.id_to_piece(i) == token else None

    def token_bytes(self, i: int) -> bytes:
        if i in self.added:
            return self.added[i].encode()
        if not 0 <= i < self.n_pieces or self.sp.is_control(i):
            return b""
        return _piece_bytes(self.sp.id_to_piece(i))


class _HFBackend:
    """transformers.AutoTokenizer (USE_HF_TOKENIZER=1): HF decides bos/eos itself."""

    def __init__(self, hf: Any) -> None:
        self.hf = hf
        self.special_ids = frozenset(hf.all_special_ids)
        self.vocab_size = len(hf)
        backend = getattr(hf, "backend_tokenizer", None)
        self.fast = _FastBackend(backend) if backend is not None else None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.hf.convert_ids_to_tokens(i)

    def token_to_id(self, token: str) -> int | None:
        i = self.hf.convert_tokens_to_ids(token)
        return None if i is None or i == self.hf.unk_token_id and token != self.hf.unk_token else i

    def token_bytes(self, i: int) -> bytes:
        return self.fast.token_bytes(i) if self.fast else self.decode([i], False).encode()


def _token_str(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """What the engine and the protocol layers need from a tokenizer."""

    def __init__(
        self,
        backend: Any,
        config: dict[str, Any],
        chat_template: str | None = None,
        extra_eos_ids: Iterable[int] = (),
        name: str = "",
    ) -> None:
        self._backend = backend
        self.name = name
        self.chat_template = chat_template
        self.vocab_size: int = backend.vocab_size
        self.special_token_ids: frozenset[int] = backend.special_ids
        self.bos_token = _token_str(config.get("bos_token"))
        self.eos_token = _token_str(config.get("eos_token"))
        self.bos_token_id = self.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self.token_to_id(self.eos_token) if self.eos_token else None
        self._add_bos: bool | None = config.get("add_bos_token")
        self._add_eos: bool | None = config.get("add_eos_token")
        eos = {self.eos_token_id, *extra_eos_ids, *map(self.token_to_id, END_OF_TURN_TOKENS)}
        self.eos_token_ids: frozenset[int] = frozenset(i for i in eos if i is not None)
        max_len = config.get("model_max_length")
        self.model_max_length: int | None = max_len if isinstance(max_len, int) and max_len < 10**9 else None
        self._template_vars = {
            k: v for k in ("bos_token", "eos_token", "unk_token", "pad_token") if (v := _token_str(config.get(k)))
        }

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, backend={type(self._backend).__name__})"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encode_batch([text], add_special_tokens)[0]

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of each text; a tokenizer.json backend encodes them in one call, on all cores (a burst of
        prompts is admitted at once rather than one prompt after another)."""
        # add_bos_token / add_eos_token in the config: ours to add, else the backend's own rule.
        explicit = self._add_bos is not None or self._add_eos is not None
        backend_specials = add_special_tokens and not explicit
        batch = getattr(self._backend, "encode_batch", None)
        if batch is not None and len(texts) > 1:
            out = batch(texts, backend_specials)
        else:
            out = [self._backend.encode(t, backend_specials) for t in texts]
        if add_special_tokens and explicit:
            for ids in out:
                if self._add_bos and self.bos_token_id is not None:
                    ids.insert(0, self.bos_token_id)
                if self._add_eos and self.eos_token_id is not None:
                    ids.append(self.eos_token_id)
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(ids, skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        return [self._backend.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def decode_token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (may be part of a UTF-8 character): OpenAI logprobs' `bytes`."""
        return self._backend.token_bytes(token_id)

    @cached_property
    def context_anchor(self) -> tuple[list[int], str]:
        """Tokens with visible text, and that text, to decode in front of a mid-stream window.

        Decoders that strip a leading space at the start of the text (SentencePiece,
        Llama's Strip decoder) then keep the window's leading spaces (see detokenizer).
        """
        ids = self._backend.encode("a", False)
        return ids, self.decode(ids, skip_special_tokens=False)

    @cached_property
    def _template(self) -> jinja2.Template | None:
        return compile_chat_template(self.chat_template) if self.chat_template else None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render the model's chat template; extra kwargs (e.g. tools) reach the template."""
        if self._template is None:
            raise ChatTemplateError(
                f"{self.name or 'this model'} has no chat template; send a plain text prompt instead"
            )
        check_messages(messages)
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self._template_vars, **kwargs
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template: {e}") from e

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt, **kwargs), add_special_tokens=False
        )  # the template writes the special tokens it wants


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _pick_template(value: Any) -> str | None:
    """HF stores either one template or a list of named ones; use 'default'."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default", next(iter(named.values()), None))
    elif isinstance(value, dict):
        value = value.get("default", next(iter(value.values()), None))
    return value if isinstance(value, str) else None


def _dir_eos_ids(d: Path) -> set[int]:
    """eos_token_id of generation_config.json and config.json (an int or a list)."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        eos = _read_json(d / name).get("eos_token_id")
        ids.update(e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int))
    return ids


def load_tokenizer(model_dir: str | Path, use_hf: bool = False) -> Tokenizer:
    d = Path(model_dir)
    if not d.is_dir():
        raise TokenizerNotFoundError(f"model directory {d} does not exist; expected it to hold {EXPECTED_FILES}")
    config = _read_json(d / "special_tokens_map.json") | _read_json(d / "tokenizer_config.json")
    template = _pick_template(config.get("chat_template"))
    if template is None and (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None:
        template = _pick_template(_read_json(d / "chat_template.json").get("chat_template"))
    extra_eos = _dir_eos_ids(d)

    if use_hf:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(d))
        hf_config = {"bos_token": hf.bos_token, "eos_token": hf.eos_token, "unk_token": hf.unk_token}
        hf_config |= {"pad_token": hf.pad_token, "model_max_length": hf.model_max_length}
        template = _pick_template(getattr(hf, "chat_template", None)) or template
        return Tokenizer(_HFBackend(hf), hf_config, template, extra_eos, name=f"{d} (transformers)")

    if (d / "tokenizer.json").is_file():
        from tokenizers import Tokenizer as HFTokenizer

        backend = _FastBackend(HFTokenizer.from_file(str(d / "tokenizer.json")))
        return Tokenizer(backend, config, template, extra_eos, name=str(d))

    sp_models = sorted(d.glob("*.model"), key=lambda p: (p.name != "tokenizer.model", p.name))
    if sp_models:
        added = {
            int(i): (t["content"], bool(t.get("special", False)))
            for i, t in config.get("added_tokens_decoder", {}).items()
        }
        backend = _SentencePieceBackend(sp_models[0], added)
        sp = backend.sp
        defaults = {"bos_token": sp.id_to_piece(sp.bos_id()) if sp.bos_id() >= 0 else None, "add_bos_token": True}
        defaults |= {"eos_token": sp.id_to_piece(sp.eos_id()) if sp.eos_id() >= 0 else None, "add_eos_token": False}
        defaults |= {"unk_token": sp.id_to_piece(sp.unk_id()) if sp.unk_id() >= 0 else None}
        return Tokenizer(backend, defaults | config, template, extra_eos, name=str(d))

    found = sorted(p.name for p in d.iterdir())
    hint = " (vocab.json + merges.txt: set USE_HF_TOKENIZER=1)" if (d / "vocab.json").is_file() else ""
    raise TokenizerNotFoundError(f"no tokenizer in {d}: expected {EXPECTED_FILES}{hint}; found {found}")
