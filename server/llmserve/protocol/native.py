"""The native (PaddleNLP-style) request and response, shared by Triton and HTTP.

A request is one JSON object (ARCHITECTURE.md, "Native protocol"). `parse`
validates its shape; `admit` checks it against the serving limits once the
prompt is tokenized and builds the engine's SamplingParams. Every rejection is
a `NativeError` whose code is also the HTTP status the front end answers with.

Beyond the seeds: `temperature: 0` (or `topp: 0`) means greedy decoding.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator

from llmserve.engine.sampling_params import SamplingParams
from llmserve.protocol import error_response as error_response  # re-exported: the native error item

# Error codes: also the HTTP status of the error.
BAD_REQUEST = 400
TIMEOUT = 408
DUPLICATE = 409
TOO_LONG = 413
QUEUE_FULL = 429
INTERNAL = 500
NOT_READY = 503

# Fields only the native protocol has: a body holding one of them is native.
NATIVE_ONLY_FIELDS = frozenset(
    {"text", "req_id", "max_dec_len", "min_dec_len", "topp", "frequency_score", "penalty_score", "presence_score"}
    | {"return_usage", "timeout"}
)


class NativeError(Exception):
    def __init__(self, code: int, msg: str) -> None:
        super().__init__(msg)
        self.code = code
        self.msg = msg


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class NativeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    req_id: str = Field(default_factory=lambda: str(uuid.uuid4()), min_length=1, max_length=256)
    text: str | None = None
    messages: list[Message] | None = None
    input_ids: list[int] | None = None
    system: str | None = None
    max_dec_len: int | None = Field(default=None, ge=1, validation_alias=AliasChoices("max_dec_len", "max_tokens"))
    min_dec_len: int = Field(default=1, ge=0)
    topp: float = Field(default=0.7, ge=0.0, le=1.0, validation_alias=AliasChoices("topp", "top_p"))
    top_k: int = Field(default=0, ge=0)
    temperature: float = Field(default=0.95, ge=0.0)
    frequency_score: float = 0.0
    penalty_score: float = Field(default=1.0, gt=0.0)
    presence_score: float = 0.0
    stream: bool = False
    timeout: float = Field(default=300.0, gt=0.0)
    return_usage: bool = False
    seed: int | None = None
    stop_sequences: list[str] = Field(default_factory=list, validation_alias=AliasChoices("stop_sequences", "stop"))
    eos_token_ids: list[int] = Field(default_factory=list)
    logprobs: int | None = Field(default=None, ge=0, le=20, description="top-k logprobs per token (0: the chosen only)")

    @field_validator("stop_sequences", mode="before")
    @classmethod
    def _one_stop(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else ([] if v is None else v)

    @field_validator("eos_token_ids", mode="before")
    @classmethod
    def _one_eos(cls, v: Any) -> Any:
        return [v] if isinstance(v, int) else ([] if v is None else v)


def parse(body: bytes | str | dict) -> NativeRequest:
    """Validate a native request body; NativeError(400) names what is wrong."""
    if isinstance(body, (bytes, str)):
        try:
            body = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise NativeError(BAD_REQUEST, f"the request is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise NativeError(BAD_REQUEST, "the request must be a JSON object")
    try:
        req = NativeRequest.model_validate(body)
    except ValidationError as e:
        errs = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors())
        raise NativeError(BAD_REQUEST, f"invalid request: {errs}") from None
    given = [k for k in ("text", "messages", "input_ids") if getattr(req, k) is not None]
    if len(given) != 1:
        raise NativeError(BAD_REQUEST, "give exactly one of `text`, `messages` or `input_ids`")
    if req.messages is not None and not req.messages:
        raise NativeError(BAD_REQUEST, "`messages` is empty")
    return req


def prompt_token_ids(req: NativeRequest, tokenizer) -> list[int]:
    """Token ids of the prompt: `text` is encoded as is (as `llmserve generate` does);
    `messages` (and `text` with `system`) go through the chat template."""
    if req.input_ids is not None:
        return list(req.input_ids)
    if req.messages is not None:
        messages = [m.model_dump() for m in req.messages]
        if req.system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": req.system})
    elif req.system:
        messages = [{"role": "system", "content": req.system}, {"role": "user", "content": req.text}]
    else:
        return tokenizer.encode(req.text)
    try:
        return tokenizer.encode_chat(messages)
    except ValueError as e:  # ChatTemplateError
        raise NativeError(BAD_REQUEST, f"chat template: {e}") from None


def admit(req: NativeRequest, num_prompt_tokens: int, max_seq_len: int, max_dec_len: int) -> SamplingParams:
    """Check the limits (MAX_SEQ_LEN, MAX_DEC_LEN) and map the fields to SamplingParams."""
    n = num_prompt_tokens
    if n == 0:
        raise NativeError(BAD_REQUEST, "the prompt is empty")
    if n >= max_seq_len:
        raise NativeError(
            TOO_LONG, f"the input has {n} tokens; MAX_SEQ_LEN={max_seq_len} allows at most {max_seq_len - 1}"
        )
    for name in ("max_dec_len", "min_dec_len"):
        v = getattr(req, name)
        if v is not None and v > max_dec_len:
            raise NativeError(BAD_REQUEST, f"{name}={v} exceeds MAX_DEC_LEN={max_dec_len}")
    # Default: what is left of MAX_SEQ_LEN, within MAX_DEC_LEN.
    max_tokens = min(req.max_dec_len or max_dec_len, max_dec_len, max_seq_len - n)
    greedy = req.temperature == 0.0 or req.topp == 0.0
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min(req.min_dec_len, max_tokens),
            temperature=0.0 if greedy else req.temperature,
            top_p=1.0 if greedy else req.topp,
            top_k=req.top_k,
            repetition_penalty=req.penalty_score,
            frequency_penalty=req.frequency_score,
            presence_penalty=req.presence_score,
            seed=req.seed,
            stop=list(req.stop_sequences),
            stop_token_ids=list(req.eos_token_ids),
            logprobs=req.logprobs,
        )
    except ValueError as e:
        raise NativeError(BAD_REQUEST, str(e)) from None


# ---- responses ---------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "cached_tokens": cached_tokens,
    }


def is_native_body(body: dict) -> bool:
    """Native when it holds a native-only field or has no `model` (else OpenAI)."""
    return bool(NATIVE_ONLY_FIELDS & body.keys()) or "model" not in body
