"""Llama-family decoder: GQA attention over the paged KV cache, RoPE, gated MLP, RMSNorm.

The shared layers every family builds on. Llama 2/3, SmolLM and Mistral are this class as it stands; the
variants other families switch on are read from `ModelConfig` here (sliding windows, attention and logit
soft-capping, rotary variants, attention scales, multipliers) or set by the family's own file as class
attributes (`qk_norm`, the decoder layer class, checkpoint conversions). Inputs are flattened: all tokens
of all sequences in the step form one [num_tokens] batch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from inference_engine.attention import AttentionMetadata
from inference_engine.attention.torch_backend import NATIVE_QUERY_MIN, native_limit
from inference_engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from inference_engine.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    Weight,
)
from inference_engine.layers.norm import RMSNorm, triton_fused
from inference_engine.layers.rotary import RotaryEmbedding
from inference_engine.model_config import ModelConfig
from llmserve_kernels.cpu import fused as cpu_fused
from llmserve_kernels.cpu.linear import NATIVE_STEP_ROWS

if TYPE_CHECKING:
    from llmserve_kernels.cpu.decoder import Extend, NativeDecoder

ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu_tanh")

logger = logging.getLogger(__name__)


class LlamaAttention(nn.Module):
    """`qk_norm`: None, "head" (an RMSNorm over each head's query and key, Qwen3 / Gemma 3) or "whole" (one
    over the whole query and key projections, OLMo 2), applied before the rotation."""

    def __init__(
        self, config: ModelConfig, layer: int, rotary: RotaryEmbedding, backend, qk_norm: str | None = None
    ) -> None:
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
        self.scale = config.attention_multiplier or (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.window = config.sliding_window if config.is_sliding(layer) else 0
        self.softcap = config.attn_logit_softcapping
        self.qk_norm = qk_norm
        if qk_norm == "head":
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        elif qk_norm == "whole":
            if self.qkv_proj.tp_size > 1:
                raise ValueError("a q/k norm over whole projections is not supported with tensor parallelism")
            self.q_norm = RMSNorm(self.num_heads * config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.num_kv_heads * config.head_dim, config.rms_norm_eps)
        # Set by the model runner once the KV cache is allocated: [blocks, block_size, kv_heads, head_dim].
        self.k_cache = self.v_cache = torch.empty(0)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.qk_norm is None:
            # Queries and keys are rotated in one pass: fewer small ops per layer is what a CPU step pays for.
            qk = qkv[:, : q_size + kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        else:
            qk = self._normed_qk(qkv[:, :q_size], qkv[:, q_size : q_size + kv_size])
        q, k = self.rotary(positions, qk).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        out = self.backend(
            q, k, v, self.k_cache, self.v_cache, meta, self.scale, window=self.window, softcap=self.softcap
        )
        return self.o_proj(out.reshape(-1, q_size))

    def _normed_qk(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        tokens = q.shape[0]
        if self.qk_norm == "head":
            q = self.q_norm(q.reshape(-1, self.head_dim))
            k = self.k_norm(k.reshape(-1, self.head_dim))
        else:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        return torch.cat([q.view(tokens, -1, self.head_dim), k.view(tokens, -1, self.head_dim)], dim=1)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (supported: {ACTIVATIONS}).")
        self.gelu = config.hidden_act != "silu"
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)
        self.triton = triton_fused() if torch.get_default_device().type == "cuda" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.triton is not None and not self.gelu:
            return self.down_proj(self.triton.silu_and_mul(gate_up))
        # bf16 on the CPU, as the native decoder computes it
        act = cpu_fused.gelu_tanh_mul(gate_up) if self.gelu else cpu_fused.silu_mul(gate_up)
        if act is not None:
            return self.down_proj(act)
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act.mul_(up))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm layer. The residual stream travels as (hidden, residual): the next norm adds them, fused."""

    def __init__(
        self, config: ModelConfig, layer: int, rotary: RotaryEmbedding, backend, qk_norm: str | None
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer, rotary, backend, qk_norm)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual, meta: AttentionMetadata):
        hidden, residual = self.normed_input(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def normed_input(self, hidden, residual):
        """(the input norm of the stream, the stream): the stream is hidden + residual (hidden alone in the
        first layer), added inside the norm's kernel."""
        if residual is None:
            return self.input_layernorm(hidden), hidden
        return self.input_layernorm(hidden, residual)

    def native_norms(self) -> dict[str, torch.Tensor | None]:
        """This layer's norm weights by the place `llmserve_kernels.cpu.decoder.DecoderLayer` gives them."""
        return {"input_norm": self.input_layernorm.weight, "post_norm": self.post_attention_layernorm.weight}


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend, layer_cls: type[nn.Module], qk_norm: str | None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        dim, positions = int(config.head_dim * config.partial_rotary_factor), config.max_position_embeddings
        rotary = RotaryEmbedding(config.head_dim, positions, config.rope_theta, config.rope_scaling, dim)
        local = rotary
        if config.local_rope_theta is not None:  # the sliding layers' own base, unscaled (Gemma 3)
            local = RotaryEmbedding(config.head_dim, positions, config.local_rope_theta, None, dim)
        self.layers = nn.ModuleList(
            layer_cls(config, i, local if config.is_sliding(i) else rotary, backend, qk_norm)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.config = config
        self.embed_scale = 1.0  # set by families that scale their embeddings
        self.native: NativeDecoder | None = None

    def native_variants(self) -> list[str]:
        """What this model does that the native decoder does not (it then runs layer by layer)."""
        return [] if hasattr(self.layers[0], "native_norms") else [f"{type(self.layers[0]).__name__}"]

    def use_native_decoder(self) -> bool:
        """Runs steps of up to a few hundred tokens through kernels/cpu/decoder.py from now on, where this
        model can (bf16 on the CPU, unsharded, every linear layer one weight on a native kernel, no variant
        the decoder lacks); False otherwise."""
        from llmserve_kernels.cpu import available, decoder

        attn = self.layers[0].self_attn
        linears = [
            linear
            for layer in self.layers
            for linear in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
        ]
        rows = min(decoder.native_rows(m.packed[0]) if len(m.packed) == 1 else 0 for m in linears)
        if (
            rows < 1
            or attn.k_cache.device.type != "cpu"
            or attn.k_cache.dtype != torch.bfloat16
            or attn.qkv_proj.tp_size != 1
            or not available()
        ):
            return False
        if variants := self.native_variants():
            logger.info(
                "%s runs layer by layer: the native decoder does not take its %s",
                self.config.architecture,
                ", ".join(variants),
            )
            return False
        self.native = decoder.NativeDecoder(
            [self._native_layer(layer, attn.rotary) for layer in self.layers],
            heads=attn.num_heads,
            head_dim=attn.head_dim,
            eps=self.config.rms_norm_eps,
            cos=attn.rotary.cos,
            sin=attn.rotary.sin,
            final_norm=self.norm.weight,
            max_rows=min(rows, NATIVE_STEP_ROWS),
        )
        return True

    @staticmethod
    def _native_layer(layer: nn.Module, rotary: RotaryEmbedding):
        from llmserve_kernels.cpu.decoder import DecoderLayer

        attn = layer.self_attn
        own_rotary = attn.rotary is not rotary
        return DecoderLayer(
            qkv=attn.qkv_proj.packed[0],
            qkv_bias=attn.qkv_proj.bias,
            o=attn.o_proj.packed[0],
            gate_up=layer.mlp.gate_up_proj.packed[0],
            down=layer.mlp.down_proj.packed[0],
            k_cache=attn.k_cache,
            v_cache=attn.v_cache,
            q_norm=attn.q_norm.weight if attn.qk_norm else None,
            k_norm=attn.k_norm.weight if attn.qk_norm else None,
            qk_norm_whole=attn.qk_norm == "whole",
            window=attn.window,
            softcap=attn.softcap,
            scale=attn.scale,
            gelu=layer.mlp.gelu,
            cos=attn.rotary.cos if own_rotary else None,
            sin=attn.rotary.sin if own_rotary else None,
            rotary_dim=attn.rotary.rotary_dim,
            **layer.native_norms(),
        )

    def _native_extend(self, meta: AttentionMetadata) -> Extend | bool | None:
        """The sequences whose attention goes through the extend kernel in this step, as `torch_backend`
        sends them (None: none); False where a chunk is too long for the native kernels (SDPA takes it)."""
        from llmserve_kernels.cpu.decoder import Extend

        if meta.max_query_len <= NATIVE_QUERY_MIN:
            return None
        attn = self.layers[0].self_attn
        limit = native_limit(meta, attn.num_heads, attn.num_kv_heads, attn.head_dim, torch.bfloat16)
        if meta.max_query_len > limit:
            return False
        return Extend(meta.query_start_loc, meta.seq_lens, meta.block_tables, NATIVE_QUERY_MIN + 1, limit)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale != 1.0:  # in the activations' dtype, as transformers multiplies
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        return hidden

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden, residual = self.embed(input_ids), None
        if self.native is not None and len(input_ids) <= self.native.max_rows:
            extend = self._native_extend(meta)
            if extend is not False:
                per_token = meta.per_token()
                return self.native.forward(
                    hidden.contiguous(), positions, meta.slot_mapping, *per_token, extend
                )
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
    decoder_layer: ClassVar[type[nn.Module]] = LlamaDecoderLayer
    qk_norm: ClassVar[str | None] = None
    attention_bias: ClassVar[bool] = False  # where the config does not say

    def __init__(self, config: ModelConfig, backend) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, backend, self.decoder_layer, self.qk_norm)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    @staticmethod
    def default_layer_types(raw: dict) -> list[str] | None:
        """Layer types of a config.json that does not list them (older transformers wrote none): None
        lets `sliding_window`, where set, apply to every layer."""
        return None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        if logits is None:
            return None
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def use_native_decoder(self) -> bool:
        """`LlamaModel.use_native_decoder`, and `generate` too where the head, its logits and the
        embeddings allow."""
        if not self.model.use_native_decoder():
            return False
        # `generate` samples from the head's logits and embeds each new token itself, both as they are.
        plain = self.config.logits_scaling == 1.0 and not self.config.final_logit_softcapping
        if self.lm_head.tp_size == 1 and plain and self.model.embed_scale == 1.0:
            head = self.lm_head.tied_to or self.lm_head
            self.model.native.attach_head(head.packed, self.model.embed_tokens.packed)
        return True

    @property
    def generate_rows(self) -> int:
        """Sequences `generate` takes at once (0: it cannot run here)."""
        return self.model.native.generate_rows if self.model.native is not None else 0

    def generate(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        sampling: tuple[torch.Tensor, ...] | None = None,
    ) -> torch.Tensor:
        """Decode steps of each sequence in one native call: input_ids [m] each sequence's newest token;
        positions, slots, lens [steps, m]; tables [m, max_blocks]; `sampling` as `NativeDecoder.generate`
        takes it. Returns the tokens [steps, m], those `compute_logits` and the sampler would give step by
        step."""
        hidden = self.model.embed(input_ids).contiguous()
        return self.model.native.generate(hidden, positions, slots, tables, lens, sampling)

    def checkpoint_weights(self, weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
        """The checkpoint's tensors as this class names and holds them; families whose checkpoints store
        something otherwise (fused projections, offset norms) convert it here."""
        return iter(weights)

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        """Loads checkpoint tensors (Hugging Face names; quantized linear weights as kernels/quantized.py
        forms under `<layer>.weight`). Layers that pack their weights check for missing parts in
        `finalize`; plain parameters are checked here."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in self.checkpoint_weights(weights):
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
