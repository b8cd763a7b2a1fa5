"""OpenAI-compatible request models and their mapping onto native requests.

The HTTP front end validates `/v1/completions` and `/v1/chat/completions`
bodies with these models, then sends each choice to Triton as one native
request (ARCHITECTURE.md, "Native protocol"): `n` choices and list prompts
become several native requests, answered together.

Models are strict (no "5" for 5, no 1 for true): a wrong type is a 400 naming
the field. Unknown fields are ignored, as OpenAI's own clients send extras.
Beyond OpenAI: `top_k`, `repetition_penalty` and `min_tokens` pass through.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_N = 16  # choices per request (n x prompts), so one body cannot flood the queue


class OpenAIValidationError(ValueError):
    """A bad request body: `param` names the field, `message` says what is wrong."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=1, description="tokens to generate at most")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description="0 is greedy (default 1)")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description="nucleus sampling (default 1)")
    n: int = Field(default=1, ge=1, le=MAX_N, description="choices to generate")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(default=None, description="stop strings (not returned in the text)")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, description="seeds choice i with seed + i")
    user: str | None = None
    # Extensions (vLLM-style).
    top_k: int | None = Field(default=None, ge=0, description="extension: top-k sampling (0: off)")
    repetition_penalty: float | None = Field(default=None, gt=0.0, description="extension: native penalty_score")
    min_tokens: int | None = Field(default=None, ge=0, description="extension: native min_dec_len")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def native_fields(self, max_tokens: int | None, index: int) -> dict[str, Any]:
        """The native request fields for choice `index` (prompt fields aside)."""
        body: dict[str, Any] = {
            "req_id": f"{uuid.uuid4().hex}-{index}",
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "topp": 1.0 if self.top_p is None else self.top_p,
            "presence_score": self.presence_penalty,
            "frequency_score": self.frequency_penalty,
            "penalty_score": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
            "min_dec_len": 1 if self.min_tokens is None else self.min_tokens,
            "stop_sequences": list(self.stop or []),
            "return_usage": True,
            "stream": True,
        }
        if max_tokens is not None:
            body["max_dec_len"] = max_tokens
        if self.top_k is not None:
            body["top_k"] = self.top_k
        if self.seed is not None:
            body["seed"] = self.seed + index
        return body


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="text, texts, token ids, or lists of token ids (one choice group each)"
    )
    max_tokens: int | None = Field(default=16, ge=1, description="tokens to generate at most (default 16)")
    echo: bool = Field(default=False, description="prepend the prompt to the text")
    logprobs: int | None = Field(default=None, ge=0, le=5, description="log-probabilities of the top k tokens")
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, str):
            if not v:
                raise ValueError("the prompt is empty")
        elif not v:
            raise ValueError("the prompt list is empty")
        elif isinstance(v[0], str) and any(not p for p in v):
            raise ValueError("a prompt is empty")
        elif isinstance(v[0], list) and any(not p for p in v):
            raise ValueError("a token-id prompt is empty")
        return v

    @model_validator(mode="after")
    def _sizes(self) -> CompletionRequest:
        if self.suffix:
            raise OpenAIValidationError("suffix is not supported", "suffix")
        if len(self.prompts()) * self.n > MAX_N:
            raise OpenAIValidationError(f"prompts x n must be at most {MAX_N}", "n")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def to_native(self) -> list[dict[str, Any]]:
        """One native request per (prompt, choice), in OpenAI's choice order."""
        out = []
        for i, prompt in enumerate(self.prompts()):
            for j in range(self.n):
                body = self.native_fields(self.max_tokens, i * self.n + j)
                body["text" if isinstance(prompt, str) else "input_ids"] = prompt
                if self.logprobs is not None:
                    body["logprobs"] = self.logprobs
                out.append(body)
        return out


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def flat(self) -> dict[str, str]:
        """{role, content} as the chat template wants it (text parts joined; developer is system)."""
        c = self.content
        text = c if isinstance(c, str) else "".join(p.text for p in c or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions (OpenAI flavour)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, description="wins over max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIValidationError("top_logprobs needs logprobs: true", "top_logprobs")
        return self

    def to_native(self) -> list[dict[str, Any]]:
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        messages = [m.flat() for m in self.messages]
        out = []
        for j in range(self.n):
            body = self.native_fields(limit, j)
            body["messages"] = messages
            if self.logprobs:
                body["logprobs"] = self.top_logprobs or 0
            out.append(body)
        return out


def _is_type_tag(s: str) -> bool:
    return s in ("str", "int", "float", "bool", "list", "dict", "none") or any(c in s for c in "[]|-")


def _error_from(e: ValidationError) -> OpenAIValidationError:
    """The first error, as `field: message`, with the field as `param`."""
    err = e.errors()[0]
    # Drop union-branch names (e.g. "list[int]") so the path names the field.
    loc = [str(x) for x in err["loc"] if isinstance(x, int) or not _is_type_tag(str(x))]
    param = ".".join(loc) or None
    ctx_err = (err.get("ctx") or {}).get("error")
    if isinstance(ctx_err, OpenAIValidationError):
        return ctx_err
    msg = err["msg"].removeprefix("Value error, ")
    return OpenAIValidationError(f"{param}: {msg}" if param else msg, param)


def parse_completion(body: dict) -> CompletionRequest:
    try:
        return CompletionRequest.model_validate(body)
    except ValidationError as e:
        raise _error_from(e) from None


def parse_chat(body: dict) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise _error_from(e) from None
