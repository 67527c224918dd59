"""Per-request sampling parameters, shaped like vLLM's `SamplingParams`.

Torch-free on purpose: the web tier builds and validates these before anything reaches the engine.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from inference_engine.errors import InvalidRequestError

_GREEDY_EPS = 1e-5
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class Range:
    """The values a numeric option may take. The one definition of each bound: `SamplingParams` checks
    against it and the API's request models are built from it (`field()`), so the two cannot drift."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None

    def __contains__(self, value: float) -> bool:
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
        )

    def __str__(self) -> str:
        low = self.ge if self.ge is not None else self.gt
        if self.le is None:
            return f"at least {low}" if self.ge is not None else f"greater than {low}"
        return f"in {'[' if self.ge is not None else '('}{low}, {self.le}]"

    def field(self) -> dict[str, float]:
        """The bounds as pydantic's `Field` keywords."""
        return {name: value for name, value in vars(self).items() if value is not None}


MAX_LOGPROBS = 20
RANGES: dict[str, Range] = {
    "n": Range(ge=1, le=128),
    "temperature": Range(ge=0),
    "top_p": Range(gt=0, le=1),
    "top_k": Range(ge=-1),  # -1 (or 0) turns it off
    "min_p": Range(ge=0, le=1),
    "presence_penalty": Range(ge=-2, le=2),
    "frequency_penalty": Range(ge=-2, le=2),
    "repetition_penalty": Range(gt=0, le=2),
    "max_tokens": Range(ge=1),
    "min_tokens": Range(ge=0),
    "logprobs": Range(ge=0, le=MAX_LOGPROBS),
    "prompt_logprobs": Range(ge=0, le=MAX_LOGPROBS),
}
LOGIT_BIAS = Range(ge=-100, le=100)
MAX_STOP_STRINGS = 16


@dataclass
class StructuredOutputsParams:
    """One constraint on the output, vLLM's shape: a JSON schema (`json`, a dict or its JSON text), a
    `regex`, one of the strings in `choice`, a `grammar` (Lark, or llama.cpp's GBNF) or any JSON object
    (`json_object`).

    By default JSON is written with `", "` and `": "` between items and no other whitespace: small models
    left free to add whitespace can fill max_tokens with newlines. `whitespace_pattern` (a regex) allows
    whitespace where JSON does; `disable_additional_properties` forbids keys a schema's objects do not list.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs needs exactly one of json, regex, choice, grammar and json_object; "
                f"got {', '.join(given) or 'none'}.",
                param="structured_outputs",
            )
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as exc:
                raise InvalidRequestError(
                    f"the JSON schema is not valid JSON: {exc}", param="structured_outputs.json"
                ) from None
        checks = {
            "json": isinstance(self.json, dict | None),
            "regex": isinstance(self.regex, str | None),
            "choice": self.choice is None
            or (
                isinstance(self.choice, list)
                and bool(self.choice)
                and all(isinstance(c, str) for c in self.choice)
            ),
            "grammar": isinstance(self.grammar, str | None),
            "json_object": self.json_object in (None, True, False),
            "whitespace_pattern": isinstance(self.whitespace_pattern, str | None),
        }
        for name, ok in checks.items():
            if not ok:
                raise InvalidRequestError(
                    f"structured_outputs.{name} has the wrong type: {getattr(self, name)!r}.",
                    param=f"structured_outputs.{name}",
                )

    @property
    def kind(self) -> str:
        """Which constraint: json, regex, choice, grammar or json_object."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v not in (None, False)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StructuredOutputsParams:
        if not isinstance(data, dict):
            raise InvalidRequestError("structured_outputs must be an object.", param="structured_outputs")
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise InvalidRequestError(
                f"unknown structured_outputs field(s): {', '.join(sorted(unknown))}.",
                param="structured_outputs",
            )
        return cls(**data)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    truncate_prompt_tokens: int | None = None  # keep the prompt's last N tokens; -1: all that fit

    def __post_init__(self) -> None:
        # Lists rather than None downstream keep the hot paths free of None checks.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.top_k == 0:
            self.top_k = -1
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def edits_logits(self, num_output_tokens: int) -> bool:
        """Whether anything changes a sequence's logits before its next token is chosen (the sampler's
        edits): the one answer to that question, for the sampler's fast paths and its metadata alike."""
        return bool(
            self.logit_bias
            or num_output_tokens < self.min_tokens
            or self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
        )

    def _validate(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(msg)

        if not isinstance(self.n, int):
            raise bad(f"n must be an integer, got {self.n!r}.")
        for name, allowed in RANGES.items():
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise bad(f"{name} must be {allowed}, got {value}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).")
        if any(not s for s in self.stop):
            raise bad("stop strings must not be empty.")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad(f"at most {MAX_STOP_STRINGS} stop strings are allowed.")
        for token, bias in (self.logit_bias or {}).items():
            if bias not in LOGIT_BIAS:
                raise bad(f"logit_bias for token {token} must be {LOGIT_BIAS}, got {bias}.")
        if self.truncate_prompt_tokens is not None and not (
            isinstance(self.truncate_prompt_tokens, int)
            and (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1)
        ):
            raise InvalidRequestError(
                f"truncate_prompt_tokens must be at least 1, or -1, got {self.truncate_prompt_tokens!r}.",
                param="truncate_prompt_tokens",
            )
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad(f"seed must be an integer, got {self.seed!r}.")
        if not isinstance(self.structured_outputs, StructuredOutputsParams | None):
            raise bad("structured_outputs must be a StructuredOutputsParams or its dict.")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if self.structured_outputs is not None:
            data["structured_outputs"] = self.structured_outputs.to_dict()
        if data["logit_bias"]:
            data["logit_bias"] = {str(k): v for k, v in data["logit_bias"].items()}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Build from untrusted input (bus messages, API bodies): unknown keys and wrong types are errors."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}.")
        try:
            return cls(**data)
        except TypeError as exc:
            raise InvalidRequestError(f"invalid sampling parameters: {exc}") from exc
