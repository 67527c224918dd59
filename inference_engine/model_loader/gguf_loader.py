"""GGUF files as llama.cpp's converter writes them: the metadata read into the Hugging Face config of the
same model (`hf_config_dict`, with llama.cpp's defaults where the file is silent), weights kept in their
quantized blocks (`gguf_quant`) or dequantized by the `gguf` package and given back in the checkpoint's
layout (Q/K rows unpermuted, Gemma's norms less the 1 the converter added, Phi-3's fused projections split),
and the tokenizer rebuilt from the vocabulary stored in the file: byte-level BPE from its merges, or
SentencePiece BPE from its pieces' scores."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from inference_engine.config import resolve_quantization
from inference_engine.model_loader import LoadedModel, ModelConfig, Weight, gguf_file, gguf_quant
from inference_engine.model_loader.hf_config import model_config
from inference_engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DENSE_TYPES = (
    gguf.GGMLQuantizationType.F32,
    gguf.GGMLQuantizationType.F16,
    gguf.GGMLQuantizationType.BF16,
)

# llama.cpp's architecture names -> the Hugging Face class whose config `hf_config` reads.
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
# llama.cpp writes Mixtral as `llama` with experts. Whether the top-k routing weights are renormalised is
# not in the file: llama.cpp fixes it per architecture, and so is it read here.
_MOE_RENORMALISED = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}
# Architectures whose Q/K rows llama.cpp's converter reorders for its interleaved rotation (its LlamaModel
# and the classes built on it); the others rotate halves as transformers does and are stored as they are.
_PERMUTED = {"llama", "granite"}
# Gemma's converter stores its (1 + w) norms as the sum; the checkpoint convention is w.
_OFFSET_NORMS = {"gemma2", "gemma3"}
# llama.cpp's sliding-window layer pattern where the file gives none: every n-th layer is global.
_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6, "olmo2": 4}

_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

# `{arch}.` metadata the mapping below reads; any other key of the architecture is refused, since it could
# change the computation (general.* keys describe the file and are ignored).
_KNOWN_KEYS = {
    "vocab_size",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "block_count",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "attention.sliding_window",
    "attention.sliding_window_pattern",
    "attention.scale",
    "rope.dimension_count",
    "rope.freq_base",
    "rope.freq_base_swa",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scaling.original_context_length",
    "rope.scaling.finetuned",
    "rope.scaling.attn_factor",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "embedding_scale",
    "residual_scale",
    "logit_scale",
    "expert_count",
    "expert_used_count",
    "expert_feed_forward_length",
    "expert_shared_feed_forward_length",
    "expert_gating_func",
}
_ROPE_SCALING = ("none", "linear", "yarn")

# GGUF tensor name -> Hugging Face name; per layer, the part after `blk.{i}.`.
_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# The stacked experts [E, rows, cols] of one projection, given back as each expert's tensor.
_STACKED_EXPERTS = (
    ".mlp.experts.gate_proj.weight",
    ".mlp.experts.up_proj.weight",
    ".mlp.experts.down_proj.weight",
)
# Gemma's ffn_norm is the norm before its MLP; its post_attention_norm is the one after attention.
_ARCH_LAYER_NAMES = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
}
# Tensors that are metadata in the Hugging Face form (llama.cpp's Llama 3 rope frequency factors).
_CONFIG_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}

# Pre-tokenizer splits per llama.cpp's `tokenizer.ggml.pre` names (regexes as in the original tokenizers).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_DIGITS = {"smollm", "starcoder", "refact", "command-r", "codeshell"}
# SentencePiece's piece types as the converter writes them (`tokenizer.ggml.token_type`) and its space.
_NORMAL, _BYTE = 1, 6
_SPACE = "\u2581"


def load(path: Path, quantization: str | None = None) -> LoadedModel:
    """`quantization`: None or "gguf" keeps quantized tensors quantized; "none" and "int8" dequantize
    them (int8 requantizes the dense linear weights afterwards, in the model runner)."""
    reader = gguf_file.read(path)
    quantized = any(t.tensor_type not in DENSE_TYPES for t in reader.tensors)
    method = resolve_quantization(quantization, "gguf" if quantized else None, f"the GGUF file {path.name}")
    meta = {name: value for name, value in reader.fields.items() if not name.startswith("tokenizer.ggml.")}
    arch = meta["general.architecture"]
    raw = hf_config_dict(reader, meta)
    tokenizer = _tokenizer(reader)
    config = model_config(raw, tokenizer.eos_token_ids)
    name = meta.get("general.name") or path.stem
    weights = _weights(reader, arch, config, keep_quantized=method == "gguf")
    return LoadedModel(name=name, config=config, tokenizer=tokenizer, weights=weights, quantization=method)


def hf_config_dict(reader: gguf_file.GGUFFile, meta: dict) -> dict:
    """The file's metadata (`meta`: its fields but the tokenizer's) as the config.json of the same model,
    read the way llama.cpp reads it (its defaults where the file is silent), so that
    `hf_config.model_config` decides for both formats."""
    arch = meta["general.architecture"]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {sorted(SUPPORTED_ARCHITECTURES)})."
        )
    prefix = f"{arch}."
    unknown = sorted(k for k in meta if k.startswith(prefix) and k[len(prefix) :] not in _KNOWN_KEYS)
    if unknown:
        raise ValueError(f"GGUF {arch}: metadata {unknown} is not supported.")

    def get(key: str, default=None):
        return meta.get(prefix + key, default)

    hidden, heads, layers = get("embedding_length"), get("attention.head_count"), get("block_count")
    for key in ("attention.head_count", "attention.head_count_kv", "feed_forward_length"):
        if isinstance(get(key), list):
            raise ValueError(f"GGUF {arch}: per-layer {prefix}{key} is not supported.")
    head_dim = get("attention.key_length") or hidden // heads
    if get("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"GGUF {arch}: {prefix}attention.value_length differs from key_length.")
    tensors = {t.name: t for t in reader.tensors}
    context = get("context_length", 2048)
    raw = {
        "architectures": [SUPPORTED_ARCHITECTURES[arch]],
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": context,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "partial_rotary_factor": get("rope.dimension_count", head_dim) / head_dim,
    }
    rope = _rope_parameters(get, context, tensors)
    window = get("attention.sliding_window") or 0
    if window:
        raw["sliding_window"] = window
        raw["layer_types"] = _layer_types(arch, layers, get("attention.sliding_window_pattern"))
    if arch in ("gemma2", "gemma3"):
        # llama.cpp scales Gemma's attention by 1/sqrt(head_dim), by hidden/heads for the 27B (46 layers for
        # Gemma 2, 62 for Gemma 3).
        raw["query_pre_attn_scalar"] = hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim
        raw["hidden_activation"] = "gelu_pytorch_tanh"
        raw["layer_types"] = raw.get("layer_types") or ["full_attention"] * layers
    if arch == "gemma3":
        local = {"rope_type": "default", "rope_theta": get("rope.freq_base_swa", 10000.0)}
        rope = {"full_attention": rope, "sliding_attention": local}
    elif get("rope.freq_base_swa") is not None:
        raise ValueError(f"GGUF {arch}: {prefix}rope.freq_base_swa is not supported.")
    raw["rope_parameters"] = rope
    if get("expert_count"):
        raw.update(_moe_config(arch, get, layers, tensors))
    raw["attn_logit_softcapping"] = get("attn_logit_softcapping")
    raw["final_logit_softcapping"] = get("final_logit_softcapping")
    if arch == "granite":
        raw["attention_multiplier"] = get("attention.scale")
        raw["embedding_multiplier"] = get("embedding_scale", 1.0)
        raw["residual_multiplier"] = get("residual_scale", 1.0)
        raw["logits_scaling"] = get("logit_scale", 1.0)
    else:
        for key in ("attention.scale", "embedding_scale", "residual_scale", "logit_scale"):
            if get(key) is not None:
                raise ValueError(f"GGUF {arch}: {prefix}{key} is not supported.")
    return raw


def _moe_config(arch: str, get, layers: int, tensors: dict) -> dict:
    """The mixture-of-experts fields of config.json; a layer without a router keeps a dense MLP."""
    if arch not in _MOE_RENORMALISED:
        raise ValueError(f"GGUF {arch}: experts are not supported for this architecture.")
    if get("expert_gating_func", gguf.ExpertGatingFuncType.SOFTMAX) != gguf.ExpertGatingFuncType.SOFTMAX:
        raise ValueError(
            f"GGUF {arch}: {arch}.expert_gating_func {get('expert_gating_func')} is not supported."
        )
    moe = {
        "num_experts": get("expert_count"),
        "num_experts_per_tok": get("expert_used_count"),
        "moe_intermediate_size": get("expert_feed_forward_length") or get("feed_forward_length"),
        "norm_topk_prob": _MOE_RENORMALISED[arch],
        "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors],
    }
    if get("expert_shared_feed_forward_length"):
        moe["shared_expert_intermediate_size"] = get("expert_shared_feed_forward_length")
    if arch == "llama":
        moe["architectures"] = ["MixtralForCausalLM"]
    return moe


def _rope_parameters(get, context: int, tensors: dict) -> dict:
    kind = get("rope.scaling.type", "none")
    if kind not in _ROPE_SCALING:
        raise ValueError(f"GGUF rope.scaling.type {kind!r} is not supported (supported: {_ROPE_SCALING}).")
    rope = {"rope_type": "default", "rope_theta": get("rope.freq_base", 10000.0)}
    if kind != "none" and (get("rope.scaling.factor") or 1.0) != 1.0:
        rope.update(rope_type=kind, factor=get("rope.scaling.factor"))
        if kind == "yarn":
            rope["original_max_position_embeddings"] = get("rope.scaling.original_context_length", context)
    if "rope_factors_long.weight" in tensors:
        # Phi-3's longrope: short factors up to the original context, long ones past it.
        if rope["rope_type"] != "default":
            raise ValueError("GGUF rope_factors_long.weight beside rope.scaling.type is not supported.")
        factors = {
            kind: [
                float(f)
                for f in np.asarray(_tensor(tensors[f"rope_factors_{kind}.weight"], False)).reshape(-1)
            ]
            for kind in ("short", "long")
        }
        rope.update(
            rope_type="longrope",
            short_factor=factors["short"],
            long_factor=factors["long"],
            original_max_position_embeddings=get("rope.scaling.original_context_length", context),
        )
        if get("rope.scaling.attn_factor") is not None:
            rope["attention_factor"] = get("rope.scaling.attn_factor")
    elif get("rope.scaling.attn_factor") is not None:
        raise ValueError("GGUF rope.scaling.attn_factor without rope_factors_long.weight is not supported.")
    freqs = tensors.get("rope_freqs.weight")
    if freqs is not None:
        if rope["rope_type"] != "default":
            raise ValueError("GGUF rope_freqs.weight beside rope.scaling.type is not supported.")
        # Llama 3's scaling as llama.cpp stores it: a divisor per frequency. That is `longrope` with one list
        # for every position (its long factors start at original_max_position_embeddings = the context).
        factors = [float(f) for f in np.asarray(_tensor(freqs, False)).reshape(-1)]
        rope.update(
            rope_type="longrope",
            short_factor=factors,
            long_factor=factors,
            original_max_position_embeddings=context,
            attention_factor=1.0,
        )
    return rope


def _layer_types(arch: str, layers: int, pattern) -> list[str]:
    """Which layers slide, as llama.cpp decides: a per-layer list of flags, or every pattern-th layer global
    (the architecture's default pattern; none: every layer slides)."""
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"GGUF {arch}: attention.sliding_window_pattern lists {len(pattern)} layers.")
        flags = [bool(p) for p in pattern]
    else:
        n = pattern if pattern is not None else _WINDOW_PATTERN.get(arch, 0)
        flags = [n == 0 or i % n < n - 1 for i in range(layers)]
    return ["sliding_attention" if f else "full_attention" for f in flags]


def _hf_name(gguf_name: str, arch: str) -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4:
        part = _ARCH_LAYER_NAMES.get(arch, {}).get(parts[2]) or _LAYER_NAMES.get(parts[2])
        return f"model.layers.{parts[1]}.{part}.{parts[3]}" if part else None
    return _NAMES.get(gguf_name)


def _unpermute_order(rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's reordering of Q/K rows (interleaved RoPE) back to the
    rotate-half layout: row i of the result is row order[i] of the file's tensor."""
    return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(rows)


def _weights(
    reader: gguf_file.GGUFFile, arch: str, config: ModelConfig, keep_quantized: bool
) -> Iterator[tuple[str, Weight]]:
    unknown = [
        t.name for t in reader.tensors if t.name not in _CONFIG_TENSORS and _hf_name(t.name, arch) is None
    ]
    if unknown:
        raise ValueError(f"GGUF {arch}: tensors {unknown[:5]} are not supported.")
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, arch)
        if name is None:
            continue
        stacked = name.endswith(_STACKED_EXPERTS)
        if stacked:  # [E, rows, cols], each expert's as a tensor of its own (quantized ones kept so)
            prefix, projection, _ = name.rsplit(".", 2)
            for expert in range(tensor.data.shape[0]):
                yield f"{prefix}.{expert}.{projection}.weight", _expert(tensor, expert, keep_quantized)
            continue
        weight = _tensor(tensor, keep_quantized and name.endswith(".weight"))
        if arch in _OFFSET_NORMS and name.endswith("norm.weight"):
            weight = weight - 1.0  # the model adds it back (exactly, for sums of at least 0.5)
        heads = None
        if arch in _PERMUTED and name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = config.num_attention_heads
        elif arch in _PERMUTED and name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = config.num_key_value_heads
        if heads is not None:
            order = _unpermute_order(weight.shape[0], heads)
            if isinstance(weight, torch.Tensor):
                weight = weight[torch.from_numpy(order)]
            else:
                weight = gguf_quant.permute_rows(weight, order)
        if ".qkv_proj." in name or ".gate_up_proj." in name:
            yield from _split_rows(name, weight, config)
        else:
            yield name, weight


def _split_rows(name: str, weight: Weight, config: ModelConfig) -> Iterator[tuple[str, Weight]]:
    """Phi-3's fused q/k/v and gate/up tensors as their parts, quantized ones kept quantized."""
    if ".qkv_proj." in name:
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        parts = [
            ("qkv_proj", "q_proj", 0, q),
            ("qkv_proj", "k_proj", q, kv),
            ("qkv_proj", "v_proj", q + kv, kv),
        ]
    else:
        half = config.intermediate_size
        parts = [("gate_up_proj", "gate_proj", 0, half), ("gate_up_proj", "up_proj", half, half)]
    for fused, part, start, rows in parts:
        if isinstance(weight, torch.Tensor):
            yield name.replace(fused, part), weight[start : start + rows]
        else:
            yield name.replace(fused, part), gguf_quant.permute_rows(weight, np.arange(start, start + rows))


def _expert(tensor: gguf_file.GGUFTensor, expert: int, keep_quantized: bool) -> Weight:
    """One expert's [rows, cols] of a stacked expert tensor: quantized blocks kept where asked and supported
    (the experts then run int8 where they all are, `models.moe.FusedExperts`), else dense fp32."""
    qtype = tensor.tensor_type
    if keep_quantized and qtype in gguf_quant.CONVERTERS:
        return gguf_quant.convert(tensor.data[expert], qtype)
    array = gguf.dequantize(tensor.data[expert], qtype)
    return torch.from_numpy(
        np.array(array, dtype=np.float32).reshape(int(tensor.shape[1]), int(tensor.shape[0]))
    )


def _tensor(tensor: gguf_file.GGUFTensor, keep_quantized: bool) -> Weight:
    """One tensor in the engine's form: dense fp32, or quantized (`gguf_quant`) where asked and supported."""
    qtype = tensor.tensor_type
    if keep_quantized and qtype in gguf_quant.CONVERTERS:
        return gguf_quant.convert(tensor.data, qtype)
    if keep_quantized and qtype not in DENSE_TYPES:
        logger.info(
            "%s is %s, which the engine does not keep quantized (%s): dequantized to dense",
            tensor.name,
            qtype.name,
            ", ".join(t.name for t in gguf_quant.CONVERTERS),
        )
    array = gguf.dequantize(tensor.data, qtype)
    # GGUF lists dims fastest-first; numpy data is already [rows, cols] like torch's [out, in].
    array = array.reshape([int(d) for d in reversed(tensor.shape)])
    return torch.from_numpy(np.array(array, dtype=np.float32))  # a writable copy of the mmap


def _tokenizer(reader: gguf_file.GGUFFile) -> Tokenizer:
    def field(name: str, default=None):
        return reader.fields.get(f"tokenizer.ggml.{name}", default)

    kind = field("model")
    if kind not in ("gpt2", "llama"):
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported "
            "(byte-level BPE 'gpt2' and SentencePiece 'llama')."
        )
    tokens: list[str] = field("tokens")
    token_types: list[int] = field("token_type", [1] * len(tokens))
    vocab = {token: i for i, token in enumerate(tokens)}
    if kind == "gpt2":
        backend = _byte_level_bpe(vocab, field)
    else:
        backend = _sentencepiece_bpe(tokens, token_types, field)
    # Control (3) and user-defined (4) tokens are matched whole, before BPE, like in the original tokenizer.
    backend.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(token_types) if t == 3]
    )
    backend.add_tokens(
        [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(token_types) if t == 4]
    )
    eos = field("eos_token_id")
    eos_ids = [eos] if eos is not None else []
    # Chat models end a turn with their template's end token; treat it as EOS too.
    for end_token in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
        token_id = vocab.get(end_token)
        if token_id is not None and token_id not in eos_ids:
            eos_ids.append(token_id)
    return Tokenizer(
        backend,
        eos_token_ids=eos_ids,
        bos_token_id=field("bos_token_id"),
        # llama.cpp's defaults where the file is silent: a BOS for SentencePiece vocabularies, none for BPE.
        add_bos_token=bool(field("add_bos_token", kind == "llama")),
        chat_template=reader.fields.get("tokenizer.chat_template"),
    )


def _byte_level_bpe(vocab: dict[str, int], field) -> HFTokenizer:
    merges = [tuple(m.split(" ", 1)) for m in field("merges", [])]
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False, fuse_unk=False))
    pre = field("pre", "default")
    split = _QWEN2_SPLIT if pre == "qwen2" else _GPT2_SPLIT
    steps = [pre_tokenizers.Digits(individual_digits=True)] if pre in _SPLIT_DIGITS else []
    steps += [
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], token_types: list[int], field) -> HFTokenizer:
    """A SentencePiece BPE vocabulary (pieces, scores, types; no merges) as a `tokenizers` BPE that encodes
    as SentencePiece and llama.cpp do: the whole text, spaces as U+2581, starts with one where the file says
    `add_space_prefix`; the adjacent pair whose joined piece scores highest merges first, so the merges are
    every split of a normal piece into two pieces, ranked by the joined piece's score; characters no piece
    covers fall back to their UTF-8 bytes (<0xNN>)."""
    scores: list[float] = field("scores", [0.0] * len(tokens))
    vocab = {token: i for i, token in enumerate(tokens)}
    ranked = sorted(
        (i for i, t in enumerate(token_types) if t == _NORMAL and len(tokens[i]) > 1),
        key=lambda i: (-scores[i], i),
    )
    merges = []
    for i in ranked:
        piece = tokens[i]
        merges += [
            (piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab
        ]
    unk = field("unknown_token_id")
    backend = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=tokens[unk] if unk is not None else None,
            byte_fallback=_BYTE in token_types,
            fuse_unk=True,
            ignore_merges=False,
        )
    )
    replace = normalizers.Replace(" ", _SPACE)
    space_prefix = bool(field("add_space_prefix", True))
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend(_SPACE), replace]) if space_prefix else replace
    )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend
