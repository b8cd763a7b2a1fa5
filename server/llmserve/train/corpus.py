"""The training corpus: the Python standard library of the running interpreter.

Files: every `*.py` under `sysconfig.get_paths()["stdlib"]`, sorted by relative path, except
- anything under `site-packages` / `dist-packages` (third-party code, different on every machine);
- generated data: `pydoc_data/` (one dict of documentation prose) and the codec tables written
  by `gencodec.py` (`encodings/cp1252.py` and the like: 256-entry tables of escapes);
- files that are not UTF-8 or that this interpreter cannot parse: Python 2 sources and the
  deliberately broken inputs of the test suite (`lib2to3/tests/data`, `test/tokenizedata`, ...).
The test suite itself stays: it is ordinary Python source, about half of the corpus.

Split by file: the file at index i of that list is held out when i % 50 == 0. Each split is
tokenized into one stream (each file's tokens, then `</s>`, in file order), cached as .npy
under `cache_dir/stream-<key>/`; the key hashes the tokenizer, the candidate files (paths,
sizes, mtimes), the file limit and these rules.

ChatML (`chat_every` N > 0): every Nth training file is written as a chat exchange instead, the
way the served chat template renders one: `<|im_start|>user\n{request}<|im_end|>\n<|im_start|>
assistant\n{source}<|im_end|>`, the request being the first line of its module docstring (or
"Write {file name}."). A model never trained on those ids has no idea what follows them; with
this, a chat request gets Python back, ended by `<|im_end|>`. The held-out stream stays plain.
The corpus, and so every model trained on it,
depends on the interpreter's version: Python 3.11's stdlib is not 3.12's.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HELDOUT_EVERY = 50
RULES_VERSION = 1  # bump when the file rules or the stream layout change: old caches are then ignored
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "pydoc_data"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def candidate_files(root: Path) -> list[Path]:
    """Relative paths of the .py files outside the skipped directories, sorted (cheap: no reads)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel = Path(dirpath).relative_to(root)
        out += [rel / f for f in filenames if f.endswith(".py")]
    return sorted(out, key=lambda p: p.as_posix())


def read_source(path: Path) -> str | None:
    """The file's text, or None for files that are not Python source this interpreter reads."""
    try:
        text = path.read_bytes().decode("utf-8")
        if "gencodec.py" in text[:1000]:
            return None
        compile(text, str(path), "exec", flags=ast.PyCF_ONLY_AST, dont_inherit=True)
    except (UnicodeDecodeError, SyntaxError, ValueError):
        return None
    return text


@dataclass(frozen=True)
class Corpus:
    root: Path
    train: list[Path]  # relative to root
    heldout: list[Path]

    def texts(self, split: str) -> Iterator[str]:
        for rel in getattr(self, split):
            yield (self.root / rel).read_text(encoding="utf-8")


def load_corpus(root: Path | None = None, max_files: int | None = None) -> Corpus:
    """The kept files (the first `max_files` of them when given), split by file."""
    root = root or stdlib_root()
    kept: list[Path] = []
    for rel in candidate_files(root):
        if max_files is not None and len(kept) >= max_files:
            break
        if read_source(root / rel) is not None:
            kept.append(rel)
    if not kept:
        raise FileNotFoundError(f"{root}: no Python source files found")
    heldout = [p for i, p in enumerate(kept) if i % HELDOUT_EVERY == 0]
    train = [p for i, p in enumerate(kept) if i % HELDOUT_EVERY != 0]
    return Corpus(root, train, heldout)


def chat_exchange(rel: Path, text: str) -> str:
    """The file as a ChatML exchange: a request made of its docstring's first line, the source as the answer."""
    try:
        doc = ast.get_docstring(ast.parse(text)) or ""
    except (SyntaxError, ValueError):
        doc = ""
    request = doc.strip().split("\n")[0].strip() or f"Write {rel.name}."
    return f"<|im_start|>user\n{request}<|im_end|>\n<|im_start|>assistant\n{text}<|im_end|>"


def _chat_texts(corpus: Corpus, chat_every: int) -> Iterator[str]:
    for i, (rel, text) in enumerate(zip(corpus.train, corpus.texts("train"))):
        yield chat_exchange(rel, text) if chat_every and i % chat_every == 0 else text


def _stream_key(tokenizer_json: bytes, root: Path, max_files: int | None, chat_every: int = 0) -> str:
    h = hashlib.sha256(tokenizer_json)
    chat = f" chat {chat_every}" if chat_every else ""  # plain streams keep their earlier keys
    h.update(f"{RULES_VERSION} {HELDOUT_EVERY} {max_files} {root}{chat}\n".encode())
    for rel in candidate_files(root):
        st = (root / rel).stat()
        h.update(f"{rel.as_posix()} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _encode(tokenizer, texts: Iterator[str], eos_id: int, dtype: type) -> np.ndarray:
    parts: list[np.ndarray] = []
    batch: list[str] = []

    def flush() -> None:
        for enc in tokenizer.encode_batch(batch, add_special_tokens=False):
            parts.append(np.asarray(enc.ids + [eos_id], dtype=dtype))
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) == 64:
            flush()
    flush()
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def token_streams(
    tokenizer_dir: Path, cache_dir: Path, max_files: int | None = None, root: Path | None = None, chat_every: int = 0
) -> tuple[dict[str, np.ndarray], dict]:
    """{"train": tokens, "heldout": tokens} and corpus statistics, from the cache when it has them;
    `chat_every`: every Nth training file as a ChatML exchange (module docstring)."""
    from tokenizers import Tokenizer

    root = root or stdlib_root()
    tok_json = (Path(tokenizer_dir) / "tokenizer.json").read_bytes()
    where = Path(cache_dir) / f"stream-{_stream_key(tok_json, root, max_files, chat_every)}"
    if not (where / "stats.json").exists():
        corpus = load_corpus(root, max_files)
        tok = Tokenizer.from_str(tok_json.decode("utf-8"))
        dtype = np.uint16 if tok.get_vocab_size() <= 1 << 16 else np.int32
        tmp = where.with_name(f"{where.name}.tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        stats: dict = {"root": str(root), "max_files": max_files, "chat_every": chat_every}
        for split in ("train", "heldout"):
            texts = _chat_texts(corpus, chat_every) if split == "train" else corpus.texts(split)
            ids = _encode(tok, texts, tok.token_to_id("</s>"), dtype)
            np.save(tmp / f"{split}.npy", ids)
            files = getattr(corpus, split)
            stats[split] = {
                "files": len(files),
                "bytes": sum((root / p).stat().st_size for p in files),
                "tokens": int(ids.size),
            }
            (tmp / f"{split}_files.txt").write_text("".join(p.as_posix() + "\n" for p in files))
        (tmp / "stats.json").write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")
        try:
            tmp.rename(where)  # atomic, so a reader never sees half a cache
        except OSError:
            shutil.rmtree(tmp)  # a concurrent run wrote the same streams first
    stats = json.loads((where / "stats.json").read_text())
    return {s: np.load(where / f"{s}.npy") for s in ("train", "heldout")}, stats
