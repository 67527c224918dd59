"""A structured-output constraint as an llguidance grammar, and its validation.

Torch-free and tokenizer-free, so that the web tier refuses a bad schema, regex or grammar (400, `param`
naming the field) before anything is queued; the engine checks again when the request arrives.

Budgets come first, before llguidance sees the constraint: its compile time grows with the constraint's size
(a list of 100,000 choices takes seconds to validate and more to compile), so sizes above what any real
schema needs are refused outright: 1,000 alternatives and 120,000 characters, as OpenAI's structured outputs
allow, and 1,000 object properties, a fifth of OpenAI's (validating them takes about 0.15 ms each, and the
web tier validates on its event loop). A schema whose ``$ref``s only lead to each other (``{"$ref": "#"}``)
describes no value at all and is refused too. llguidance's own errors reach the client without their parser
state dumps; Rust panics are for the log.
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any

import llguidance

from inference_engine.errors import InvalidRequestError
from inference_engine.sampling_params import StructuredOutputsParams

log = logging.getLogger(__name__)

MAX_CONSTRAINT_CHARS = 120_000  # the constraint as JSON: schema, regex, grammar or choices together
MAX_ALTERNATIVES = 1_000  # choices, or enum values and anyOf / oneOf branches of a schema together
MAX_PROPERTIES = 1_000  # object properties of a schema, all levels together
MAX_ERROR_CHARS = 300


def refusal(spec: StructuredOutputsParams, message: str) -> InvalidRequestError:
    what = "JSON schema" if spec.kind == "json" else spec.kind
    return InvalidRequestError(f"invalid {what}: {message}", param=f"structured_outputs.{spec.kind}")


def short_error(error: str) -> str:
    """A library error fit for a client: without its parser-state dump, on one line, bounded; a panic's
    text (a Rust source location and backtrace) is replaced."""
    if "panicked" in error or "backtrace" in error.lower():
        log.warning("llguidance panicked: %s", error)
        return "the grammar library could not process it."
    text = " ".join(error.split("<state>", 1)[0].split())
    return (text or "rejected")[:MAX_ERROR_CHARS]


def check_budget(spec: StructuredOutputsParams) -> None:
    """Refuses constraints too large to compile within a request's time, and schemas made only of ``$ref``
    cycles (see the module docstring)."""
    try:
        _check_budget(spec)
    except RecursionError:
        raise refusal(spec, "nested too deeply.") from None


def _check_budget(spec: StructuredOutputsParams) -> None:
    alternatives, properties = (len(spec.choice), 0) if spec.kind == "choice" else _counts(spec.json)
    if properties > MAX_PROPERTIES:
        raise refusal(spec, f"{properties} object properties; the limit is {MAX_PROPERTIES}.")
    if alternatives > MAX_ALTERNATIVES:
        raise refusal(
            spec,
            f"{alternatives} alternatives (choices, enum values, anyOf / oneOf branches); "
            f"the limit is {MAX_ALTERNATIVES}.",
        )
    value = spec.json if spec.kind == "json" else getattr(spec, spec.kind, None)
    size = len(json.dumps(value)) if value is not None else 0
    if size > MAX_CONSTRAINT_CHARS:
        raise refusal(spec, f"{size} characters; the limit is {MAX_CONSTRAINT_CHARS}.")
    if spec.kind == "json" and isinstance(spec.json, dict):
        cycle = _ref_cycle(spec.json)
        if cycle is not None:
            raise refusal(spec, f"`$ref` {cycle!r} only leads back to itself: no value can match it.")


def _counts(schema: Any) -> tuple[int, int]:
    """(alternatives: enum values and anyOf / oneOf branches, object properties) of a schema, all levels."""
    if isinstance(schema, list):
        counts = [_counts(item) for item in schema]
        return sum(a for a, _ in counts), sum(p for _, p in counts)
    if not isinstance(schema, dict):
        return 0, 0
    alternatives = properties = 0
    for key, value in schema.items():
        if key in ("enum", "anyOf", "oneOf") and isinstance(value, list):
            alternatives += len(value)
        if key == "properties" and isinstance(value, dict):
            properties += len(value)
        if key not in ("enum", "const", "default", "examples"):
            a, p = _counts(value)
            alternatives, properties = alternatives + a, properties + p
    return alternatives, properties


def _ref_cycle(root: dict[str, Any]) -> str | None:
    """A local ``$ref`` that leads only through other ``$ref``s back to where it started, if any."""

    def target(ref: str) -> Any:
        if ref == "#":
            return root
        if not ref.startswith("#/"):
            return None
        node: Any = root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def refs(schema: Any):
        if isinstance(schema, dict):
            if isinstance(schema.get("$ref"), str):
                yield schema
            for key, value in schema.items():
                if key not in ("enum", "const", "default", "examples"):
                    yield from refs(value)
        elif isinstance(schema, list):
            for item in schema:
                yield from refs(item)

    for start in refs(root):
        seen: list[int] = []
        node: Any = start
        # Follow while the node is nothing but a reference (other keys would describe a value of their own).
        while (
            isinstance(node, dict)
            and isinstance(node.get("$ref"), str)
            and set(node) <= {"$ref", "$defs", "definitions", "$schema", "$id", "title", "description"}
        ):
            if id(node) in seen:
                return start["$ref"]
            seen.append(id(node))
            node = target(node["$ref"])
    return None


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
    """The grammar text of `spec` once it is within budget and llguidance accepts it; `InvalidRequestError`
    (the first line of llguidance's message, `param` the constraint's field) where it is not."""
    check_budget(spec)
    try:
        grammar = grammar_text(spec)
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except InvalidRequestError as exc:
        raise InvalidRequestError(short_error(str(exc)), param=exc.param) from None
    except BaseException as exc:  # a library bug, or a Rust panic (pyo3's PanicException is no Exception)
        if isinstance(exc, KeyboardInterrupt | SystemExit | GeneratorExit):
            raise
        log.warning("llguidance failed on a %s constraint: %r", spec.kind, exc)
        raise refusal(spec, "the grammar library could not process it.") from None
    if error:
        raise refusal(spec, short_error(error))
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
