"""Live engine state for the admin and the API, read from the replicas' heartbeats on the bus."""

from __future__ import annotations

from dataclasses import dataclass

from inference_engine.bus.protocol import ModelInfo
from inference_engine.errors import EngineError


@dataclass
class EngineState:
    """What the admin shows for one served name: summed over its live replicas."""

    up: bool
    replicas: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # mean over replicas, 0..1
    tokens_per_s: float = 0.0

    @classmethod
    def of(cls, info: ModelInfo | None) -> EngineState:
        if info is None or not info.replicas:
            return cls(up=False)
        stats = [r.data.get("stats", {}) for r in info.replicas]
        return cls(
            up=True,
            replicas=len(info.replicas),
            running=sum(s.get("num_running", 0) for s in stats),
            waiting=sum(s.get("num_waiting", 0) for s in stats),
            kv_usage=sum(s.get("kv_usage", 0.0) for s in stats) / len(stats),
            tokens_per_s=sum(r.data.get("tokens_per_s", 0.0) for r in info.replicas),
        )


def live_models() -> dict[str, ModelInfo]:
    """Served models by name; empty when the bus is unreachable (the admin must still render)."""
    from llmserve import bus

    try:
        return {m.name: m for m in bus.client().list_models()}
    except EngineError:
        return {}
