"""The native decoder's layer variants (kernels/cpu/decoder.py: DecoderLayer) against a PyTorch reference of
such layers on random weights: q/k RMSNorms per head (Qwen3, Gemma 3) and over the whole projections (OLMo 2),
norms on the sublayers' outputs and none before them (Gemma's sandwich, OLMo 2), GELU-tanh, per-layer sliding
windows, soft-capping, attention scales and rotary tables. The reference rounds to bf16 where the decoder
does, the attention's probabilities included (`_probabilities`), so only the summation order of the matmuls
and of the attention's scores, and the kernels' exp, separate them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from llmserve_kernels.cpu import available
from llmserve_kernels.cpu.decoder import DecoderLayer, Extend, NativeDecoder
from llmserve_kernels.cpu.linear import PackedLinear, _BF16Tiles, native_bf16
from llmserve_kernels.reference import rotary_embedding_ref

BF16, F32 = torch.bfloat16, torch.float32
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 128, 4, 2, 64, 192, 2
BLOCK, EPS, TOKENS, MORE = 16, 1e-6, 40, 3

pytestmark = pytest.mark.skipif(
    not available(), reason="no C compiler: the native decoder does not exist here"
)


def _bf(x: torch.Tensor) -> torch.Tensor:
    return x.to(BF16).float()


def _rope(base: float, dim: int = HEAD_DIM, positions: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as RotaryEmbedding lays them out (sin's first half negated)."""
    inv_freq = base ** -(torch.arange(0, dim, 2, dtype=F32) / dim)
    angles = torch.arange(positions, dtype=F32)[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    sin = emb.sin()
    sin[:, : dim // 2] *= -1
    return emb.cos().contiguous(), sin.contiguous()


def _packed(weight: torch.Tensor) -> PackedLinear:
    tiles = _BF16Tiles(weight, portable=not native_bf16())
    n, k = weight.shape
    return PackedLinear(n, k, tiles, tiles, math.inf, tiles.rows, (tiles.tiles,))


def _layers(gen: torch.Generator, variants: list[dict]) -> list[dict]:
    """Random bf16 weights of each layer, with its variants' norms and options."""

    def matrix(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=gen) * k**-0.5).to(BF16)

    def norm(n: int) -> torch.Tensor:
        return (1 + 0.2 * torch.randn(n, generator=gen)).to(BF16)

    layers = []
    qkv_width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    for options in variants:
        layer = {
            "input_norm": norm(HIDDEN),
            "post_norm": norm(HIDDEN),
            "qkv": matrix(qkv_width, HIDDEN) * 3,  # sharper attention: windows and caps change more
            "qkv_bias": (0.1 * torch.randn(qkv_width, generator=gen)).to(BF16),
            "o": matrix(HIDDEN, HEADS * HEAD_DIM),
            "gate_up": matrix(2 * INTER, HIDDEN),
            "down": matrix(HIDDEN, INTER),
        }
        whole = options.get("qk_norm_whole", False)
        for name in ("q_norm", "k_norm"):
            if options.get(name):
                layer[name] = norm(
                    (HEADS if name == "q_norm" else KV_HEADS) * HEAD_DIM if whole else HEAD_DIM
                )
        for name in ("post_attn_norm", "post_mlp_norm"):
            if options.get(name):
                layer[name] = norm(HIDDEN)
        for name in ("input_norm", "post_norm"):
            if options.get(name) is False:
                layer[name] = None
        layer.update({k: v for k, v in options.items() if not k.endswith("norm")})
        layers.append(layer)
    return layers


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rms_norm_bf16's rounding: the normalised value, then its product with the weight, each to bf16."""
    return _bf(_bf(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)) * weight.float())


# The attention kernels' vdpbf16ps and AMX routines (built where the CPU has AVX512-BF16) round probabilities.
BF16_PROBABILITIES = "avx512_bf16" in Path("/proc/cpuinfo").read_text().split()
# Keys the attention kernels' online softmax takes a step here: the decode kernel's vdpbf16ps routine a cache
# block (its AMX route, from 256 keys on, is not reached), the extend kernel's vdpbf16ps routine 64
# (paged_extend.c: STEP_KEYS); its AMX strips take all keys at once, the same here: its queries see at most
# TOKENS < 64 keys.
DECODE_KEYS, EXTEND_KEYS = BLOCK, 64


def _probabilities(scores: torch.Tensor, step: int) -> torch.Tensor:
    """softmax over the last dimension (-inf: not seen) as the attention kernels compute it for P @ V. With
    AVX512-BF16 they round each unnormalised probability exp(s - m) to bf16, m the online softmax's running
    maximum over the steps of `step` keys up to the key's own, and divide by the sum of the unrounded ones
    (paged_decode.c: attend_block; paged_extend.c). The AVX2 and plain routines keep them fp32."""
    if not BF16_PROBABILITIES:
        return scores.softmax(-1)
    keys = scores.shape[-1]
    padded = torch.nn.functional.pad(scores, (0, -keys % step), value=float("-inf"))
    running = padded.unflatten(-1, (-1, step)).amax(-1).cummax(-1).values
    at = running.repeat_interleave(step, -1)[..., :keys]
    top, seen = scores.amax(-1, keepdim=True), scores > float("-inf")
    weights = torch.where(seen, _bf((scores - at).exp()) * (at - top).exp(), 0.0)
    return weights / torch.where(seen, (scores - top).exp(), 0.0).sum(-1, keepdim=True)


def _reference(
    layers: list[dict], embeddings: torch.Tensor, final_norm: torch.Tensor, rope, extend: bool = False
) -> torch.Tensor:
    """The whole sequence through the layers in PyTorch, causal, each token at its index; `extend`: its first
    TOKENS tokens' attention as the extend kernel steps through keys (`_native`), else all as the decode
    kernel's."""
    n = embeddings.shape[0]
    positions = torch.arange(n)
    hidden, residual = embeddings.float(), None
    for layer in layers:
        residual = hidden if residual is None else _bf(hidden + residual)
        x = residual if layer["input_norm"] is None else _rms(residual, layer["input_norm"])
        qkv = _bf(x @ layer["qkv"].float().T + layer["qkv_bias"].float())
        q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=1)
        if layer.get("q_norm") is not None:
            whole = layer.get("qk_norm_whole", False)
            q = _rms(q if whole else q.reshape(n, HEADS, HEAD_DIM), layer["q_norm"]).reshape(n, -1)
            k = _rms(k if whole else k.reshape(n, KV_HEADS, HEAD_DIM), layer["k_norm"]).reshape(n, -1)
        cos, sin = layer.get("cos", rope[0]), layer.get("sin", rope[1])
        turn = layer.get("rotary_dim", HEAD_DIM)  # the first features of each head turn, the rest stay
        q, k = q.reshape(n, HEADS, HEAD_DIM).clone(), k.reshape(n, KV_HEADS, HEAD_DIM).clone()
        q[..., :turn] = rotary_embedding_ref(q[..., :turn].to(BF16), positions, cos, sin).float()
        k[..., :turn] = rotary_embedding_ref(k[..., :turn].to(BF16), positions, cos, sin).float()
        v = v.reshape(n, KV_HEADS, HEAD_DIM)
        group = HEADS // KV_HEADS
        scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, 1)) * layer.get(
            "scale", HEAD_DIM**-0.5
        )
        if layer.get("softcap"):
            scores = layer["softcap"] * torch.tanh(scores / layer["softcap"])
        visible = positions[None, :] <= positions[:, None]
        if layer.get("window"):
            visible &= positions[None, :] > positions[:, None] - layer["window"]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = _probabilities(scores, DECODE_KEYS)
        if extend:
            probs[:, :TOKENS] = _probabilities(scores[:, :TOKENS], EXTEND_KEYS)
        attn = _bf(torch.einsum("hqk,khd->qhd", probs, v.repeat_interleave(group, 1)).reshape(n, -1))
        hidden = _bf(attn @ layer["o"].float().T)
        if layer.get("post_attn_norm") is not None:
            hidden = _rms(hidden, layer["post_attn_norm"])
        residual = _bf(hidden + residual)
        x = residual if layer["post_norm"] is None else _rms(residual, layer["post_norm"])
        gate, up = _bf(x @ layer["gate_up"].float().T).chunk(2, dim=-1)
        act = (
            torch.nn.functional.gelu(gate, approximate="tanh")
            if layer.get("gelu")
            else torch.nn.functional.silu(gate)
        )
        hidden = _bf(_bf(_bf(act) * up) @ layer["down"].float().T)
        if layer.get("post_mlp_norm") is not None:
            hidden = _rms(hidden, layer["post_mlp_norm"])
    return _rms(_bf(hidden + residual), final_norm)


def _native(layers: list[dict], embeddings: torch.Tensor, final_norm: torch.Tensor, rope, extend: bool):
    """The native decoder's outputs for the sequence: its first TOKENS tokens in one step (each a decode
    query, or all through the extend kernel), then the rest in another step."""
    blocks = -(-embeddings.shape[0] // BLOCK)
    decoder_layers = []
    for layer in layers:
        caches = [torch.zeros(blocks + 1, BLOCK, KV_HEADS, HEAD_DIM, dtype=BF16) for _ in range(2)]
        fields = {k: v for k, v in layer.items() if k not in ("qkv", "o", "gate_up", "down")}
        decoder_layers.append(
            DecoderLayer(
                **fields,
                **{name: _packed(layer[name]) for name in ("qkv", "o", "gate_up", "down")},
                k_cache=caches[0],
                v_cache=caches[1],
            )
        )
    decoder = NativeDecoder(
        decoder_layers,
        heads=HEADS,
        head_dim=HEAD_DIM,
        eps=EPS,
        cos=rope[0],
        sin=rope[1],
        final_norm=final_norm,
        max_rows=64,
    )
    table = torch.arange(1, blocks + 1, dtype=torch.int32)  # block 0 never used
    outputs = []
    for lo, hi in ((0, TOKENS), (TOKENS, embeddings.shape[0])):
        positions = torch.arange(lo, hi)
        chunk = None
        if extend and lo == 0:
            starts = torch.tensor([0, hi], dtype=torch.int32)
            chunk = Extend(starts, torch.tensor([hi], dtype=torch.int32), table[None], 1, 1 << 30)
        outputs.append(
            decoder.forward(
                embeddings[lo:hi].clone(),
                positions,
                positions + BLOCK,  # slots from block 1 on
                table.expand(hi - lo, -1),
                (positions + 1).to(torch.int32),
                chunk,
            )
        )
    return torch.cat(outputs).float()


NORMS = {"post_attn_norm": True, "post_mlp_norm": True}
LOCAL = _rope(10_000.0)
PARTIAL = _rope(10_000.0, dim=24)
CASES = {
    "llama": [{}, {}],
    "qwen3": [{"q_norm": True, "k_norm": True}] * 2,
    "gemma2": [
        {**NORMS, "gelu": True, "window": 7, "softcap": 1.5, "scale": 0.1},
        {**NORMS, "gelu": True, "softcap": 1.5, "scale": 0.1},
    ],
    "gemma3": [
        {
            **NORMS,
            "q_norm": True,
            "k_norm": True,
            "gelu": True,
            "window": 20,
            "cos": LOCAL[0],
            "sin": LOCAL[1],
        },
        {**NORMS, "q_norm": True, "k_norm": True, "gelu": True},
    ],
    "olmo2": [
        {
            **NORMS,
            "input_norm": False,
            "post_norm": False,
            "q_norm": True,
            "k_norm": True,
            "qk_norm_whole": True,
        }
    ]
    * 2,
    "mistral": [{"window": 16}] * 2,
    "phi": [{"rotary_dim": 24, "cos": PARTIAL[0], "sin": PARTIAL[1]}] * 2,  # Phi-4-mini's partial rotation
}


def _inputs(gen: torch.Generator, family: str):
    layers = _layers(gen, CASES[family])
    embeddings = torch.randn(TOKENS + MORE, HIDDEN, generator=gen).to(BF16)
    final_norm = (1 + 0.2 * torch.randn(HIDDEN, generator=gen)).to(BF16)
    return layers, embeddings, final_norm, _rope(1_000_000.0)


def _assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    """A few values may round to the other side of a bf16 boundary (the kernels sum scores and products in
    another order and take their own exp), and the second layer's sharp attention spreads one such flip in
    the first: with AVX512-BF16, 12 seeds a case left a mean error up to 0.0024, most cases under 0.0006;
    without the probabilities' rounding the reference is 0.0038 or more away."""
    assert not out.isnan().any()
    error = (out - ref).abs()
    assert error.mean() < 3e-3, f"mean error {error.mean():.4f}"
    torch.testing.assert_close(out, ref, atol=4e-2, rtol=4e-2)


@pytest.mark.parametrize("route", ["decode", "extend"])
@pytest.mark.parametrize("family", list(CASES))
def test_layers_match_the_reference(gen, family, route):
    layers, embeddings, final_norm, rope = _inputs(gen, family)
    extend = route == "extend"
    ref = _reference(layers, embeddings, final_norm, rope, extend)
    _assert_matches(_native(layers, embeddings, final_norm, rope, extend), ref)


# Each variant and what the decoder is given without it.
WITHOUT = {
    "q_norm": ("q_norm", "k_norm", "qk_norm_whole"),
    "post_attn_norm": ("post_attn_norm",),
    "post_mlp_norm": ("post_mlp_norm",),
    "window": ("window",),
    "softcap": ("softcap",),
    "scale": ("scale",),
    "gelu": ("gelu",),
    "cos": ("cos", "sin"),
    "rotary_dim": ("rotary_dim", "cos", "sin"),
}


@pytest.mark.parametrize("family", [name for name in CASES if name != "llama"])
def test_every_variant_changes_the_result(gen, family):
    """The decoder applies each variant it is given: without any one of them its output leaves the
    reference by far more than the tolerance above."""
    layers, embeddings, final_norm, rope = _inputs(gen, family)
    ref = _reference(layers, embeddings, final_norm, rope)
    for variant, fields in WITHOUT.items():
        if variant == "cos" and any("rotary_dim" in layer for layer in layers):
            continue  # partial rotation's tables go with it (its own entry)
        if any(variant in layer for layer in layers):
            ablated = [{k: v for k, v in layer.items() if k not in fields} for layer in layers]
            out = _native(ablated, embeddings, final_norm, rope, extend=False)
            assert (out - ref).abs().max() > 0.2, variant


def test_norms_must_be_bf16(gen):
    layers = _layers(gen, [{"post_attn_norm": True}])
    layers[0]["post_attn_norm"] = layers[0]["post_attn_norm"].float()
    with pytest.raises(ValueError, match="bfloat16"):
        _native(
            layers,
            torch.zeros(TOKENS + MORE, HIDDEN, dtype=BF16),
            torch.ones(HIDDEN, dtype=BF16),
            _rope(1e4),
            False,
        )
