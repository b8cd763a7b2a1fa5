"""Chat templates: Jinja2 in a sandbox, with the globals and filters Hugging Face templates use."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """No chat template, malformed messages, or the template refused them (HTTP 400)."""


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile in a sandbox with the globals HF templates use (raise_exception, strftime_now, tojson)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e


def check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {'role': str, 'content': str} objects")
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatTemplateError(
                f"messages[{k}] must be an object with 'role' and 'content', got {type(m).__name__}"
            )
        if not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"messages[{k}].role must be a string, got {m.get('role')!r}")
        if not isinstance(m.get("content"), str):
            raise ChatTemplateError(f"messages[{k}].content must be a string, got {type(m.get('content')).__name__}")
