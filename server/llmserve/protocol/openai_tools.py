"""OpenAI's function-tool request models: the tools offered, a named tool_choice, and an assistant's
earlier calls sent back in the conversation (parsing a model's calls: tool_calls.py)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StrictModel(BaseModel):
    """OpenAI request models: unknown fields refused by name, no type coercion."""

    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDef(StrictModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class AssistantToolCall(StrictModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


def call_arguments(t: AssistantToolCall) -> Any:
    """A call's arguments as an object, as HF chat templates expect, when they are JSON."""
    try:
        return json.loads(t.function.arguments)
    except ValueError:
        return t.function.arguments
