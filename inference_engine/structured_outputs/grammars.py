"""A structured-output constraint as an llguidance grammar, and its validation.

Torch-free and tokenizer-free, so that the web tier refuses a bad schema, regex or grammar (400, `param`
naming the field) before anything is queued; the engine checks again when the request arrives.
"""

from __future__ import annotations

import copy
from typing import Any

import llguidance

from inference_engine.errors import InvalidRequestError
from inference_engine.sampling_params import StructuredOutputsParams


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) of one constraint. Raises `InvalidRequestError` for input
    that cannot even be converted (a GBNF grammar naming an undefined rule)."""
    kind = spec.kind
    if kind in ("json", "json_object"):
        schema = spec.json if kind == "json" else {"type": "object"}
        if spec.disable_additional_properties:
            schema = _closed(copy.deepcopy(schema))
        options: dict[str, Any] = {
            "item_separator": ", ",
            "key_separator": ": ",
            "whitespace_flexible": False,
        }
        if spec.whitespace_pattern is not None:
            options = {
                "item_separator": ",",
                "key_separator": ":",
                "whitespace_pattern": spec.whitespace_pattern,
            }
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as exc:
            raise InvalidRequestError(
                f"invalid JSON schema: {exc}", param=f"structured_outputs.{kind}"
            ) from None
    try:
        return llguidance.grammar_from(kind, getattr(spec, kind))
    except ValueError as exc:
        raise InvalidRequestError(f"invalid {kind}: {exc}", param=f"structured_outputs.{kind}") from None


def check(spec: StructuredOutputsParams) -> str:
    """The grammar text of `spec` once llguidance accepts it; `InvalidRequestError` (its message, `param`
    the constraint's field) where it does not."""
    grammar = grammar_text(spec)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        what = "JSON schema" if spec.kind == "json" else spec.kind
        raise InvalidRequestError(f"invalid {what}: {error.strip()}", param=f"structured_outputs.{spec.kind}")
    return grammar


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _closed(schema: Any) -> Any:
    """`schema` with ``additionalProperties: false`` on every object schema that does not say otherwise."""
    if isinstance(schema, list):
        for item in schema:
            _closed(item)
    if not isinstance(schema, dict):
        return schema
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for sub in value.values():
                _closed(sub)
        elif isinstance(value, dict | list) and key not in ("enum", "const", "default", "examples"):
            _closed(value)
    if schema.get("type") == "object" or "properties" in schema:
        schema.setdefault("additionalProperties", False)
    return schema
