"""Paged attention with our Triton kernels (the CUDA backend; runs on CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

import torch

from inference_engine.attention import AttentionMetadata
from llmserve_kernels.triton import paged_decode_attention, paged_extend_attention, store_kvcache


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.decode_only:
        return paged_decode_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            scale,
            meta.num_splits,
            window=window,
            softcap=softcap,
        )
    return paged_extend_attention(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        scale,
        meta.max_query_len,
        window=window,
        softcap=softcap,
    )
