"""Requests per LoRA adapter for the engine's stats, which `/metrics` turns into vLLM's
`vllm:lora_requests_info`: running (in the scheduler's batch) and waiting (queued, swapped out, or waiting for
a slot for their adapter), counted per request by adapter name."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from inference_engine.sequence import Sequence


def lora_stats(running: Iterable[Sequence], waiting: Iterable[Sequence], max_loras: int) -> dict:
    def per_adapter(seqs: Iterable[Sequence]) -> dict[str, int]:
        groups = {id(s.group): s.group for s in seqs if s.group.lora_request is not None}
        return dict(Counter(g.lora_request.lora_name for g in groups.values()))

    return {"lora_running": per_adapter(running), "lora_waiting": per_adapter(waiting), "max_lora": max_loras}
