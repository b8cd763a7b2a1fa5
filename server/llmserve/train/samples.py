"""The demo's everyday prompts and the rule for degenerate repetition (issue 45, docs/models.md).

A greedy completion is degenerate when a line, or a run of 4 or more tokens, comes more than twice
in a row. `python -m llmserve.train.samples DIR` prints 64 greedy tokens of DIR's HF checkpoint
(transformers, float32) for each prompt and what the rule says: the check a training run ends with.
tests/test_demo_model.py applies the same rule to the served demo.
"""

from __future__ import annotations

import sys
from pathlib import Path

NEW_TOKENS = 64
MIN_RUN = 4  # tokens of the shortest repeated run that counts
MAX_REPEATS = 2  # in a row; a third is degenerate

# (name, prompt): a str is completed as is; a list of messages goes through the chat template.
PROMPTS: list[tuple[str, str | list[dict]]] = [
    ("readme_fibonacci", "def fibonacci(n):\n"),
    ("readme_import_os", "import os\n\ndef "),
    ("readme_chat", [{"role": "user", "content": "Write a Python function that reverses a string."}]),
    ("function", "def read_config(path):\n"),
    ("function_typed", "def parse_args(argv: list[str]) -> argparse.Namespace:\n"),
    ("class", "class Stack:\n"),
    ("class_init", "class Point:\n    def __init__(self, x, y):\n"),
    ("imports", "import sys\nimport json\nfrom pathlib import Path\n\n"),
    ("loop", "for i, line in enumerate(lines):\n"),
    ("docstring", 'def median(values):\n    """'),
    ("test", "import unittest\n\n\nclass TestParser(unittest.TestCase):\n    def test_"),
    ("main", 'if __name__ == "__main__":\n'),
]


def repeated_line(text: str) -> str | None:
    """The first line that comes more than MAX_REPEATS times in a row (blank lines count too)."""
    lines = text.split("\n")
    for i in range(len(lines) - MAX_REPEATS):
        if all(lines[i + j] == lines[i] for j in range(1, MAX_REPEATS + 1)):
            return lines[i]
    return None


def repeated_run(ids: list[int]) -> tuple[int, int] | None:
    """(start, length) of the first run of >= MIN_RUN tokens that comes more than MAX_REPEATS times in a row."""
    reps = MAX_REPEATS + 1
    for length in range(MIN_RUN, len(ids) // reps + 1):
        for i in range(len(ids) - reps * length + 1):
            run = ids[i : i + length]
            if all(ids[i + k * length : i + (k + 1) * length] == run for k in range(1, reps)):
                return i, length
    return None


def degenerate(ids: list[int], text: str) -> str | None:
    """Why a completion (its token ids and text) is degenerate, or None."""
    line = repeated_line(text)
    if line is not None:
        return f"line {line!r} more than {MAX_REPEATS} times in a row"
    run = repeated_run(ids)
    if run is not None:
        return f"a run of {run[1]} tokens at {run[0]} more than {MAX_REPEATS} times in a row"
    return None


def _greedy_hf(model_dir: Path) -> int:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    stops = {tok.convert_tokens_to_ids(t) for t in ("</s>", "<|im_end|>")}
    bad = 0
    for name, prompt in PROMPTS:
        if isinstance(prompt, list):
            text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        else:
            text = prompt
        ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=sorted(stops))
        new = [t for t in out[0, ids.shape[1] :].tolist() if t not in stops]
        completion = tok.decode(new)
        why = degenerate(new, completion)
        bad += why is not None
        print(f"--- {name}: {len(new)} tokens, {why or 'ok'}\n{text}<<<{completion}>>>", flush=True)
    print(f"{bad} of {len(PROMPTS)} completions degenerate")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(_greedy_hf(Path(sys.argv[1])))
