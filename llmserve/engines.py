"""Live engine state for the admin and the API, read from the replicas' heartbeats on the bus; which engines
run a model or LoRA adapter name; and keeping running engines' adapters in step with the admin's."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from inference_engine.bus.protocol import ModelInfo
from inference_engine.errors import EngineError, ModelNotFoundError
from llmserve.models import LoRAAdapter, ModelConfig

log = logging.getLogger("llmserve.engines")


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


def engine_target(name: str, served: list[ModelInfo]) -> tuple[str, str | None]:
    """(the served model whose engines run requests for `name`, the LoRA adapter they name or None), as the
    API resolves a `model`: a served model by that name, else the model whose engines serve such an adapter,
    else the base model of the adapter registered under that name (its engines may be down: the request
    waits as any would). A name none of these know is returned as it is, for the engines to refuse."""
    if any(info.name == name for info in served):
        return name, None
    for info in served:
        if name in info.adapters:
            return info.name, name
    adapter = LoRAAdapter.objects.filter(name=name).select_related("base_model").first()
    return (adapter.base_model.name, name) if adapter is not None else (name, None)


def sync_adapters(base: ModelConfig, names: Iterable[str], reload: bool = False) -> list[tuple[int, str]]:
    """Have the running engines of `base` serve the adapters `names` as the admin now says: each enabled
    adapter of `base` loaded (`reload`: loaded again, its files changed), any other unloaded (running requests
    for it finish; new ones get model_not_found). Sent as the bus's run-time LoRA updates, which every live
    replica applies at once and replicas started later replay; loading a served adapter again is a no-op, and
    an engine that does not serve a name has nothing to unload. Engines started afterwards get the enabled
    adapters as flags (`ModelConfig.engine_args`). Returns (message level, text) for the admin user."""
    from django.contrib import messages

    from llmserve import bus

    wanted = {adapter.name: adapter.path for adapter in base.enabled_adapters()}
    client = bus.client()
    notes = []
    for name in sorted(set(names)):
        try:
            if name not in wanted or reload:
                try:
                    replicas = client.unload_lora_adapter(base.name, name)
                except ModelNotFoundError:  # no engine serves it (or none is up)
                    replicas = 0
                if name not in wanted and replicas:
                    notes.append((messages.SUCCESS, f"{base.name}'s engines stopped serving {name}."))
            if name in wanted:
                replicas = client.load_lora_adapter(base.name, name, wanted[name])
                notes.append((messages.SUCCESS, f"{name} loaded by {replicas} engine(s) of {base.name}."))
        except ModelNotFoundError:
            notes.append(
                (messages.INFO, f"{base.name} is not running: its engines load {name} when they start.")
            )
        except EngineError as exc:
            log.warning("LoRA adapter %s on %s: %s", name, base.name, exc)
            hint = (
                " Restart the model's engines (its admin action) to serve adapters."
                if "--enable-lora" in str(exc)
                else ""
            )
            notes.append((messages.ERROR, f"{name} on {base.name}: {exc}{hint}"))
    return notes
