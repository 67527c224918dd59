"""Model implementations. Llama-family architectures (Llama, SmolLM, Mistral, Qwen2) share one class."""

from inference_engine.models.llama import LlamaForCausalLM

MODEL_CLASSES = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM}
