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
from inference_engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
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
            self.lm_head.weight = self.model.embed_tokens.weight
            self.lm_head.tied = True

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
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
            if name not in params:
                continue  # e.g. rotary inv_freq buffers saved by some checkpoints
            param = params[name]
            module = self.get_submodule(name.rsplit(".", 1)[0])
            loader = getattr(module, "weight_loader", None)
            if loader is not None:
                loader(param, tensor.to(param.dtype), shard_id)
            else:
                param.data.copy_(tensor)
            loaded.add(name)
        missing = {
            n
            for n in params
            if n not in loaded and not (self.config.tie_word_embeddings and n == "lm_head.weight")
        }
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")
