"""GGUF files: architecture from the metadata, weights kept in their quantized blocks (`gguf_quant`) or
dequantized by the `gguf` package, and a byte-level BPE tokenizer rebuilt from the vocabulary and
merges stored in the file."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from inference_engine.config import resolve_quantization
from inference_engine.model_loader import LoadedModel, ModelConfig, Weight, gguf_file, gguf_quant
from inference_engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DENSE_TYPES = (
    gguf.GGMLQuantizationType.F32,
    gguf.GGMLQuantizationType.F16,
    gguf.GGMLQuantizationType.BF16,
)

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# GGUF tensor name -> Hugging Face name, with {i} for the layer index.
_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}

# Pre-tokenizer splits per llama.cpp's `tokenizer.ggml.pre` names (regexes as in the original tokenizers).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_DIGITS = {"smollm", "starcoder", "refact", "command-r", "codeshell"}


def load(path: Path, quantization: str | None = None) -> LoadedModel:
    """`quantization`: None or "gguf" keeps quantized tensors quantized; "none" and "int8" dequantize
    them (int8 requantizes the dense linear weights afterwards, in the model runner)."""
    reader = gguf_file.read(path)
    quantized = any(t.tensor_type not in DENSE_TYPES for t in reader.tensors)
    method = resolve_quantization(quantization, "gguf" if quantized else None, f"the GGUF file {path.name}")
    meta = {name: value for name, value in reader.fields.items() if not name.startswith("tokenizer.ggml.")}
    arch = meta["general.architecture"]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {sorted(SUPPORTED_ARCHITECTURES)})."
        )
    tokenizer = _tokenizer(reader)
    config = _config(reader, meta, arch, tokenizer)
    name = meta.get("general.name") or path.stem
    weights = _weights(reader, config, keep_quantized=method == "gguf")
    return LoadedModel(name=name, config=config, tokenizer=tokenizer, weights=weights, quantization=method)


def _config(reader: gguf_file.GGUFFile, meta: dict, arch: str, tokenizer: Tokenizer) -> ModelConfig:
    def get(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    hidden = get("embedding_length")
    heads = get("attention.head_count")
    tensor_names = {t.name for t in reader.tensors}
    rope_scaling = None
    if get("rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    return ModelConfig(
        architecture=SUPPORTED_ARCHITECTURES[arch],
        vocab_size=get("vocab_size") or tokenizer.vocab_size,
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv", heads),
        head_dim=get("attention.key_length") or hidden // heads,
        max_position_embeddings=get("context_length", 2048),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=get("rope.freq_base", 10000.0),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        eos_token_ids=tokenizer.eos_token_ids,
    )


def _hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        layer = parts[1]
        template = _NAMES.get(".".join(["blk", "{i}", *parts[2:]]))
        return template.format(i=layer) if template else None
    return _NAMES.get(gguf_name)


def _unpermute_order(rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's reordering of Q/K rows (interleaved RoPE) back to the
    rotate-half layout: row i of the result is row order[i] of the file's tensor."""
    return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(rows)


def _weights(
    reader: gguf_file.GGUFFile, config: ModelConfig, keep_quantized: bool
) -> Iterator[tuple[str, Weight]]:
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            continue
        weight = _tensor(tensor, keep_quantized and name.endswith(".weight"))
        heads = None
        if config.architecture == "LlamaForCausalLM" and name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = config.num_attention_heads
        elif config.architecture == "LlamaForCausalLM" and name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = config.num_key_value_heads
        if heads is not None:
            order = _unpermute_order(weight.shape[0], heads)
            if isinstance(weight, torch.Tensor):
                weight = weight[torch.from_numpy(order)]
            else:
                weight = gguf_quant.permute_rows(weight, order)
        yield name, weight


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
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2').")
    tokens: list[str] = field("tokens")
    token_types: list[int] = field("token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in field("merges", [])]
    vocab = {token: i for i, token in enumerate(tokens)}
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
    for end_token in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
        token_id = vocab.get(end_token)
        if token_id is not None and token_id not in eos_ids:
            eos_ids.append(token_id)
    return Tokenizer(
        backend,
        eos_token_ids=eos_ids,
        bos_token_id=field("bos_token_id"),
        add_bos_token=bool(field("add_bos_token", False)),
        chat_template=reader.fields.get("tokenizer.chat_template"),
    )
