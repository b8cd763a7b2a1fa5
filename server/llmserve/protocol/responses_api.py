"""OpenAI's Responses API (`POST /v1/responses`): the request model and its mapping onto a chat request.

A Responses request is served as one chat completion (protocol/openai.py): `instructions` becomes the
system message, `input` (a text, or a list of message, function_call and function_call_output items)
the conversation, `max_output_tokens` max_tokens, `text.format` response_format, and function tools
the chat tools. `previous_response_id` puts the conversation the server kept for that response
(http/responses_store.py) before `input`; its instructions are not carried over, as OpenAI does.
What Responses has beyond chat and this server does not do (built-in tools, background runs, images,
truncation "auto") is refused by name; what has no effect here (`service_tier`, `user`,
`safety_identifier`, `prompt_cache_key`) is accepted and echoed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from llmserve.protocol.openai import OpenAIValidationError, _error_from
from llmserve.protocol.openai_tools import StrictModel

# A chat field named by an error of the chat path -> the Responses field the client sent.
CHAT_TO_RESPONSES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "tools": "tools",
    "tool_choice": "tool_choice",
    "top_logprobs": "top_logprobs",
}


class _Text(StrictModel):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None  # on output_text a client sends back: none are made here
    logprobs: list[Any] | None = None  # ditto


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[_Text]
    id: str | None = None  # an earlier output message sent back
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        for k, part in enumerate(v if isinstance(v, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text"):
                raise OpenAIValidationError(
                    f"content[{k}].type: {kind!r}: only text parts (input_text, output_text) are served here",
                    f"content[{k}].type",
                )
        return v


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[_Text]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(StrictModel):
    """An earlier reasoning item sent back: dropped (chat templates drop earlier turns' reasoning)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
ITEM_TYPES: dict[str, type[StrictModel]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


def _item(k: int, raw: Any) -> InputItem:
    """Input item `k`, by its `type` (a message may leave it out), errors naming `input[k].field`."""
    where = f"input[{k}]"
    if not isinstance(raw, dict):
        raise OpenAIValidationError(f"{where}: expected an object", where)
    kind = raw.get("type", "message")
    model = ITEM_TYPES.get(kind) if isinstance(kind, str) else None
    if model is None:
        known = ", ".join(ITEM_TYPES)
        raise OpenAIValidationError(f"{where}.type: {kind!r} is not served here (items: {known})", f"{where}.type")
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        err = _error_from(e)
        param = f"{where}.{err.param}" if err.param else where
        msg = err.message.replace(err.param, param, 1) if err.param else f"{where}: {err.message}"
        raise OpenAIValidationError(msg, param) from None


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted; a local model has no such knob


class ResponsesRequest(StrictModel):
    """POST /v1/responses."""

    model: str
    input: str | list[Any]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    store: bool = True  # honoured: false keeps nothing (previous_response_id cannot name it)
    metadata: dict[str, str] | None = None  # echoed in the response
    truncation: Literal["disabled"] | None = None  # "auto" (drop the oldest turns) is not done here
    include: list[Literal["message.output_text.logprobs"]] | None = None
    # Accepted, no effect here (echoed where the Response has the field).
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Refused unless they ask for nothing.
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    conversation: Any = None
    prompt: Any = None

    @field_validator("input")
    @classmethod
    def _items(cls, v: str | list[Any]) -> str | list[InputItem]:
        return v if isinstance(v, str) else [_item(k, raw) for k, raw in enumerate(v)]

    @model_validator(mode="after")
    def _checks(self) -> ResponsesRequest:
        if isinstance(self.input, str) and not self.input:
            raise OpenAIValidationError("input: the text is empty", "input")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise OpenAIValidationError("input: the list is empty", "input")
        if self.background:
            raise OpenAIValidationError("background: background responses are not served here", "background")
        if self.reasoning:
            raise OpenAIValidationError(
                "reasoning: not configurable per request here (REASONING_PARSER sets it server-wide)", "reasoning"
            )
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema" and fmt.schema_ is None:
            raise OpenAIValidationError("text.format.schema: needed with type json_schema", "text.format.schema")
        for name in ("max_tool_calls", "conversation", "prompt"):
            if getattr(self, name) is not None:
                raise OpenAIValidationError(f"{name}: is not supported by this server", name)
        return self

    def chat_body(self, history: list[dict]) -> dict[str, Any]:
        """The chat completion body that serves this request; `history`: the kept conversation of
        `previous_response_id` (chat messages), or []."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        messages += history + input_messages(self.input)
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream}
        for ours, chat in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
            if getattr(self, ours) is not None:
                body[chat] = getattr(self, ours)
        if self.top_logprobs is not None or self.include:
            body["logprobs"] = True
            body["top_logprobs"] = self.top_logprobs or 0
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in self.tools
            ]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.parallel_tool_calls is not None:  # chat's rules for it apply (and name it)
            body["parallel_tool_calls"] = self.parallel_tool_calls
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema":
            spec = {"name": fmt.name or "response", "schema": fmt.schema_}
            if fmt.strict is not None:
                spec["strict"] = fmt.strict
            body["response_format"] = {"type": "json_schema", "json_schema": spec}
        elif fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        return body

    def echo(self) -> dict[str, Any]:
        """The request's fields a Response object repeats."""
        fmt = self.text.format if self.text and self.text.format else TextFormat(type="text")
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []]
        for t in tools:
            t.setdefault("strict", None)
        choice = self.tool_choice or "auto"
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "model": self.model,
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": self.previous_response_id,
            "service_tier": self.service_tier or "default",
            "store": self.store,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": choice.model_dump() if isinstance(choice, NamedFunction) else choice,
            "tools": tools,
            "top_logprobs": self.top_logprobs,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "truncation": "disabled",
            "user": self.user,
            "safety_identifier": self.safety_identifier,
            "prompt_cache_key": self.prompt_cache_key,
        }


def input_messages(items: str | list) -> list[dict]:
    """Chat messages of Responses input: consecutive function_call items become one assistant message
    with tool_calls (joined to the assistant text just before them), outputs become tool messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                last["content"] = last["content"] or None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out


def parse_responses(body: dict) -> ResponsesRequest:
    try:
        return ResponsesRequest.model_validate(body)
    except ValidationError as e:
        raise _error_from(e) from None


def responses_param(chat_param: str | None) -> str | None:
    """The Responses field the client sent, for a chat field named by an error."""
    if chat_param is None:
        return None
    head, _, rest = chat_param.partition(".")
    if head == "messages":
        return "input"
    if head == "response_format":
        return "text.format" + (f".{rest}" if rest else "")
    return CHAT_TO_RESPONSES.get(head, head) + (f".{rest}" if rest and head != "messages" else "")
