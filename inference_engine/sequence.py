"""Requests and their sequences.

A `SequenceGroup` is one request; it holds one `Sequence` per sample (n > 1 forks the prompt's
sequence after prefill, sharing its KV blocks copy-on-write). The scheduler works on sequences.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from inference_engine.detokenizer import IncrementalDetokenizer
from inference_engine.lora.request import LoRARequest
from inference_engine.outputs import Logprob, RequestMetrics
from inference_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from inference_engine.pooling import PoolingState
    from inference_engine.structured_outputs.engine import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED = enum.auto()


@dataclass(eq=False)
class Sequence:
    seq_id: int
    group: SequenceGroup
    token_ids: list[int]
    num_prompt_tokens: int
    index: int = 0  # which of the group's n samples
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    block_table_version: int = 0  # bumped whenever blocks are replaced or dropped, not merely appended
    # Speculative proposals for this step (n-gram), verified after the sequence's newest token; only those.
    draft_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # prefix-cache hash of each computed full block
    cpu_block_table: list[int] = field(default_factory=list)  # where its KV lives while swapped out
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    generator: torch.Generator | None = None  # per-sample RNG for seeded requests
    detokenizer: IncrementalDetokenizer | None = None
    grammar: GrammarMatcher | None = None  # where a structured-output request stands in its grammar
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def params(self) -> SamplingParams:
        return self.group.params

    def __len__(self) -> int:
        return len(self.token_ids)

    def scheduled_token_ids(self, start: int, count: int) -> list[int]:
        """The ids at positions start .. start + count - 1: its tokens, then its draft tokens; past those, the
        slots of a burst's later steps, whose tokens the burst samples as it runs, hold its last token."""
        ids = self.token_ids[start : start + count]
        if len(ids) < count:
            ids = ids + self.draft_token_ids[: count - len(ids)]
        if len(ids) < count:
            ids = ids + [self.token_ids[-1]] * (count - len(ids))
        return ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(eq=False)
class SequenceGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.time)
    seqs: list[Sequence] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    pooling: PoolingState | None = None  # an embedding request: its prompt is pooled, nothing sampled
    lora_request: LoRARequest | None = None  # the adapter it runs with; None: the base model

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id; 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def is_finished(self) -> bool:
        # The prompt's sequence forks into n when it samples its first token.
        return len(self.seqs) == self.params.n and all(seq.is_finished for seq in self.seqs)
