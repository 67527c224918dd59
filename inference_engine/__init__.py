"""The llmserve inference engine: paged KV cache, continuous batching, an offline API shaped like vLLM's.

`LLM`, `AsyncLLM` and `LLMEngine` import torch, so they load lazily: the web tier imports `SamplingParams`
and the bus client from this package without pulling torch in.
"""

from importlib import import_module

from inference_engine.config import EngineConfig
from inference_engine.lora.request import LoRARequest
from inference_engine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
)
from inference_engine.pooling import PoolerConfig, PoolingParams
from inference_engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "AsyncLLMEngine",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineConfig",
    "LLMEngine",
    "LoRARequest",
    "Logprob",
    "PoolerConfig",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
]

_LAZY = {
    "LLM": "inference_engine.llm",
    "AsyncLLM": "inference_engine.async_llm",
    "AsyncLLMEngine": "inference_engine.async_llm",
    "LLMEngine": "inference_engine.llm_engine",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'inference_engine' has no attribute {name!r}")
