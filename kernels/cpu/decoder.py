"""A Llama-family decoder's forward pass for a step of bf16 tokens in one native call (`csrc/decoder.c`).

Decode steps, speculative verification and prompts of up to a few hundred tokens run through every layer
here; through Python that is some 300 calls a step, each converting arguments and allocating outputs,
which at batch 1 cost as much as the attention. `NativeDecoder` describes the model once (packed weights,
norms, caches, rotary tables), allocates its scratch once, and runs all layers in one call, through the
same kernels in the same order as the layer-by-layer path, so both give the same bits. Given the LM head
and the embeddings (`attach_head`), `generate` runs several decode steps in one call, each step's tokens
chosen as the sampler chooses them.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from llmserve_kernels.cpu._build import function, i32, ptr
from llmserve_kernels.cpu.linear import (
    PackedLinear,
    _amx_rows,
    _BF16Tiles,
    _DequantizedMatmul,
    _fma_rows,
    _QuantTiles,
)
from llmserve_kernels.cpu.sampling import _threads as sampling_threads

BF16 = torch.bfloat16
_KINDS = {_BF16Tiles: 1, _QuantTiles: 2}
_MAX_ROWS = 1 << 16


class _Linear(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int),
        ("weight", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("out", ctypes.c_int),
        ("native_rows", ctypes.c_int),
        ("fma_rows", ctypes.c_int),
        ("amx_rows", ctypes.c_int),
    ]


class _Rows(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("weight", ctypes.c_void_p)]


class _Sampling(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_void_p)
        for name in ("temperature", "top_k", "top_p", "min_p", "draft", "uniforms", "accepted")
    ]


class _Extend(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int) for name in ("batch", "lo", "hi", "max_blocks")),
        *((name, ctypes.c_void_p) for name in ("query_start_loc", "seq_lens", "tables")),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("qk_norm_whole", ctypes.c_int),
        ("post_attn_norm", ctypes.c_void_p),
        ("post_mlp_norm", ctypes.c_void_p),
        ("window", ctypes.c_int),
        ("softcap", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("gelu", ctypes.c_int),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("rotary_dim", ctypes.c_int),
    ]


class _Decoder(ctypes.Structure):
    _fields_ = [
        *(
            (name, ctypes.c_int)
            for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "inter", "bs")
        ),
        ("num_slots", ctypes.c_long),
        ("eps", ctypes.c_float),
        ("final_norm", ctypes.c_void_p),
        ("layer", ctypes.POINTER(_Layer)),
    ]


@dataclass
class DecoderLayer:
    """One layer's weights, caches and variants. With every variant at its default it is a Llama layer:
    x + attn(norm(x)), then that + mlp(norm(that)). Every norm is a bf16 RMSNorm with the given weight,
    rounded as `fused.rms_norm` rounds (the caller folds Gemma's 1 + w into the weight)."""

    input_norm: torch.Tensor | None  # [hidden] before attention; None: attention reads the stream (OLMo 2)
    post_norm: torch.Tensor | None  # [hidden] before the MLP; None: the MLP reads the stream (OLMo 2)
    qkv: PackedLinear
    qkv_bias: torch.Tensor | None
    o: PackedLinear
    gate_up: PackedLinear
    down: PackedLinear
    k_cache: torch.Tensor  # [blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor
    # RMSNorms of the queries and keys, before the rotation: over each head ([head_dim] weights: Qwen3,
    # Gemma 3) or, with qk_norm_whole, over the whole q and k projections ([heads * head_dim] and
    # [kv_heads * head_dim]: OLMo 2). None: none.
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qk_norm_whole: bool = False
    # RMSNorms of the attention's and the MLP's outputs, before they join the stream (Gemma 2/3's
    # post_attention_layernorm and post_feedforward_layernorm, OLMo 2's two norms). None: none.
    post_attn_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None
    window: int = 0  # sliding window: a query at position p sees keys p - window + 1..p (0: all)
    softcap: float = 0.0  # attention scores become softcap * tanh(score / softcap) (0: none)
    scale: float | None = None  # attention scale; None: head_dim ** -0.5
    gelu: bool = False  # GELU-tanh instead of SiLU in the gated MLP (Gemma)
    # This layer's rotary tables, [max_position, rotary_dim] fp32 laid out as RotaryEmbedding's (Gemma 3's
    # sliding layers have their own base); None: the decoder's.
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    # The features of each head that turn, the first ones (partial rotation, Phi-3/4-mini); None: all.
    # The rotary tables are [max_position, rotary_dim].
    rotary_dim: int | None = None


def native_rows(packed: PackedLinear) -> int:
    """How many rows the decoder can take through this weight as `linear` would (0: none, or not as the
    decoder passes them): its native routine's rows, and for a quantized weight also the rows beyond them that
    go through its dequantized tiles (`_DequantizedMatmul`), where the decoder's inputs need no permutation
    or padding for that."""
    routine = packed.small
    if type(routine) not in _KINDS or getattr(routine, "k_even", None) not in (None, packed.in_features):
        return 0
    rows = packed.small_rows
    if isinstance(packed.large, _DequantizedMatmul):
        rows = max(rows, packed.large.rows_taken_as_given())
    return int(min(rows, _MAX_ROWS))


@dataclass
class Extend:
    """A step's sequences (`AttentionMetadata`'s) and the new-token counts, lo to hi inclusive, of those whose
    attention goes through the extend kernel."""

    query_start_loc: torch.Tensor  # [batch + 1]
    seq_lens: torch.Tensor  # [batch]
    block_tables: torch.Tensor  # [batch, max_blocks]
    lo: int
    hi: int

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.query_start_loc, self.seq_lens, self.block_tables


class NativeDecoder:
    def __init__(
        self,
        layers: list[DecoderLayer],
        *,
        heads: int,
        head_dim: int,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
        final_norm: torch.Tensor,
        max_rows: int,
    ) -> None:
        first = layers[0]
        self.hidden, self.kv_heads = first.qkv.in_features, first.k_cache.shape[2]
        self.heads, self.head_dim, self.max_rows = heads, head_dim, max_rows
        self.intermediate = first.down.in_features
        self._keep: list = [
            final_norm,
            layers,
        ]  # the C side holds their weights', caches' and norms' addresses
        self._layers = (_Layer * len(layers))(*(self._layer(layer, cos, sin) for layer in layers))
        self.desc = _Decoder(
            len(layers),
            self.hidden,
            heads,
            self.kv_heads,
            head_dim,
            self.intermediate,
            first.k_cache.shape[1],
            first.k_cache.shape[0] * first.k_cache.shape[1],
            eps,
            final_norm.data_ptr(),
            self._layers,
        )
        rows, q_width = max_rows, heads * head_dim
        qkv_width = q_width + 2 * self.kv_heads * head_dim
        self.scratch = [
            torch.empty(rows, width, dtype=BF16)
            for width in (
                self.hidden,
                self.hidden,
                qkv_width,
                q_width,
                2 * self.intermediate,
                self.intermediate,
            )
        ]
        self.fn = function(
            "decoder_forward", i32, ptr, ptr, i32, ptr, ptr, ptr, i32, ptr, ptr, *[ptr] * 6, i32
        )
        self.generate_fn = function(
            "decoder_generate", i32, *[ptr] * 5, i32, i32, ptr, ptr, ptr, i32, ptr, *[ptr] * 9, i32, i32
        )
        self.generate_rows = 0  # sequences `generate` takes at once; set by `attach_head`

    def _op(self, packed: PackedLinear, bias: torch.Tensor | None = None) -> _Linear:
        if bias is not None:
            self._keep.append(bias)
        weight = packed.small
        return _Linear(
            _KINDS[type(weight)],
            weight.desc_ptr,
            None if bias is None else bias.data_ptr(),
            packed.out_features,
            int(min(packed.small_rows, _MAX_ROWS)),
            _fma_rows(),
            _amx_rows(),
        )

    def _address(
        self, t: torch.Tensor | None, dtype: torch.dtype = BF16, numel: int | None = None
    ) -> int | None:
        """Where a tensor the decoder reads lies (kept alive with the decoder); None stays None."""
        if t is None:
            return None
        if t.dtype != dtype or not t.is_contiguous() or (numel is not None and t.numel() != numel):
            raise ValueError(
                f"the native decoder takes contiguous {dtype} of {numel} elements, got {t.dtype} {t.shape}"
            )
        self._keep.append(t)
        return t.data_ptr()

    def _layer(self, layer: DecoderLayer, cos: torch.Tensor, sin: torch.Tensor) -> _Layer:
        hidden, d = self.hidden, self.head_dim
        q_width, k_width = (self.heads * d, self.kv_heads * d) if layer.qk_norm_whole else (d, d)
        cos = cos if layer.cos is None else layer.cos
        sin = sin if layer.sin is None else layer.sin
        rotary_dim = d if layer.rotary_dim is None else layer.rotary_dim
        if not 0 < rotary_dim <= d or rotary_dim % 2 or cos.shape != sin.shape or cos.shape[-1] != rotary_dim:
            raise ValueError(
                f"rotary tables must be [positions, {rotary_dim}] (rotary_dim {rotary_dim}, head_dim {d}), "
                f"got {tuple(cos.shape)} and {tuple(sin.shape)}"
            )
        return _Layer(
            self._address(layer.input_norm, numel=hidden),
            self._address(layer.post_norm, numel=hidden),
            self._op(layer.qkv, layer.qkv_bias),
            self._op(layer.o),
            self._op(layer.gate_up),
            self._op(layer.down),
            layer.k_cache.data_ptr(),
            layer.v_cache.data_ptr(),
            self._address(layer.q_norm, numel=q_width),
            self._address(layer.k_norm, numel=k_width),
            int(layer.qk_norm_whole),
            self._address(layer.post_attn_norm, numel=hidden),
            self._address(layer.post_mlp_norm, numel=hidden),
            layer.window,
            layer.softcap,
            d**-0.5 if layer.scale is None else layer.scale,
            int(layer.gelu),
            self._address(cos, torch.float32),
            self._address(sin, torch.float32),
            rotary_dim,
        )

    def attach_head(self, head: PackedLinear, embed: PackedLinear) -> None:
        """The LM head and the embeddings `generate` runs through, where both are on native kernels as
        `linear` and `embedding` run them; `generate_rows` then says how many sequences it takes at once."""
        rows = getattr(embed.rows, "__self__", None)
        if (
            type(rows) not in _KINDS
            or getattr(rows, "perm", None) is not None
            or embed.in_features != self.hidden
        ):
            return
        self._head, self._embed = self._op(head), _Rows(_KINDS[type(rows)], rows.desc_ptr)
        self.vocab = head.out_features
        self.generate_rows = min(self.max_rows, native_rows(head))

    def forward(
        self,
        hidden: torch.Tensor,  # [m, hidden] bf16 embeddings, contiguous; overwritten with the final norm
        positions: torch.Tensor,  # [m] int64
        slots: torch.Tensor,  # [m] int64 cache slot of each token
        tables: torch.Tensor,  # [m, max_blocks] int32 block table of each token's sequence
        lens: torch.Tensor,  # [m] int32 tokens each token attends to (itself included)
        extend: Extend | None = None,
    ) -> torch.Tensor:
        """`extend`: the sequences whose new tokens attend through the extend kernel, as the layer path
        sends them there (every other token is a query of the decode kernel)."""
        m = hidden.shape[0]
        if m > self.max_rows:
            raise ValueError(f"the native decoder takes at most {self.max_rows} tokens, got {m}.")
        tables = tables.to(torch.int32).contiguous()
        chunks = None
        if extend is not None:
            keep = [t.to(torch.int32).contiguous() for t in extend.tensors()]
            batch, max_blocks = keep[2].shape
            chunks = _Extend(batch, extend.lo, extend.hi, max_blocks, *(t.data_ptr() for t in keep))
        status = self.fn(
            ctypes.addressof(self.desc),
            hidden.data_ptr(),
            m,
            positions.data_ptr(),
            slots.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            lens.to(torch.int32).contiguous().data_ptr(),
            None if chunks is None else ctypes.addressof(chunks),
            *(t.data_ptr() for t in self.scratch),
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"native decoder failed with status {status} (a cache slot out of range?)")
        return hidden

    def generate(
        self,
        hidden: torch.Tensor,  # [m, hidden] bf16 embeddings of the first step's tokens; overwritten
        positions: torch.Tensor,  # [steps, m] int64
        slots: torch.Tensor,  # [steps, m] int64
        tables: torch.Tensor,  # [m, max_blocks] int32 block table of each sequence
        lens: torch.Tensor,  # [steps, m] int32
        sampling: tuple[torch.Tensor, ...] | None = None,
    ) -> torch.Tensor:
        """Decode steps of m sequences in one call (csrc/decoder.c: decoder_generate); returns each step's
        tokens, [steps, m] int64. `sampling`: None where every sequence is greedy, else each sequence's
        temperature (f32, 0 for greedy), top_k (i32), top_p and min_p (f32) as `sampling.sample` takes them,
        and every step's uniforms, [steps, m, 2] f64."""
        steps, m = positions.shape
        if not 0 < m <= self.generate_rows:
            raise ValueError(f"generate takes 1 to {self.generate_rows} sequences, got {m}.")
        tables = tables.to(torch.int32).contiguous()
        tokens = torch.empty(steps, m, dtype=torch.int64)
        logits, wide = torch.empty(m, self.vocab, dtype=BF16), torch.empty(m, self.vocab)
        positions, slots = positions.contiguous(), slots.contiguous()
        lens = lens.to(torch.int32).contiguous()
        draws = None
        if sampling is not None:
            *per_row, uniforms = sampling
            if uniforms.shape != (steps, m, 2) or uniforms.dtype != torch.float64:
                raise ValueError(f"uniforms must be [{steps}, {m}, 2] float64.")
            keep = [t.contiguous() for t in per_row]
            keep += [torch.full((m,), -1, dtype=torch.int64), uniforms.contiguous()]
            keep.append(torch.empty(m, dtype=torch.bool))
            draws = _Sampling(*(t.data_ptr() for t in keep))
        status = self.generate_fn(
            ctypes.addressof(self.desc),
            ctypes.addressof(self._head),
            ctypes.addressof(self._embed),
            None if draws is None else ctypes.addressof(draws),
            hidden.data_ptr(),
            m,
            steps,
            positions.data_ptr(),
            slots.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            lens.data_ptr(),
            tokens.data_ptr(),
            logits.data_ptr(),
            wide.data_ptr(),
            *(t.data_ptr() for t in self.scratch),
            torch.get_num_threads(),
            sampling_threads(m, self.vocab),
        )
        if status != 0:
            raise RuntimeError(f"native decoder failed with status {status} (a cache slot out of range?)")
        return tokens
