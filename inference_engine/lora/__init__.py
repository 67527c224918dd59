"""LoRA adapters served beside their base model: many fine-tunes in one batch (issue 59).

`request.LoRARequest` names an adapter (vLLM's `vllm.lora.request.LoRARequest`); `peft` reads a PEFT folder;
`layers` attaches slot stacks to the model's linear layers; `slots.LoRAManager` keeps a fixed number of
adapters in those slots and an LRU of loaded ones in CPU memory. Importing this package does not import torch.
"""

from inference_engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
