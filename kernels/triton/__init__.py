"""Triton kernels for paged attention and the KV-cache store (the CUDA path)."""

from .decode_attention import paged_decode_attention
from .extend_attention import paged_extend_attention
from .kv_store import store_kvcache

__all__ = ["paged_decode_attention", "paged_extend_attention", "store_kvcache"]
