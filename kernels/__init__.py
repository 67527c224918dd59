"""Triton kernels for paged attention and the KV-cache store, with PyTorch references.

This package imports only torch and triton. On CUDA the Triton kernels run natively; on CPU they run under
Triton's interpreter (``TRITON_INTERPRET=1``, set before Python starts), which is how the tests check them.
"""

from .decode_attention import paged_decode_attention
from .extend_attention import paged_extend_attention
from .kv_store import store_kvcache
from .reference import paged_decode_attention_ref, paged_extend_attention_ref, store_kvcache_ref

__all__ = [
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_extend_attention",
    "paged_extend_attention_ref",
    "store_kvcache",
    "store_kvcache_ref",
]
