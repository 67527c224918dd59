"""What a checkpoint's architecture is, as the engine reads it (`model_loader.hf_config` builds these from a
config.json or a GGUF file's metadata). Apart from the loaders so that the model families, which the loaders
look up, can take it without importing them."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    # False for a decoder's base model saved without its head and with untied embeddings (a
    # sentence-transformers folder): its hidden states are right, logits from the tied embedding would not be.
    has_lm_head: bool = True
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
class MoEModelConfig(ModelConfig):
    """`ModelConfig` with the mixture-of-experts fields: each MoE layer routes a token to
    `num_experts_per_tok` of `num_experts` SiLU-gated experts of width `moe_intermediate_size` (and, with
    `shared_expert_intermediate_size`, one shared expert every token goes through, Qwen2-MoE); the layers
    in `dense_layers` keep a dense MLP of `intermediate_size`."""

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    shared_expert_intermediate_size: int = 0
    dense_layers: list[int] = field(default_factory=list)

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

    @property
    def layer_linear_parameters(self) -> int:
        """Weights one token multiplies by in an MoE layer: attention, the router, its k experts and the
        shared expert (the other experts are not read for it)."""
        dense_mlp = 3 * self.hidden_size * self.intermediate_size
        routed = self.num_experts_per_tok * 3 * self.hidden_size * self.moe_intermediate_size
        shared = 3 * self.hidden_size * self.shared_expert_intermediate_size + self.hidden_size
        return (
            super().layer_linear_parameters
            - dense_mlp
            + routed
            + shared
            + self.num_experts * self.hidden_size
        )
