"""OpenAI-compatible request models and their mapping onto native requests.

The HTTP front end validates `/v1/completions` and `/v1/chat/completions`
bodies with these models, then sends each choice to Triton as one native
request (ARCHITECTURE.md, "Native protocol"): `n` choices and list prompts
become several native requests, answered together. What only OpenAI has (its
field names, ranges and defaults, `n`, `echo`, `stream_options`) is checked
here; what both protocols share (limits, the vocabulary, the model name) is
checked once, where every native request is admitted (protocol/native.py), and
its errors come back naming the OpenAI field (`NATIVE_TO_OPENAI`).

Models are strict (no "5" for 5, no 1 for true): a wrong type is a 400 naming
the field. An unknown field is a 400 naming it, as OpenAI answers; fields of
features not built yet are refused by name; `store`, `metadata`, `service_tier`,
`user` and `reasoning_effort` are accepted with no effect, and `prediction` goes on
to the engine as the request's speculative proposals. Beyond OpenAI (vLLM's extensions):
`top_k`, `repetition_penalty`, `min_tokens`, `ignore_eos`, and structured output's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` beside OpenAI's `response_format`.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from llmserve.protocol import structured
from llmserve.protocol.native import INT64_MAX, INT64_MIN
from llmserve.protocol.openai_options import REASONING_EFFORTS, Prediction, StreamOptions
from llmserve.protocol.openai_tools import AssistantToolCall, NamedToolChoice, StrictModel, Tool, call_arguments

MAX_N = 16  # choices per request (n x prompts), so one body cannot flood the queue
MAX_STOPS = 4  # as OpenAI

# A native field named by an admission error -> the OpenAI field the client sent.
NATIVE_TO_OPENAI = {
    "max_dec_len": "max_tokens",
    "min_dec_len": "min_tokens",
    "topp": "top_p",
    "penalty_score": "repetition_penalty",
    "frequency_score": "frequency_penalty",
    "presence_score": "presence_penalty",
    "stop_sequences": "stop",
    "prompt_logprobs": "logprobs",
}


class OpenAIValidationError(ValueError):
    """A bad request body: `param` names the field, `message` says what is wrong."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _refuse(name: str, why: str = "is not supported by this server yet") -> OpenAIValidationError:
    return OpenAIValidationError(f"{name}: {why}", name)


class _Sampling(StrictModel):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1, description="tokens to generate at most")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description="0 is greedy (default 1)")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description="nucleus sampling (default 1)")
    n: int = Field(default=1, ge=1, le=MAX_N, description="choices to generate")
    stream: bool = False
    stream_options: StreamOptions | None = Field(default=None, description="only with stream: true")
    stop: str | list[str] | None = Field(default=None, description="up to 4 stop strings (not returned in the text)")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(default=None, description="token id -> bias in [-100, 100]")
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX, description="choice i uses seed + i")
    user: str | None = Field(default=None, description="accepted (OpenAI's abuse monitoring; none here)")
    # Accepted as OpenAI does, with no effect here (docs/api.md): nothing is stored, tiered or billed.
    store: bool | None = Field(default=None, description="accepted; no effect (nothing is stored)")
    metadata: dict[str, str] | None = Field(default=None, description="accepted; no effect")
    service_tier: str | None = Field(default=None, description="accepted; no effect (one tier)")
    reasoning_effort: Literal[REASONING_EFFORTS] | None = Field(  # type: ignore[valid-type]
        default=None, description="accepted; unused (no reasoning budget is enforced)"
    )
    prediction: Prediction | None = Field(default=None, description="predicted output: speculative proposals")
    # Extensions (vLLM-style).
    top_k: int | None = Field(default=None, ge=0, description="extension: top-k sampling (0: off)")
    repetition_penalty: float | None = Field(default=None, gt=0.0, description="extension: native penalty_score")
    min_tokens: int | None = Field(default=None, ge=0, description="extension: native min_dec_len")
    ignore_eos: bool = Field(default=False, description="extension: go on past end-of-sequence tokens")
    # Structured output (protocol/structured.py; checked where the native request is admitted).
    response_format: dict[str, Any] | None = Field(default=None, description="text, json_object or json_schema")
    guided_json: dict[str, Any] | str | None = Field(default=None, description="extension: a JSON schema")
    guided_regex: str | None = Field(default=None, description="extension: a regular expression")
    guided_choice: list[str] | None = Field(default=None, description="extension: one of these strings")
    guided_grammar: str | None = Field(default=None, description="extension: a Lark grammar")
    # Tool calling (chat only; protocol/tool_calls.py).
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Features not built yet: refused by name unless they ask for nothing.
    functions: Any = None
    function_call: Any = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @model_validator(mode="after")
    def _common(self):
        if self.stream_options is not None and not self.stream:
            raise _refuse("stream_options", "only allowed when stream is true")
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise _refuse(name, "is deprecated by OpenAI and not served: use tools and tool_choice")
        self._check_tools()
        return self

    def _check_tools(self) -> None:
        names = [t.function.name for t in self.tools or []]
        choice = self.tool_choice
        if self.parallel_tool_calls is not None and not self.tools and isinstance(self, ChatCompletionRequest):
            raise OpenAIValidationError(
                "parallel_tool_calls: only allowed when tools are specified", "parallel_tool_calls"
            )
        if (self.tools or choice is not None or self.parallel_tool_calls is not None) and not isinstance(
            self, ChatCompletionRequest
        ):
            raise _refuse("tools" if self.tools else "tool_choice", "only on /v1/chat/completions")
        if choice not in (None, "none") and not self.tools:
            raise OpenAIValidationError("tool_choice: needs tools", "tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise OpenAIValidationError(f"tool_choice: no tool named {choice.function.name!r} in tools", "tool_choice")
        if len(set(names)) != len(names):
            raise OpenAIValidationError("tools: two tools have the same name", "tools")
        if self.forces_tool_call and any(getattr(self, f) is not None for f in structured.FIELDS):
            raise OpenAIValidationError(
                "response_format: cannot be combined with tool_choice required or a named function", "response_format"
            )
        if self.parallel_tool_calls is False and not self.forces_tool_call and self.calls_tools:
            raise OpenAIValidationError(
                "parallel_tool_calls: false is honoured with tool_choice required or a named function (a grammar "
                "then allows one call); with auto the model may call several",
                "parallel_tool_calls",
            )

    @property
    def calls_tools(self) -> bool:
        """Tools are offered (rendered into the prompt, and the output parsed for calls)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forces_tool_call(self) -> bool:
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice))

    def offered_tools(self) -> list[dict]:
        """The tools a call may use: all, or the named one."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []]
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in tools if t["function"]["name"] == self.tool_choice.function.name]
        return tools

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        """Usage in every chunk (vLLM's stream_options.continuous_usage_stats, with include_usage)."""
        return self.include_usage() and self.stream_options.continuous_usage_stats

    def native_fields(self, max_tokens: int | None, index: int) -> dict[str, Any]:
        """The native request fields for choice `index` (prompt fields aside)."""
        body: dict[str, Any] = {
            "req_id": f"{uuid.uuid4().hex}-{index}",
            "model": self.model,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "topp": 1.0 if self.top_p is None else self.top_p,
            "presence_score": self.presence_penalty,
            "frequency_score": self.frequency_penalty,
            "penalty_score": self.repetition_penalty,  # None: the model's default
            "min_dec_len": 1 if self.min_tokens is None else self.min_tokens,
            "stop_sequences": list(self.stop or []),
            "return_usage": True,
            "stream": True,
        }
        if max_tokens is not None:
            body["max_dec_len"] = max_tokens
        if self.top_k is not None:
            body["top_k"] = self.top_k
        if self.seed is not None:  # wraps within int64, as the engine takes it
            body["seed"] = (self.seed + index - INT64_MIN) % (1 << 64) + INT64_MIN
        if self.logit_bias:
            body["logit_bias"] = self.logit_bias
        if self.ignore_eos:
            body["ignore_eos"] = True
        for name in structured.FIELDS:
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.calls_tools:
            body["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
        if self.prediction is not None and self.prediction.text():
            body["prediction"] = self.prediction.text()
        return body


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="text, texts, token ids, or lists of token ids (one choice group each)"
    )
    max_tokens: int | None = Field(default=16, ge=1, description="tokens to generate at most (default 16)")
    echo: bool = Field(default=False, description="prepend the prompt to the text (and its logprobs)")
    logprobs: int | None = Field(default=None, ge=0, le=5, description="log-probabilities of the top k tokens")
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, description="only 1 (or n)")

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
            raise _refuse("suffix", "is not supported (insertion needs a fill-in-the-middle model)")
        if self.best_of is not None and self.best_of != self.n:
            raise _refuse("best_of", f"only best_of = n ({self.n}) is supported")
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
                    if self.echo:  # the prompt's tokens are echoed with their logprobs too
                        body["prompt_logprobs"] = self.logprobs
                if self.echo and not isinstance(prompt, str):
                    body["echo"] = True  # the engine sends the token ids' text back
                out.append(body)
        return out


REFUSED_MESSAGE_FIELDS = frozenset({"audio", "function_call", "refusal"})


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    # As vLLM: any role, and fields beyond OpenAI's, go on to the chat template (which may refuse them).
    model_config = ConfigDict(extra="allow", strict=True)
    role: str = Field(min_length=1)
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's earlier calls

    @model_validator(mode="after")
    def _openai_extras(self) -> ChatMessage:
        # OpenAI's own message fields this server has no feature for are refused by name, not passed on.
        for name, value in (self.model_extra or {}).items():  # null (an SDK's echo of a reply) asks for nothing
            if name in REFUSED_MESSAGE_FIELDS and value is not None:
                raise _refuse(name, "is not supported by this server (text messages only)")
        return self

    def flat(self) -> dict[str, Any]:
        """{role, content} as the chat template wants it (text parts joined; developer is system);
        `name`, `tool_call_id` and `tool_calls` go along for templates that use them (a call's
        arguments as an object, as HF templates expect, when they are JSON)."""
        c = self.content
        text = c if isinstance(c, str) else "".join(p.text for p in c or [])
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        for k in ("name", "tool_call_id"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        out.update({k: v for k, v in (self.model_extra or {}).items() if k not in REFUSED_MESSAGE_FIELDS})
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": t.id, "type": "function", "function": {"name": t.function.name, "arguments": call_arguments(t)}}
                for t in self.tool_calls
            ]
        return out


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
    """The first error, as `field: message`, with the field as `param` (OpenAI's wording for an unknown one)."""
    err = e.errors()[0]
    if err["type"] == "extra_forbidden":
        loc = ".".join(str(x) for x in err["loc"])
        return OpenAIValidationError(f"Unrecognized request argument supplied: {loc}", loc)
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


def openai_param(req: CompletionRequest | ChatCompletionRequest, native: str | None) -> str | None:
    """The OpenAI field the client sent, for a native field named by an admission error."""
    if native is None:
        return None
    chat = isinstance(req, ChatCompletionRequest)
    if native in ("text", "input_ids", "messages"):
        return "messages" if chat else "prompt"
    if native == "max_dec_len" and chat and req.max_completion_tokens is not None:
        return "max_completion_tokens"
    if native == "logprobs" and chat:
        return "top_logprobs"
    return NATIVE_TO_OPENAI.get(native, native)
