"""LoRA on the model's linear layers: per targetable output slice, slot stacks of A and B.

A slice is one projection's columns of a linear layer's output: q, k and v of a fused QKV layer, gate and up
of a fused gate/up layer, or a whole layer (o, down, or a family's own fused qkv_proj / gate_up_proj). It
holds `lora_a` [slots, max_rank, in], `lora_b` [slots, out, max_rank] and `scales` [slots]; an adapter of a
smaller rank leaves zeros past it. After the base matmul the layer adds every row's own adapter's update
(`LoRABatch.slots`: one slot per row of the step, -1 for the base model) with the device's kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from inference_engine.errors import InvalidRequestError
from inference_engine.layers.linear import ColumnParallelLinear, LinearBase
from inference_engine.lora.peft import PeftAdapter
from llmserve_kernels.reference import lora_ref

# The fused layers' parts, by the name a PEFT adapter gives the projection.
FUSED_PARTS = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
FUSED_PARTS |= {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
)


@dataclass
class LoRABatch:
    """The step's row -> slot map, shared by every LoRA slice; None while the step has no adapter."""

    slots: torch.Tensor | None = None


@dataclass
class LoRASlice:
    offset: int  # first output column in the layer
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scales: torch.Tensor
    used: list[bool] = field(default_factory=list)  # per slot: whether the adapter there targets this slice

    @property
    def in_features(self) -> int:
        return self.lora_a.shape[2]

    @property
    def out_features(self) -> int:
        return self.lora_b.shape[1]


class LoRALayer:
    """What one linear layer adds: its slices, applied after the base matmul while the batch has slots."""

    def __init__(self, layer: LinearBase, batch: LoRABatch) -> None:
        self.layer, self.batch = layer, batch
        self.slices: dict[object, LoRASlice] = {}
        if layer.device.type == "cuda":
            from llmserve_kernels.triton.lora import lora_add_

            self._kernel = lora_add_
        else:
            from llmserve_kernels.cpu.lora import lora_add_

            self._kernel = lambda *args: lora_add_(*args) or lora_ref(*args)

    def add_slice(
        self, part, offset: int, in_features: int, out_features: int, slots: int, rank: int
    ) -> None:
        device, dtype = self.layer.device, self.layer.dtype
        self.slices[part] = LoRASlice(
            offset,
            torch.zeros(slots, rank, in_features, device=device, dtype=dtype),
            torch.zeros(slots, out_features, rank, device=device, dtype=dtype),
            torch.zeros(slots, device=device, dtype=torch.float32),
            [False] * slots,
        )

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        slots = self.batch.slots
        x2, y2 = x.reshape(-1, x.shape[-1]).contiguous(), y.view(-1, y.shape[-1])
        for s in self.slices.values():
            if any(s.used):
                self._kernel(
                    y2[:, s.offset : s.offset + s.out_features], x2, s.lora_a, s.lora_b, slots, s.scales
                )
        return y


def attach(model: nn.Module, batch: LoRABatch, slots: int, rank: int) -> dict[str, LoRASlice]:
    """Gives every targetable linear layer of the decoder its LoRA slices; returns them by the module name a
    PEFT adapter uses ("model.layers.0.self_attn.q_proj"), fused layers also under their parts' names."""
    targets: dict[str, LoRASlice] = {}
    for i, layer in enumerate(model.model.layers):
        for sub_name, sub in layer.named_children():
            for name, linear in sub.named_children():
                if not isinstance(linear, LinearBase) or name not in TARGETS:
                    continue
                if linear.tp_size > 1:
                    raise InvalidRequestError("LoRA adapters are not supported with tensor parallelism yet.")
                lora = linear.lora = LoRALayer(linear, batch)
                prefix = f"model.layers.{i}.{sub_name}"
                in_features = linear.input_size
                if isinstance(linear, ColumnParallelLinear):
                    total = sum(linear.output_sizes)
                    lora.add_slice(None, 0, in_features, total, slots, rank)
                    targets[f"{prefix}.{name}"] = lora.slices[None]
                    if len(linear.shard_ids) > 1:
                        for part_name, (fused, part) in FUSED_PARTS.items():
                            if fused == name:
                                offset, _, size = linear.part_slice(part)
                                lora.add_slice(part, offset, in_features, size, slots, rank)
                                targets[f"{prefix}.{part_name}"] = lora.slices[part]
                else:
                    lora.add_slice(None, 0, in_features, linear.output_size, slots, rank)
                    targets[f"{prefix}.{name}"] = lora.slices[None]
    return targets


def check_adapter(adapter: PeftAdapter, targets: dict[str, LoRASlice]) -> None:
    """A clear error for a module the base lacks or a shape that is not the base's."""
    for name, module in adapter.modules.items():
        target = targets.get(name)
        if target is None:
            kind = name.rsplit(".", 1)[-1]
            reason = (
                "the base model has no such module"
                if kind in TARGETS
                else "LoRA serves only " + (", ".join(TARGETS))
            )
            raise InvalidRequestError(f"LoRA adapter {adapter.path}: cannot apply to {name}: {reason}.")
        expected = (target.in_features, target.out_features)
        got = (module.lora_a.shape[1], module.lora_b.shape[0])
        if got != expected:
            raise InvalidRequestError(
                f"LoRA adapter {adapter.path}: {name} maps {got[0]} -> {got[1]} features where the base "
                f"model's maps {expected[0]} -> {expected[1]} (an adapter of another model?)."
            )
