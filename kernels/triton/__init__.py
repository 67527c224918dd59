"""Triton kernels for the CUDA path: paged attention, the KV-cache store, fused elementwise layers
(`fused`) and quantized linear layers (`linear`)."""

from .decode_attention import paged_decode_attention
from .extend_attention import paged_extend_attention
from .fused import add_rms_norm, rms_norm, rotary_embedding_, silu_and_mul
from .kv_store import store_kvcache

__all__ = [
    "add_rms_norm",
    "paged_decode_attention",
    "paged_extend_attention",
    "rms_norm",
    "rotary_embedding_",
    "silu_and_mul",
    "store_kvcache",
]
