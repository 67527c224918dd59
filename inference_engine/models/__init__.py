"""Model implementations, one file per family over the shared Llama layers, found by the `architectures`
name of a checkpoint's config."""

from torch import nn

from inference_engine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from inference_engine.models.granite import GraniteForCausalLM
from inference_engine.models.llama import LlamaForCausalLM
from inference_engine.models.mixtral import MixtralForCausalLM
from inference_engine.models.olmo2 import Olmo2ForCausalLM
from inference_engine.models.olmoe import OlmoeForCausalLM
from inference_engine.models.phi3 import Phi3ForCausalLM
from inference_engine.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from inference_engine.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
}
