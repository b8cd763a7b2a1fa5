"""The front end's tokenizer, loaded on first use only.

Chat templates and token counting happen in the engine (native `messages`,
`usage`), so most requests never need it. It turns token ids into text for
OpenAI `logprobs` (token strings and bytes) and for `echo` of token-id prompts.
"""

from __future__ import annotations

import threading

from llmserve.config import Config

_lock = threading.Lock()
_tokenizer = None


def get_tokenizer(config: Config):
    global _tokenizer
    if _tokenizer is None:
        with _lock:
            if _tokenizer is None:
                from llmserve.engine.loader import resolve_model_dir
                from llmserve.engine.tokenizer import load_tokenizer

                _tokenizer = load_tokenizer(resolve_model_dir(config), use_hf=config.use_hf_tokenizer)
    return _tokenizer


def set_tokenizer(tokenizer) -> None:
    """Use this tokenizer (tests; or a front end that already has one)."""
    global _tokenizer
    _tokenizer = tokenizer
