"""Paged attention in plain PyTorch: the CPU backend (and a fallback wherever Triton is missing).

Decode-only steps gather every sequence's K/V through its block table into one padded batch and run
one masked scaled_dot_product_attention; steps with prefill chunks go sequence by sequence, and a
chunk with no cached prefix attends to its own fresh K/V without touching the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inference_engine.attention import AttentionMetadata


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
):
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


def forward(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.decode_only:
        return _decode(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    start = 0
    for b, (q_len, ctx_len) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
        end = start + q_len
        if ctx_len == 0:
            keys, values, mask, causal = k[start:end], v[start:end], None, True
        else:
            keys, values = _gather(k_cache, v_cache, meta.block_tables[b], ctx_len + q_len)
            pos_q = torch.arange(ctx_len, ctx_len + q_len).unsqueeze(1)
            mask, causal = torch.arange(ctx_len + q_len).unsqueeze(0) <= pos_q, False
        out[start:end] = _sdpa(
            q[start:end].unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), mask, causal, scale
        )[0]
        start = end
    return out


def _gather(k_cache, v_cache, block_table: torch.Tensor, length: int):
    block_size = k_cache.shape[1]
    blocks = block_table[: (length + block_size - 1) // block_size]
    keys = k_cache[blocks].flatten(0, 1)[:length]
    values = v_cache[blocks].flatten(0, 1)[:length]
    return keys, values


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    block_size = k_cache.shape[1]
    num_blocks = (meta.max_seq_len + block_size - 1) // block_size
    tables = meta.block_tables[:, :num_blocks]
    keys = k_cache[tables].flatten(1, 2)  # [batch, padded_len, kv_heads, head_dim]
    values = v_cache[tables].flatten(1, 2)
    mask = torch.arange(keys.shape[1]).unsqueeze(0) < meta.seq_lens.unsqueeze(1)
    return _sdpa(q.unsqueeze(1), keys, values, mask[:, None, None, :], False, scale)[:, 0]


def _sdpa(q, k, v, mask, causal: bool, scale: float) -> torch.Tensor:
    """q: [batch, q_len, heads, dim], k/v: [batch, kv_len, kv_heads, dim] -> [batch, q_len, heads, dim]."""
    group = q.shape[2] // k.shape[2]
    if group > 1:
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=causal, scale=scale
    )
    return out.transpose(1, 2)
