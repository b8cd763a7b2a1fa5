"""The demo model's tokenizer: a byte-level BPE trained at build time on local text.

`train_demo_tokenizer(out_dir)` writes a Hugging Face-compatible tokenizer
(tokenizer.json, tokenizer_config.json, special_tokens_map.json) that both
`llmserve.engine.tokenizer.load_tokenizer` and `transformers.AutoTokenizer` load.
Same arguments, same bytes: the corpus order is fixed and the BPE trainer breaks
ties by token ids, so the files can be cached and compared.

Token ids: 0 `<s>` (bos), 1 `</s>` (eos), 2 `<|im_start|>`, 3 `<|im_end|>`, then the
256 byte tokens, then merges; when the corpus runs out of merges the vocabulary is
padded with special `<|reserved_N|>` tokens, so it always holds exactly `vocab_size`
ids (a random model may sample any of them). Plain `encode` adds no bos (ChatML /
Qwen2 style: `add_bos_token` is false). Generation stops at `</s>` (tokenizer_config's
eos_token) and at `<|im_end|>`, which the loader adds to `eos_token_ids` as a known
end-of-turn token.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# Local training text for the demo tokenizer (written for this project, a data file of the package): plain
# prose, chat-like turns, code-like lines, numbers, and lines in several scripts so that multi-byte UTF-8 is
# exercised (rare CJK characters stay split over several byte tokens after training).
CORPUS = Path(__file__).with_name("demo_corpus.txt")


def corpus_lines() -> list[str]:
    """The corpus's non-blank lines, in its fixed order (training must be deterministic)."""
    return [line for line in CORPUS.read_text(encoding="utf-8").split("\n") if line.strip()]


BOS, EOS, IM_START, IM_END = "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END)

# ChatML: <|im_start|>{role}\n{content}<|im_end|>\n per message, then the assistant header. With `tools`
# (OpenAI function tools), Hermes' convention, as Qwen2.5 writes it: a system message lists them in
# <tools></tools> and asks for <tool_call> blocks; an assistant's earlier calls are such blocks; tool
# results are `tool` messages (the hermes tool-call parser reads this format: protocol/tool_calls.py).
CHAT_TEMPLATE = (
    "{%- if tools -%}\n"
    "{{- '<|im_start|>system\\n' -}}\n"
    "{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\\n\\n' -}}{%- endif -%}\n"
    "{{- 'You may call these tools, each call one block: <tool_call>\\n"
    '{"name": <name>, "arguments": <arguments>}\\n</tool_call>\\n<tools>\\n\' -}}\n'
    "{%- for tool in tools -%}{{- tool | tojson -}}{{- '\\n' -}}{%- endfor -%}\n"
    "{{- '</tools><|im_end|>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- for message in messages -%}\n"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}\n"
    "{{- raise_exception('unknown role: ' + message['role']) -}}\n"
    "{%- endif -%}\n"
    "{%- if not (tools and loop.first and message['role'] == 'system') -%}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] -}}\n"
    "{%- for call in message['tool_calls'] or [] -%}\n"
    "{{- '\\n<tool_call>\\n' + {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson"
    " + '\\n</tool_call>' -}}\n"
    "{%- endfor -%}\n"
    "{{- '<|im_end|>' + '\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}\n"
)


def train_bpe(texts, vocab_size: int, min_frequency: int = 1) -> Tokenizer:
    """A byte-level BPE with these conventions, trained on `texts`, padded to exactly vocab_size ids."""
    min_size = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be >= {min_size} (256 bytes + special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    missing = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:  # corpus too small for this many merges: pad with unused special ids
        tok.add_special_tokens(
            [AddedToken(f"<|reserved_{i}|>", special=True, normalized=False) for i in range(missing)]
        )
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    return tok


def build_demo_tokenizer(vocab_size: int = 2048) -> Tokenizer:
    """Train the byte-level BPE in memory (about 50 ms)."""
    return train_bpe(corpus_lines(), vocab_size)


def _added_token_entry(content: str) -> dict:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


def save_tokenizer_files(tok: Tokenizer, out_dir: str | Path, model_max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json with these conventions
    (the demo's, and `llmserve train`'s, tokenizers)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"), pretty=True)
    added = tok.get_added_tokens_decoder()
    config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(i): _added_token_entry(added[i].content) for i in sorted(added)},
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": BOS,
        "eos_token": EOS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    special_map = {"bos_token": BOS, "eos_token": EOS, "additional_special_tokens": [IM_START, IM_END]}
    for name, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map)):
        (out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")


def train_demo_tokenizer(out_dir: str | Path, vocab_size: int = 2048, *, model_max_length: int = 8192) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into out_dir."""
    save_tokenizer_files(build_demo_tokenizer(vocab_size), out_dir, model_max_length)


def train_demo_sentencepiece(out_dir: str | Path, vocab_size: int = 1024) -> None:
    """A Llama-2-style SentencePiece tokenizer.model (BPE, byte fallback), for tests of that path.

    ChatML tokens are added past the SentencePiece vocabulary through tokenizer_config.json's
    added_tokens_decoder, as HF exports of extended Llama vocabularies do.
    """
    import sentencepiece as spm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_lines()),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        hard_vocab_limit=False,
        byte_fallback=True,
        split_digits=True,
        character_coverage=0.98,  # rarer characters fall back to byte pieces
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    (out / "tokenizer.model").write_bytes(model.getvalue())
    n = spm.SentencePieceProcessor(model_proto=model.getvalue()).get_piece_size()
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": {str(n): _added_token_entry(IM_START), str(n + 1): _added_token_entry(IM_END)},
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 4096,
        "tokenizer_class": "LlamaTokenizer",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
