"""A fixed number of device slots for adapters (`max_loras`) and an LRU of loaded ones in CPU memory
(`max_cpu_loras`).

A request holds its adapter's slot from the moment it is admitted to the scheduler until it finishes or is
aborted (`acquire` / `release`, counted per request). An adapter already in a slot is shared; otherwise it
takes an empty slot, or the least recently used one no request holds, its weights copied in from the CPU LRU
(read from its folder on a miss). With every slot held, `acquire` says no and the request waits.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch
from torch import nn

from inference_engine.lora.layers import LoRABatch, LoRASlice, attach, check_adapter
from inference_engine.lora.peft import PeftAdapter, load_peft
from inference_engine.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int) -> None:
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.batch = LoRABatch()
        self.targets: dict[str, LoRASlice] = attach(model, self.batch, max_loras, max_lora_rank)
        self.device = next(iter(self.targets.values())).lora_a.device if self.targets else torch.device("cpu")
        self.cpu_cache: OrderedDict[int, PeftAdapter] = OrderedDict()  # lora_int_id -> adapter, LRU first
        self.slot_ids: list[int | None] = [None] * max_loras  # lora_int_id in each slot
        self.holders: list[int] = [0] * max_loras  # requests holding each slot
        self.last_used: list[float] = [0.0] * max_loras
        self.swap_in_seconds: list[float] = []  # CPU -> slot copy time of each swap-in

    def load(self, request: LoRARequest) -> PeftAdapter:
        """The adapter in CPU memory, read and checked against the base model on a miss; raises
        InvalidRequestError for one this engine cannot serve."""
        adapter = self.cpu_cache.get(request.lora_int_id)
        if adapter is not None:
            self.cpu_cache.move_to_end(request.lora_int_id)
            return adapter
        adapter = load_peft(request.lora_path, self.max_lora_rank)
        check_adapter(adapter, self.targets)
        self.cpu_cache[request.lora_int_id] = adapter
        while len(self.cpu_cache) > self.max_cpu_loras:
            evicted = next(lid for lid in self.cpu_cache if lid not in self.slot_ids)
            del self.cpu_cache[evicted]
        logger.info(
            "LoRA adapter %s (id %d) loaded from %s", request.lora_name, request.lora_int_id, adapter.path
        )
        return adapter

    def forget(self, lora_int_id: int) -> None:
        """An unloaded adapter: its slot is free at once if no request holds it, and its CPU copy is the
        next to go (requests still waiting for a slot may need it until then)."""
        if lora_int_id in self.cpu_cache:
            self.cpu_cache.move_to_end(lora_int_id, last=False)
        if lora_int_id in self.slot_ids:
            slot = self.slot_ids.index(lora_int_id)
            if self.holders[slot] == 0:
                self.slot_ids[slot] = None

    def slot_of(self, request: LoRARequest | None) -> int:
        """The slot a held adapter is in; -1 for the base model."""
        return -1 if request is None else self.slot_ids.index(request.lora_int_id)

    def acquire(self, request: LoRARequest) -> bool:
        """Holds a slot with the adapter for one request; False (nothing held) while every slot is held."""
        lid = request.lora_int_id
        if lid in self.slot_ids:
            slot = self.slot_ids.index(lid)
        else:
            free = [s for s in range(self.max_loras) if self.holders[s] == 0]
            if not free:
                return False
            slot = min(free, key=lambda s: (self.slot_ids[s] is not None, self.last_used[s]))
            self._fill(slot, lid, self.load(request))
        self.holders[slot] += 1
        self.last_used[slot] = time.monotonic()
        return True

    def release(self, request: LoRARequest) -> None:
        slot = self.slot_ids.index(request.lora_int_id)
        self.holders[slot] -= 1
        self.last_used[slot] = time.monotonic()

    def _fill(self, slot: int, lora_int_id: int, adapter: PeftAdapter) -> None:
        start = time.perf_counter()
        for name, target in self.targets.items():
            module = adapter.modules.get(name)
            target.lora_a[slot].zero_()
            target.lora_b[slot].zero_()
            target.used[slot] = module is not None
            if module is not None:
                rank = module.lora_a.shape[0]
                target.lora_a[slot, :rank].copy_(module.lora_a)
                target.lora_b[slot, :, :rank].copy_(module.lora_b)
                target.scales[slot] = module.scale
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.slot_ids[slot] = lora_int_id
        self.swap_in_seconds.append(time.perf_counter() - start)

    def set_step(self, requests: list[LoRARequest | None], rows_per_request: list[int]) -> None:
        """The slot of every row of the next step (each request's rows in order); none where no row has an
        adapter, so such a step runs as the base model alone."""
        if all(r is None for r in requests):
            self.batch.slots = None
            return
        per_request = torch.tensor([self.slot_of(r) for r in requests], dtype=torch.int32)
        rows = torch.repeat_interleave(per_request, torch.tensor(rows_per_request))
        self.batch.slots = rows.to(self.device, non_blocking=True)

    def clear_step(self) -> None:
        self.batch.slots = None
