"""The adapter a request runs with, as vLLM's `vllm.lora.request.LoRARequest` (same fields, same order)."""

from __future__ import annotations

from dataclasses import dataclass

from inference_engine.errors import InvalidRequestError


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name`: the adapter's name (the API's `model`); `lora_int_id`: a unique id >= 1 (the engine keys
    slots and the prefix cache by it); `lora_path`: the PEFT folder (adapter_config.json and
    adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise InvalidRequestError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}.")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id
