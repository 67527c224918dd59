"""Triton kernels for the CUDA path: paged attention, the KV-cache store, fused elementwise layers
(`fused`) and quantized linear layers (`linear`)."""

from ._common import sm_count
from .decode_attention import choose_num_splits, paged_decode_attention
from .extend_attention import paged_extend_attention
from .fused import add_rms_norm, rms_norm, rotary_embedding_, silu_and_mul
from .kv_store import store_kvcache

__all__ = [
    "add_rms_norm",
    "choose_num_splits",
    "paged_decode_attention",
    "paged_extend_attention",
    "rms_norm",
    "rotary_embedding_",
    "silu_and_mul",
    "sm_count",
    "store_kvcache",
]
