"""A Hugging Face config.json (as transformers 4.x or 5.x writes it) as our `ModelConfig`.

GGUF files are read into the same dictionary first (`gguf_loader`), so one function decides what a
checkpoint asks for. A field the engine does not implement is refused here, naming it, rather than served
wrong.
"""

from __future__ import annotations

from inference_engine.layers.rotary import ROPE_TYPES
from inference_engine.model_config import ModelConfig, MoEModelConfig

# Config fields that change the computation and that no family here implements, with the value that is
# harmless (anything else is refused).
_UNSUPPORTED = {
    "mlp_bias": False,
    "use_bidirectional_attention": False,
    "attn_logit_softcapping_per_layer": None,
    "use_qk_norm": False,
    "rope_interleaved": False,
    "clip_qkv": None,  # OLMoE's clamp of q, k and v (its released checkpoints leave it unset)
}
# Read by the mixture-of-experts families (`MoEModelConfig`); router_aux_loss_coef, output_router_logits and
# router_jitter_noise only shape training.
_MOE_ARCHITECTURES = {"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"}


def _moe_fields(arch: str, raw: dict) -> dict:
    """The `MoEModelConfig` fields of a mixture-of-experts config.json (Mixtral's names or Qwen's)."""
    experts = raw.get("num_experts") or raw.get("num_local_experts")
    top_k = raw.get("num_experts_per_tok")
    if not experts or not top_k or top_k > experts:
        raise ValueError(
            f"{arch}: num_experts={experts}, num_experts_per_tok={top_k} is not a mixture of experts."
        )
    if arch == "Qwen2MoeForCausalLM" and not raw.get("shared_expert_intermediate_size"):
        raise ValueError(f"{arch}: config field shared_expert_intermediate_size is missing.")
    layers, step = raw["num_hidden_layers"], raw.get("decoder_sparse_step") or 1
    mlp_only = set(raw.get("mlp_only_layers") or [])
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=raw.get("moe_intermediate_size") or raw["intermediate_size"],
        # Mixtral always renormalises; the others where the config says so (transformers' default: off)
        norm_topk_prob=arch == "MixtralForCausalLM" or bool(raw.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size") or 0,
        dense_layers=[i for i in range(layers) if i in mlp_only or (i + 1) % step],
    )


# Encoder-only families (bidirectional attention, no causal mask): embedding models such as BGE, E5 or GTE's
# BERT-sized ones. `is_decoder` does not tell them apart: transformers 4 wrote `"is_decoder": false` into
# decoders' config.json too.
_ENCODER_ONLY_TYPES = {
    "albert", "bert", "camembert", "deberta", "deberta-v2", "distilbert", "electra", "ernie", "modernbert",
    "mpnet", "new", "nomic_bert", "roberta", "xlm-roberta", "xlm-roberta-xl",
}  # fmt: skip


def model_class(raw: dict):
    """(architecture, class). A decoder's base model (`LlamaModel`: what sentence-transformers saves) is
    its causal-LM class's body without the head (`base_model`)."""
    from inference_engine.models import MODEL_CLASSES

    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in MODEL_CLASSES:
            return arch, MODEL_CLASSES[arch]
        causal = base_model(arch)
        if causal is not None and causal in MODEL_CLASSES:
            return causal, MODEL_CLASSES[causal]
    model_type = raw.get("model_type")
    if model_type in _ENCODER_ONLY_TYPES:
        name = archs[0] if archs else model_type
        raise ValueError(
            f"{name} (model_type {model_type!r}) is an encoder-only model: encoder-only embedding models are "
            "not supported yet; serve a decoder embedding model (e.g. Qwen3-Embedding, e5-mistral) instead."
        )
    raise ValueError(f"architecture {archs} is not supported (supported: {sorted(MODEL_CLASSES)}).")


def base_model(arch: str) -> str | None:
    """The causal-LM architecture whose body `arch` names (`LlamaModel` -> `LlamaForCausalLM`); None if
    `arch` is not a base-model name."""
    return arch.removesuffix("Model") + "ForCausalLM" if arch.endswith("Model") else None


def _rope(raw: dict) -> tuple[dict, dict | None]:
    """(the global layers' rope parameters, the sliding layers' own or None), each a dict with rope_theta
    and, where scaled, the scaling fields, whichever way the config writes them."""
    params = raw.get("rope_parameters") or {}
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type (transformers 5)
        full = dict(params.get("full_attention") or next(iter(params.values())))
        local = params.get("sliding_attention")
        return full, dict(local) if local is not None else None
    full = dict(params or raw.get("rope_scaling") or {})
    full.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    local_theta = raw.get("rope_local_base_freq")
    return full, ({"rope_theta": local_theta} if local_theta is not None else None)


def _rope_kind(params: dict) -> str:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type {kind!r} is not supported (supported: {ROPE_TYPES}).")
    return kind


def model_config(raw: dict, eos_token_ids: list[int]) -> ModelConfig:
    if "text_config" in raw:  # a multimodal checkpoint (Gemma 3): its text model
        raw = {**raw["text_config"], "architectures": raw.get("architectures")}
    arch, cls = model_class(raw)
    for key, harmless in _UNSUPPORTED.items():
        if raw.get(key, harmless) not in (harmless, None):
            raise ValueError(f"{arch}: config field {key}={raw[key]!r} is not supported.")
    heads = raw["num_attention_heads"]
    full, local = _rope(raw)
    kind = _rope_kind(full)
    scaling = None
    if kind != "default":
        scaling = {k: v for k, v in full.items() if k != "rope_theta"}
        if "original_max_position_embeddings" in raw:
            scaling.setdefault("original_max_position_embeddings", raw["original_max_position_embeddings"])
    if local is not None and _rope_kind(local) != "default":
        raise ValueError(f"{arch}: scaled rope on sliding layers ({local}) is not supported.")
    partial = full.get("partial_rotary_factor") or raw.get("partial_rotary_factor") or 1.0
    layers = raw["num_hidden_layers"]
    layer_types = raw.get("layer_types") or cls.default_layer_types(raw)
    if layer_types is not None and len(layer_types) != layers:
        raise ValueError(f"{arch}: layer_types lists {len(layer_types)} layers, the model has {layers}.")
    if layer_types is not None and not set(layer_types) <= {"full_attention", "sliding_attention"}:
        raise ValueError(f"{arch}: layer_types {sorted(set(layer_types))} are not supported.")
    window = raw.get("sliding_window") or 0
    if layer_types is not None and "sliding_attention" not in layer_types:
        window = 0
    moe = _moe_fields(arch, raw) if arch in _MOE_ARCHITECTURES else {}
    headless = arch not in (raw.get("architectures") or [])  # a base model (`base_model`): no head
    tied = raw.get("tie_word_embeddings", False) or headless
    return (MoEModelConfig if moe else ModelConfig)(
        **moe,
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
        rope_theta=full["rope_theta"],
        rope_scaling=scaling,
        # A base model (`base_model`) has no head: its embedding stands in (a pooling runner reads no logits).
        tie_word_embeddings=tied,
        has_lm_head=not headless or raw.get("tie_word_embeddings", False),
        attention_bias=raw.get("attention_bias", raw.get("qkv_bias", cls.attention_bias)),
        eos_token_ids=eos_token_ids,
        hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "silu",
        partial_rotary_factor=partial,
        sliding_window=window,
        layer_types=layer_types,
        local_rope_theta=local["rope_theta"] if local is not None else None,
        query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
        attn_logit_softcapping=raw.get("attn_logit_softcapping") or 0.0,
        final_logit_softcapping=raw.get("final_logit_softcapping") or 0.0,
        embedding_multiplier=raw.get("embedding_multiplier", 1.0),
        attention_multiplier=raw.get("attention_multiplier"),
        residual_multiplier=raw.get("residual_multiplier", 1.0),
        logits_scaling=raw.get("logits_scaling", 1.0),
    )
