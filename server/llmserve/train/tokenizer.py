"""The models' tokenizer: a byte-level BPE trained on the corpus's training split.

The demo tokenizer's conventions (llmserve.models.demo_tokenizer): ids 0 `<s>`, 1 `</s>`,
2 `<|im_start|>`, 3 `<|im_end|>`, then the 256 byte tokens, then merges, padded with
`<|reserved_N|>` when the text runs out of merges; no bos added by `encode`; the ChatML
template; files that `tokenizers`, `transformers.AutoTokenizer` and `llmserve.engine.tokenizer`
all load. Deterministic: the file order is fixed and the BPE trainer breaks ties by token ids.
Only the training split is seen, so held-out files stay unseen by the tokenizer too.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer

from llmserve.models.demo_tokenizer import BOS, EOS, IM_END, save_tokenizer_files, train_bpe

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    # min_frequency 2: a pair seen once is noise, not a token worth an embedding row
    return train_bpe(texts, vocab_size, min_frequency=2)


def save_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """The tokenizer's files, as the demo tokenizer's are written."""
    save_tokenizer_files(tok, out_dir, model_max_length)


def copy_tokenizer(src: Path, out_dir: Path, model_max_length: int) -> None:
    """Reuse a trained tokenizer; only model_max_length follows the model it is copied beside."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if not (src / name).is_file():
            raise FileNotFoundError(f"{src}: no {name} (expected a tokenizer written by `llmserve train`)")
        if src.resolve() != out_dir.resolve():
            shutil.copyfile(src / name, out_dir / name)
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_max_length"] = model_max_length
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False, sort_keys=True) + "\n")


def special_ids(tok: Tokenizer) -> tuple[int, tuple[int, ...]]:
    """bos id and the eos ids generation stops at (`</s>`, `<|im_end|>`), as the engine's loader sees them."""
    return tok.token_to_id(BOS), (tok.token_to_id(EOS), tok.token_to_id(IM_END))
