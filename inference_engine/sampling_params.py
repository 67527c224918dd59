"""Per-request sampling parameters, shaped like vLLM's `SamplingParams`.

Torch-free on purpose: the web tier builds and validates these before anything reaches the engine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from inference_engine.errors import InvalidRequestError

_GREEDY_EPS = 1e-5


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
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def _validate(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(msg)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad(f"n must be at least 1, got {self.n}.")
        if self.n > 128:
            raise bad(f"n must be at most 128, got {self.n}.")
        if self.temperature < 0.0:
            raise bad(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise bad(f"top_k must be -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise bad(f"min_tokens must be non-negative, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 20:
                raise bad(f"{name} must be in [0, 20], got {value}.")
        if any(not s for s in self.stop):
            raise bad("stop strings must not be empty.")
        if len(self.stop) > 16:
            raise bad("at most 16 stop strings are allowed.")
        if self.logit_bias:
            for token, bias in self.logit_bias.items():
                if not -100.0 <= bias <= 100.0:
                    raise bad(f"logit_bias for token {token} must be in [-100, 100], got {bias}.")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad(f"seed must be an integer, got {self.seed!r}.")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
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
