"""Llama-family decoder: GQA attention over the paged KV cache, RoPE, SwiGLU MLP, RMSNorm.

Covers Llama 2/3, SmolLM, Mistral (no sliding window) and Qwen2 (qkv bias) through ModelConfig flags.
Inputs are flattened: all tokens of all sequences in the step form one [num_tokens] batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from inference_engine.attention import AttentionMetadata
from inference_engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from inference_engine.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    Weight,
)
from inference_engine.layers.norm import RMSNorm
from inference_engine.layers.rotary import RotaryEmbedding
from inference_engine.model_loader import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.attention_bias,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim, config.hidden_size)
        self.rotary = rotary
        self.backend = backend
        self.scale = config.head_dim**-0.5
        # Set by the model runner once the KV cache is allocated: [blocks, block_size, kv_heads, head_dim].
        self.k_cache = self.v_cache = torch.empty(0)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # Queries and keys are rotated in one pass: fewer small ops per layer is what a CPU step pays for.
        qk = qkv[:, : q_size + kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, qk).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        out = self.backend(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return self.o_proj(out.reshape(-1, q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, backend)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual, meta: AttentionMetadata):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary, backend) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # Checkpoint names that load into a slice of one of our fused parameters.
    packed_modules: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, backend) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, backend)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        """Loads checkpoint tensors (Hugging Face names; quantized linear weights as `kernels.quantized`
        forms under `<layer>.weight`). Layers that pack their weights check for missing parts in
        `finalize`; plain parameters are checked here."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue
            shard_id = None
            for ckpt_name, (ours, shard) in self.packed_modules.items():
                if f".{ckpt_name}." in name:
                    name, shard_id = name.replace(ckpt_name, ours), shard
                    break
            module_name, _, attr = name.rpartition(".")
            try:
                module = self.get_submodule(module_name)
            except AttributeError:
                continue  # e.g. rotary inv_freq buffers saved by some checkpoints
            if attr == "weight" and hasattr(module, "load_weight"):
                module.load_weight(tensor, shard_id)
            elif name in params:
                loader = getattr(module, "weight_loader", None)
                if loader is not None:
                    loader(params[name], tensor.to(params[name].dtype), shard_id)
                else:
                    params[name].data.copy_(tensor)
                loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")

    def finalize(self, quantize_int8: bool = False) -> None:
        """Packs every weight for the device's kernels once all are loaded (dense linear weights
        quantized to int8 first with `quantize_int8`; the embedding and head stay as loaded)."""
        for module in self.modules():
            if isinstance(module, LinearBase):
                module.finalize(quantize_int8)
            elif isinstance(module, VocabParallelEmbedding):
                module.finalize()

    @property
    def weight_bytes(self) -> int:
        packed = sum(m.weight_bytes for m in self.modules() if m is not self and hasattr(m, "weight_bytes"))
        return packed + sum(p.numel() * p.element_size() for p in self.parameters())
