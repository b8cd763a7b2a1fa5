"""The native (PaddleNLP-style) request and response, shared by Triton and HTTP.

A request is one JSON object (ARCHITECTURE.md, "Native protocol"; every field,
its rule and its default: docs/api.md). It is parsed and checked once, where it
enters: `parse` checks its shape in the HTTP front end (or, for a direct gRPC
client, the Triton adapter), and `record` is what travels on from there (a
msgpack map of every field), which the engine server takes as checked
(`from_record`, no validation again). There `admit` checks it against the
serving limits and the model once the prompt is tokenized, and builds the
engine's SamplingParams. The OpenAI layer builds native requests and leaves
these rules to this module. Every rejection is a `NativeError` whose code is
also the HTTP status the front end answers with and whose `param` names the
field at fault.

Beyond the seeds: `temperature: 0` (or `topp: 0`) means greedy decoding.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from llmserve.engine.sampling_params import SamplingParams
from llmserve.protocol import error_response as error_response  # re-exported: the native error item
from llmserve.protocol import structured
from llmserve.utils.wire import dumps

# Error codes: also the HTTP status of the error.
BAD_REQUEST = 400
NOT_FOUND = 404
TIMEOUT = 408
DUPLICATE = 409
TOO_LONG = 413
QUEUE_FULL = 429
INTERNAL = 500
NOT_READY = 503

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
PROMPT_FIELDS = ("text", "messages", "input_ids")

# Fields only the native protocol has: a body holding one of them is native.
NATIVE_ONLY_FIELDS = frozenset(
    {"text", "req_id", "max_dec_len", "min_dec_len", "topp", "frequency_score", "penalty_score", "presence_score"}
    | {"return_usage", "timeout"}
)


class NativeError(Exception):
    def __init__(self, code: int, msg: str, param: str | None = None) -> None:
        super().__init__(msg)
        self.code = code
        self.msg = msg
        self.param = param


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # extra keys (name, tool_call_id, ...) reach the chat template
    role: str = Field(min_length=1)  # any role the chat template takes (vLLM passes custom ones on)
    content: str


class NativeRequest(BaseModel):
    # An unknown field is refused (400 naming it), never ignored.
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    req_id: str = Field(default_factory=lambda: str(uuid.uuid4()), min_length=1, max_length=256)
    model: str | None = Field(default=None, description="checked against the served names when given")
    text: str | None = None
    messages: list[Message] | None = None
    input_ids: list[int] | None = None
    system: str | None = None
    max_dec_len: int | None = Field(default=None, ge=1, validation_alias=AliasChoices("max_dec_len", "max_tokens"))
    min_dec_len: int = Field(default=1, ge=0)
    topp: float = Field(default=0.7, ge=0.0, le=1.0, validation_alias=AliasChoices("topp", "top_p"))
    top_k: int = Field(default=0, ge=0)
    temperature: float = Field(default=0.95, ge=0.0, allow_inf_nan=False)
    frequency_score: float = Field(default=0.0, allow_inf_nan=False)
    # None: the model's default (its generation_config.json's repetition_penalty), else 1.0.
    penalty_score: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    presence_score: float = Field(default=0.0, allow_inf_nan=False)
    stream: bool = False
    timeout: float = Field(default=300.0, gt=0.0)
    return_usage: bool = False
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop_sequences: list[str] = Field(default_factory=list, validation_alias=AliasChoices("stop_sequences", "stop"))
    eos_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20, description="top-k logprobs per token (0: the chosen only)")
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20, description="the same for the prompt's tokens")
    logit_bias: dict[str, float] = Field(default_factory=dict, description="token id -> bias in [-100, 100]")
    echo: bool = Field(default=False, description="the first response carries `prompt_text`")
    tools: list[dict[str, Any]] | None = Field(default=None, description="rendered by the chat template (messages)")
    # Structured output (protocol/structured.py): at most one of these.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prediction: str | None = Field(default=None, description="predicted output: its tokens are speculative proposals")
    _prediction_ids: list[int] | None = PrivateAttr(default=None)  # tokenize_burst: beside the prompt

    @field_validator("stop_sequences", mode="before")
    @classmethod
    def _one_stop(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else ([] if v is None else v)

    @field_validator("stop_sequences")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("eos_token_ids", mode="before")
    @classmethod
    def _one_eos(cls, v: Any) -> Any:
        return [v] if isinstance(v, int) else ([] if v is None else v)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float]) -> dict[str, float]:
        for key, bias in v.items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (integers >= 0), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        return v

    @property
    def prompt_field(self) -> str:
        return next((k for k in PROMPT_FIELDS if getattr(self, k) is not None), "text")


def _loc(loc: tuple) -> str:
    # Drop pydantic's union-branch tags ("list[int]", "function-after[...]") so the path names the field.
    return ".".join(str(x) for x in loc if isinstance(x, int) or not any(c in str(x) for c in "[]-")) or "body"


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
        errs = e.errors()
        msgs = []
        for err in errs:
            where = _loc(err["loc"])
            why = "unknown field" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
            msgs.append(f"{where}: {why}")
        raise NativeError(BAD_REQUEST, "invalid request: " + "; ".join(msgs), _loc(errs[0]["loc"])) from None
    given = [k for k in PROMPT_FIELDS if getattr(req, k) is not None]
    if len(given) != 1:
        raise NativeError(BAD_REQUEST, "give exactly one of `text`, `messages` or `input_ids`", "text")
    if not getattr(req, given[0]):
        raise NativeError(BAD_REQUEST, f"{given[0]}: the prompt is empty", given[0])
    return req


def record(req: NativeRequest) -> dict:
    """The checked request as it travels on (every field by its own name): a msgpack map, never JSON. A
    value msgpack cannot carry (an integer past 64 bits, a lone surrogate) is a 400 naming its field."""
    rec = req.model_dump()
    try:
        dumps(rec)
    except Exception:  # noqa: BLE001 - msgpack's OverflowError, UnicodeEncodeError, ...: name the field
        for key, value in rec.items():
            try:
                dumps({key: value})
            except Exception as err:  # noqa: BLE001
                raise NativeError(BAD_REQUEST, f"{key}: cannot be carried ({err}): out of range", key) from None
    return rec


def from_record(rec: dict) -> NativeRequest:
    """A `record` made where the request entered, taken as checked: nothing is validated again."""
    if rec.get("messages") is not None:
        rec = {**rec, "messages": [Message.model_construct(**m) for m in rec["messages"]]}
    return NativeRequest.model_construct(**rec)


def tokenize_burst(reqs: list, tokenizer) -> list[tuple[NativeRequest, list[int] | Exception] | Exception]:
    """Each request with its prompt's ids or the error making them (an entry that is an error stays one).
    The texts are encoded in one call (`Tokenizer.encode_batch`, on all cores), so that a burst of
    requests is admitted at once rather than one prompt after another."""
    out: list = []
    texts: dict[bool, list[tuple[int, str]]] = {True: [], False: []}  # add special tokens -> (index, text)
    for i, req in enumerate(reqs):
        if isinstance(req, Exception):  # the caller answers it, in order
            out.append(req)
            continue
        try:
            src = prompt_source(req, tokenizer)
        except Exception as e:  # noqa: BLE001 - raised after the request's other checks
            src = e
        if isinstance(src, tuple):
            texts[src[1]].append((i, src[0]))
        if req.prediction and not isinstance(src, Exception):
            try:  # no special tokens: the prediction continues the prompt
                req._prediction_ids = tokenizer.encode(req.prediction, False)
            except Exception as e:  # noqa: BLE001 - answered as the prompt's error would be
                src = NativeError(BAD_REQUEST, f"prediction: cannot be tokenized: {e}", "prediction")
        out.append((req, src))
    for special, items in texts.items():
        if not items:
            continue
        try:
            encoded = tokenizer.encode_batch([t for _, t in items], special)
        except Exception:  # noqa: BLE001 - one at a time, so that each request gets its own error
            encoded = []
            for _, t in items:
                try:
                    encoded.append(tokenizer.encode(t, special))
                except Exception as e:  # noqa: BLE001
                    encoded.append(e)
        for (i, _), ids in zip(items, encoded):
            out[i] = (out[i][0], ids)
    return out


def prompt_token_ids(req: NativeRequest, tokenizer) -> list[int]:
    """Token ids of the prompt: `text` is encoded as is (as `llmserve generate` does);
    `messages` (and `text` with `system`) go through the chat template."""
    src = prompt_source(req, tokenizer)
    return src if isinstance(src, list) else tokenizer.encode(*src)


def prompt_source(req: NativeRequest, tokenizer) -> list[int] | tuple[str, bool]:
    """The prompt's token ids when the request gives them, else (text to encode, add special tokens):
    the text as is, or the chat template's rendering (which writes its own special tokens)."""
    if req.tools is not None and req.messages is None:
        raise NativeError(BAD_REQUEST, "tools: only with messages (the chat template renders them)", "tools")
    if req.input_ids is not None:
        return list(req.input_ids)
    if req.messages is not None:
        messages = [m.model_dump() for m in req.messages]
        if req.system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": req.system})
    elif req.system:
        messages = [{"role": "system", "content": req.system}, {"role": "user", "content": req.text}]
    else:
        return req.text, True
    try:
        return tokenizer.apply_chat_template(messages, **({"tools": req.tools} if req.tools else {})), False
    except ValueError as e:  # ChatTemplateError
        raise NativeError(BAD_REQUEST, f"chat template: {e}", req.prompt_field) from None


def context_overflow(context: int, prompt: int, completion: int | None = None) -> str:
    """The message OpenAI clients recognise as a context-length error (vLLM's wording; litellm maps it)."""
    if completion is None:
        return (
            f"This model's maximum context length is {context} tokens. However, your request has {prompt} input "
            f"tokens. Please reduce the length of the input."
        )
    return (
        f"This model's maximum context length is {context} tokens. However, you requested {prompt + completion} "
        f"tokens ({prompt} in the input, {completion} in the completion). Please reduce the length of the input "
        f"or completion."
    )


def admit(
    req: NativeRequest, prompt_ids: list[int], max_seq_len: int, max_dec_len: int, vocab_size: int | None = None
) -> SamplingParams:
    """Check the request against the limits (MAX_SEQ_LEN: the context, MAX_DEC_LEN) and the model's
    vocabulary, and map its fields to SamplingParams."""
    n = len(prompt_ids)
    if n == 0:
        raise NativeError(BAD_REQUEST, f"{req.prompt_field}: the prompt is empty", req.prompt_field)
    if n >= max_seq_len:  # at least one token must fit after the prompt
        raise NativeError(TOO_LONG, context_overflow(max_seq_len, n), req.prompt_field)
    for name in ("max_dec_len", "min_dec_len"):
        v = getattr(req, name)
        if v is not None and v > max_dec_len:
            raise NativeError(BAD_REQUEST, f"{name}: {v} exceeds MAX_DEC_LEN={max_dec_len}", name)
    if req.max_dec_len is not None and n + req.max_dec_len > max_seq_len:
        raise NativeError(BAD_REQUEST, context_overflow(max_seq_len, n, req.max_dec_len), "max_dec_len")
    bias = {int(k): v for k, v in req.logit_bias.items()}
    if vocab_size is not None:
        for name, toks in (("input_ids", prompt_ids), ("eos_token_ids", req.eos_token_ids), ("logit_bias", bias)):
            if not toks or (0 <= min(toks) and max(toks) < vocab_size):  # in C: a 512-id prompt in ~10 us
                continue
            bad = next((t for t in toks if not 0 <= t < vocab_size), None)
            if bad is not None:
                name = req.prompt_field if name == "input_ids" else name
                # vLLM's words ("out of vocabulary"), which clients match
                raise NativeError(
                    BAD_REQUEST,
                    f"{name}: token id {bad} is out of vocabulary (the vocabulary is [0, {vocab_size}))",
                    name,
                )
    prediction_ids = list(req._prediction_ids or [])
    if len(prediction_ids) > max_seq_len:
        raise NativeError(
            BAD_REQUEST,
            f"prediction: {len(prediction_ids)} tokens exceed the context (MAX_SEQ_LEN={max_seq_len})",
            "prediction",
        )
    try:
        grammar = structured.grammar_for({f: getattr(req, f) for f in structured.FIELDS})
    except ValueError as e:
        raise NativeError(BAD_REQUEST, str(e), str(e).split(":", 1)[0]) from None
    # Default: what is left of the context, within MAX_DEC_LEN.
    max_tokens = req.max_dec_len or min(max_dec_len, max_seq_len - n)
    greedy = req.temperature == 0.0 or req.topp == 0.0
    top_k = min(req.top_k, vocab_size) if vocab_size else req.top_k  # more than the vocabulary: no cut
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min(req.min_dec_len, max_tokens),
            temperature=0.0 if greedy else req.temperature,
            top_p=1.0 if greedy else req.topp,
            top_k=top_k,
            repetition_penalty=req.penalty_score,
            frequency_penalty=req.frequency_score,
            presence_penalty=req.presence_score,
            # The samplers take 64 bits: a negative int64 seed is its two's complement.
            seed=None if req.seed is None else req.seed & 0xFFFFFFFFFFFFFFFF,
            stop=list(req.stop_sequences),
            stop_token_ids=list(req.eos_token_ids),
            ignore_eos=req.ignore_eos,
            logprobs=req.logprobs,
            prompt_logprobs=req.prompt_logprobs,
            logit_bias=bias,
            grammar=grammar,
            prediction=req.prediction,
            prediction_token_ids=prediction_ids,
        )
    except ValueError as e:
        raise NativeError(BAD_REQUEST, str(e), str(e).split(":", 1)[0]) from None


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


def served_model_names(model_dir: str, served_name: str = "") -> list[str]:
    """The names a request's `model` may take: the served one first (what /v1/models lists), then
    `default` (the seeds' examples use it), MODEL_DIR as given and its last part."""
    base = model_dir.rstrip("/").rsplit("/", 1)[-1] if model_dir else ""
    names = [served_name or base or "default", "default", model_dir, base]
    return list(dict.fromkeys(n for n in names if n))


def check_model(name: str | None, served: list[str]) -> None:
    if name is not None and name not in served:
        raise NativeError(NOT_FOUND, f"The model `{name}` does not exist; this server serves `{served[0]}`.", "model")


def edge_record(body, req_id: str) -> tuple[dict | None, dict | None]:
    """(the record to send on, None) for a body that enters here (the Triton adapter: a direct gRPC
    client's), `req_id` filling in a missing one; else (None, its 400)."""
    if not isinstance(body, dict):
        return None, error_response(req_id, 400, "IN must hold one JSON object")
    try:
        return record(parse({**body, "req_id": body.get("req_id") or req_id})), None
    except NativeError as err:
        return None, error_response(body.get("req_id") or req_id, err.code, err.msg, err.param)
