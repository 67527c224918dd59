"""The llmserve inference engine: paged KV cache, continuous batching, an offline API shaped like vLLM's.

`LLM` and `LLMEngine` import torch, so they load lazily: the web tier imports `SamplingParams` and the
bus client from this package without pulling torch in.
"""

from inference_engine.config import EngineConfig
from inference_engine.outputs import CompletionOutput, Logprob, RequestOutput
from inference_engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str):
    if name == "LLM":
        from inference_engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from inference_engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'inference_engine' has no attribute {name!r}")
