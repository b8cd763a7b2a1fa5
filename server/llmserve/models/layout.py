"""What a model directory holds: a Paddle static-graph export or a HF safetensors checkpoint."""

from __future__ import annotations

from pathlib import Path

PADDLE_PROGRAMS = ("model.json", "model.pdmodel")  # Paddle 3 (PIR) / Paddle 2 (ProgramDesc)

EXPECTED = (
    "a Paddle static-graph export (config.json, rank_0/model.json or rank_0/model.pdmodel, "
    "rank_0/model.pdiparams, tokenizer files) or a Hugging Face checkpoint "
    "(config.json, *.safetensors or model.safetensors.index.json, tokenizer files)"
)


class ModelFormatError(ValueError):
    """The directory is not a model we can serve; the message lists what was expected and found."""


def paddle_program_path(model_dir: str | Path, rank: int = 0) -> Path | None:
    rank_dir = Path(model_dir) / f"rank_{rank}"
    return next((rank_dir / n for n in PADDLE_PROGRAMS if (rank_dir / n).is_file()), None)


def _listing(model_dir: Path, limit: int = 30) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in model_dir.iterdir())
    if (model_dir / "rank_0").is_dir():
        names += sorted(f"rank_0/{p.name}" for p in (model_dir / "rank_0").iterdir())
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more if names else "nothing (empty directory)"


def detect_model_format(model_dir: str | Path) -> str:
    """ "paddle" or "hf"; raises ModelFormatError naming what is missing otherwise."""
    d = Path(model_dir)
    if not d.is_dir():
        raise ModelFormatError(f"model directory {d} does not exist; expected {EXPECTED}")
    has_config = (d / "config.json").is_file()
    program = paddle_program_path(d)
    params = d / "rank_0" / "model.pdiparams"
    if has_config and program is not None and params.is_file():
        return "paddle"
    if has_config and (any(d.glob("*.safetensors")) or (d / "model.safetensors.index.json").is_file()):
        return "hf"
    missing = [] if has_config else ["config.json"]
    if program is not None and not params.is_file():
        missing.append("rank_0/model.pdiparams")
    raise ModelFormatError(
        f"{d} is not a model directory: expected {EXPECTED}; "
        + (f"missing {', '.join(missing)}; " if missing else "")
        + f"found: {_listing(d)}"
    )
