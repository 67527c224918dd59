"""A Qwen3-MoE-shaped GGUF file with random weights (Qwen3-30B-A3B scaled down: 64 experts, top-8), written
once under ~/.cache/llmserve by the `gguf` package with the names and metadata llama.cpp's converter gives a
`qwen3moe` file, and the bundled model's tokenizer. Weights are drawn directly in the stored type: a Q8_0
block is 32 random int8 values and a random fp16 scale, so a file of gigabytes takes seconds, not a
dequantize-quantize round trip. The router and the norms stay fp32, as the converter keeps them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np

from benchmarks.gguf_files import CACHE
from inference_engine.model_loader import default_model_path

Q8_0 = gguf.GGMLQuantizationType.Q8_0
BF16 = gguf.GGMLQuantizationType.BF16
F32 = gguf.GGMLQuantizationType.F32
_BLOCK = 32  # Q8_0 values per block (then an fp16 scale: 34 bytes)
_UNIFORM_STD = 127 / 3**0.5  # the standard deviation of an int8 drawn uniformly from [-127, 127]


@dataclasses.dataclass(frozen=True)
class MoeShape:
    hidden: int = 2048
    layers: int = 12
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 128
    experts: int = 64
    top_k: int = 8
    expert_inter: int = 384
    vocab: int = 49152  # the bundled tokenizer's

    def tensors(self) -> dict[str, tuple[tuple[int, ...], float]]:
        """GGUF name: (numpy shape, standard deviation; 0 for a norm of ones). Matrices are [out, in]."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        out = {
            "token_embd.weight": ((self.vocab, h), 1.0),
            "output_norm.weight": ((h,), 0.0),
            "output.weight": ((self.vocab, h), h**-0.5),
        }
        for i in range(self.layers):
            out |= {
                f"blk.{i}.attn_norm.weight": ((h,), 0.0),
                f"blk.{i}.attn_q.weight": ((q, h), h**-0.5),
                f"blk.{i}.attn_k.weight": ((kv, h), h**-0.5),
                f"blk.{i}.attn_v.weight": ((kv, h), h**-0.5),
                f"blk.{i}.attn_output.weight": ((h, q), q**-0.5),
                f"blk.{i}.attn_q_norm.weight": ((self.head_dim,), 0.0),
                f"blk.{i}.attn_k_norm.weight": ((self.head_dim,), 0.0),
                f"blk.{i}.ffn_norm.weight": ((h,), 0.0),
                f"blk.{i}.ffn_gate_inp.weight": ((self.experts, h), h**-0.5),
                f"blk.{i}.ffn_gate_exps.weight": ((self.experts, self.expert_inter, h), h**-0.5),
                f"blk.{i}.ffn_up_exps.weight": ((self.experts, self.expert_inter, h), h**-0.5),
                f"blk.{i}.ffn_down_exps.weight": (
                    (self.experts, h, self.expert_inter),
                    self.expert_inter**-0.5,
                ),
            }
        return out

    def parameters(self, active: bool = False) -> dict[str, int]:
        """Parameters by kind: the experts, the embedding, everything else a decode step reads (attention,
        norms, router, LM head); with `active`, the experts a token runs (top-k of them)."""
        counts = {"experts": 0, "embedding": 0, "other": 0}
        for name, (shape, _) in self.tensors().items():
            n = int(np.prod(shape))
            if "_exps" in name:
                counts["experts"] += n * self.top_k // self.experts if active else n
            elif name == "token_embd.weight":
                counts["embedding"] += self.hidden if active else n  # a token reads its own row
            else:
                counts["other"] += n
        return counts

    def name(self) -> str:
        return f"qwen3moe-h{self.hidden}-l{self.layers}-e{self.experts}x{self.expert_inter}-top{self.top_k}"


def _stored_type(name: str, shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType):
    return F32 if len(shape) == 1 or "ffn_gate_inp" in name else qtype


def _draw(rng: np.random.Generator, shape: tuple[int, ...], std: float, qtype) -> np.ndarray:
    """Random values of standard deviation `std` in the stored form of `qtype` (ones where std is 0)."""
    if std == 0.0:
        return np.ones(shape, dtype=np.float32)
    if qtype == F32:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    if qtype == BF16:
        values = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        return (values.view(np.uint32) >> 16).astype(np.uint16)
    blocks = (*shape[:-1], shape[-1] // _BLOCK)
    scale = (rng.uniform(0.5, 1.5, blocks) * (std / _UNIFORM_STD)).astype(np.float16)
    quants = rng.integers(-127, 128, (*blocks, _BLOCK), dtype=np.int8)
    return np.concatenate([scale[..., None].view(np.uint8), quants.view(np.uint8)], axis=-1).reshape(
        *shape[:-1], -1
    )


def random_qwen3_moe(shape: MoeShape = MoeShape(), qtype: gguf.GGMLQuantizationType = Q8_0) -> Path:
    """The file for `shape` with its matrices in `qtype` (Q8_0 or BF16), written once."""
    path = CACHE / f"{shape.name()}.{qtype.name}.gguf"
    if path.exists():
        return path
    scratch = path.with_suffix(".partial")
    scratch.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(scratch), arch="qwen3moe")
    tokenizer = gguf.GGUFReader(str(default_model_path()))
    for name, field in tokenizer.fields.items():
        if name.startswith("tokenizer."):
            sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type)
    writer.add_name(shape.name())
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{qtype.name}"])
    writer.add_context_length(4096)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.expert_inter * shape.top_k)
    writer.add_expert_feed_forward_length(shape.expert_inter)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(shape.experts)
    writer.add_expert_used_count(shape.top_k)
    tensors = shape.tensors()
    for name, (dims, _) in tensors.items():
        stored = _stored_type(name, dims, qtype)
        size = gguf.GGML_QUANT_SIZES[stored]
        nbytes = int(np.prod(dims)) // size[0] * size[1]
        raw_shape = (*dims[:-1], dims[-1] // size[0] * size[1]) if stored == Q8_0 else dims
        dtype = {F32: np.float32, BF16: np.uint16, Q8_0: np.uint8}[stored]
        writer.add_tensor_info(name, raw_shape, np.dtype(dtype), nbytes, raw_dtype=stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, (dims, std) in tensors.items():
        writer.write_tensor_data(_draw(rng, dims, std, _stored_type(name, dims, qtype)))
    writer.close()
    scratch.replace(path)
    return path


if __name__ == "__main__":
    print(random_qwen3_moe())
