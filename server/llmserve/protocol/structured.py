"""Structured output requests -> one grammar (llguidance), checked once, at the edge.

A request asks for at most one of:
  response_format  {"type": "text"} (nothing), {"type": "json_object"} (any JSON object), or
                   {"type": "json_schema", "json_schema": {"name", "schema", "strict"?}} (OpenAI's)
  guided_json      a JSON schema (object or JSON text)           } vLLM's names,
  guided_regex     a regular expression the whole output matches } also in the
  guided_choice    a list of strings: the output is one of them  } native protocol
  guided_grammar   a Lark grammar (llguidance's dialect)          }
and gets back the grammar text the engine's matchers run (engine/structured.py), or a ValueError
naming the field and why it cannot be compiled (the caller answers 400). Why llguidance, not xgrammar:
docs/api.md, "Structured output".
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _schema_text(field: str, schema: Any) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"{field}: not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{field}: a JSON schema must be an object")
    return json.dumps(schema)


def grammar_for(fields: dict[str, Any]) -> str | None:
    """The grammar of the structured-output fields given (FIELDS, None when absent), or None when
    none asks for a structure. ValueError("<field>: why") for a bad or uncompilable one. Compiled and
    checked once per distinct request (an LRU cache: clients send the same schema again and again)."""
    given = {f: fields[f] for f in FIELDS if fields.get(f) is not None}
    return _cached(json.dumps(given, sort_keys=True)) if given else None


@functools.lru_cache(maxsize=1024)
def _cached(key: str) -> str | None:
    return _compile(json.loads(key))


def _compile(fields: dict[str, Any]) -> str | None:
    import llguidance

    m = llguidance.LLMatcher
    given = [f for f in FIELDS if fields.get(f) is not None]
    rf = fields.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise ValueError("response_format: `type` must be text, json_object or json_schema")
        if rf["type"] == "text":
            given.remove("response_format")
    if len(given) > 1:
        raise ValueError(f"{given[1]}: only one structured-output field per request (also given: {given[0]})")
    if not given:
        return None
    field = given[0]
    try:
        grammar = _grammar(m, field, fields[field])
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - llguidance's own errors: the schema or pattern is at fault
        raise ValueError(f"{field}: cannot be compiled: {e}") from None
    error = m.validate_grammar(grammar)
    if error:
        raise ValueError(f"{field}: cannot be compiled: {error.strip()}")
    return grammar


# Compact JSON, no whitespace between tokens: a model left to choose pads with whitespace for ever
# (seen on the demo model); the schema's own x-guidance options still win.
JSON_DEFAULTS = {"whitespace_flexible": False}


def _json(m, schema_text: str) -> str:
    return m.grammar_from_json_schema(schema_text, defaults=JSON_DEFAULTS)


def _grammar(m, field: str, v: Any) -> str:
    if field == "response_format":
        if v["type"] == "json_object":
            grammar = _json(m, json.dumps({"type": "object"}))
        else:
            spec = v.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise ValueError('response_format: json_schema needs {"name": ..., "schema": {...}}')
            grammar = _json(m, _schema_text("response_format.json_schema.schema", spec["schema"]))
    elif field == "guided_json":
        grammar = _json(m, _schema_text(field, v))
    elif field == "guided_regex":
        if not isinstance(v, str) or not v:
            raise ValueError("guided_regex: must be a non-empty string")
        grammar = m.grammar_from_regex(v)
    elif field == "guided_choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise ValueError("guided_choice: must be a non-empty list of non-empty strings")
        grammar = m.grammar_from_regex("|".join(f"(?:{re.escape(c)})" for c in v))
    else:
        if not isinstance(v, str) or not v.strip():
            raise ValueError("guided_grammar: must be a non-empty Lark grammar")
        grammar = m.grammar_from_lark(v)
    return grammar
