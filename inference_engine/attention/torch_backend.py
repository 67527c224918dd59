"""Paged attention in PyTorch: the CPU backend (and a fallback wherever Triton is missing).

Where the native CPU kernels (kernels/cpu/attention.py) are available, every decode, and every new token of a
chunk of at most `NATIVE_QUERY_MIN` tokens, is one query of the decode kernel, which reads the paged cache in
place up to the token's own position: so a speculative verification's tokens get the bits plain decoding
gives them. Longer chunks, up to `native_query_max` tokens, go to the extend kernel, which shares each key
among many queries (or, where it cannot run, are one-token queries of the decode kernel too). Longer ones go
sequence by sequence through SDPA's GEMM-based flash kernel (a chunk with no cached prefix attends to its own
fresh K/V without touching the cache). Without the native kernels, single-token queries gather their
sequences' K/V through the block tables into one padded batch and run one masked
scaled_dot_product_attention. Where the native kernels win over SDPA depends on the CPU, so it is measured
once per process.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from itertools import accumulate

import torch
import torch.nn.functional as F

from inference_engine.attention import AttentionMetadata
from llmserve_kernels.cpu import attention as cpu_attention
from llmserve_kernels.reference import paged_decode_attention_ref, paged_extend_attention_ref
from llmserve_kernels.timing import best_time

# Chunks of up to this many new tokens always run on the native kernel, one query a token, and so can run in
# the native decoder wherever SDPA would be faster for them (a prompt of a few dozen tokens pays more for
# going layer by layer through Python than per-token attention costs it).
NATIVE_QUERY_MIN = 64
_CALIBRATION_LENGTHS = (64, 128, 256, 512, 1024)  # longer would make the timing itself costly
EVERY_LENGTH = 2**31 - 1  # the native kernels' limit where they beat SDPA at every calibration length


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
):
    if cpu_attention.store_kv(k, v, k_cache, v_cache, slots):
        return
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
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """`window`: keys a query sees, itself included (0: all before it); `softcap`: attention logits go
    through softcap * tanh(logit / softcap) (0: as they are)."""
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    variant = {"window": window, "softcap": softcap}
    if meta.decode_only:
        return _decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, **variant)
    starts = list(accumulate(meta.query_lens, initial=0))
    limit = native_limit(meta, q.shape[1], k_cache.shape[2], q.shape[2], q.dtype)
    out = torch.empty_like(q)
    extended = set()
    if limit > NATIVE_QUERY_MIN and cpu_attention.paged_extend(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        scale,
        out,
        (NATIVE_QUERY_MIN + 1, limit),
        **variant,
    ):
        extended = {b for b, n in enumerate(meta.query_lens) if NATIVE_QUERY_MIN < n <= limit}
    # The rest up to the limit as one-token queries of the decode kernel, each up to its own position.
    by_token = [b for b, n in enumerate(meta.query_lens) if n <= limit and b not in extended]
    if not extended and len(by_token) == len(meta.query_lens):
        native = cpu_attention.paged_decode(q, k_cache, v_cache, *meta.per_token(), scale, **variant)
        if native is not None:
            return native
        by_token = []
    if by_token:
        rows = torch.cat([torch.arange(starts[b], starts[b + 1], device=q.device) for b in by_token])
        tables, lens = meta.per_token()
        native = cpu_attention.paged_decode(
            q[rows], k_cache, v_cache, tables[rows], lens[rows], scale, **variant
        )
        if native is None:
            by_token = []
        else:
            out[rows] = native
    done = extended | set(by_token)
    decodes = [b for b, q_len in enumerate(meta.query_lens) if q_len == 1 and b not in done]
    if decodes:
        rows = [starts[b] for b in decodes]
        out[rows] = _decode(
            q[rows], k_cache, v_cache, meta.block_tables[decodes], meta.seq_lens[decodes], scale, **variant
        )
    for b, (q_len, ctx_len) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
        if q_len == 1 or b in done:
            continue
        start, end = starts[b], starts[b + 1]
        if softcap:  # SDPA does not take it
            chunk = torch.tensor([0, q_len], dtype=torch.int32)
            tables, lens = meta.block_tables[b : b + 1], meta.seq_lens[b : b + 1]
            out[start:end] = paged_extend_attention_ref(
                q[start:end], k_cache, v_cache, tables, chunk, lens, scale, q_len, **variant
            )
            continue
        if ctx_len == 0:
            keys, values = k[start:end], v[start:end]
        else:
            keys, values = _gather(k_cache, v_cache, meta.block_tables[b], ctx_len + q_len)
        mask, causal = None, True
        if ctx_len or window:
            pos_q = torch.arange(ctx_len, ctx_len + q_len, device=q.device).unsqueeze(1)
            pos_k = torch.arange(ctx_len + q_len, device=q.device).unsqueeze(0)
            mask, causal = pos_k <= pos_q, False
            if window:
                mask &= pos_k > pos_q - window
        out[start:end] = _sdpa(q[start:end], keys, values, mask, causal, scale)
    return out


def native_limit(
    meta: AttentionMetadata, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """The longest chunk of this step that the native kernels take (`forward`; the native decoder sends its
    steps' attention the same way): `NATIVE_QUERY_MIN`, or where a chunk is longer, `native_query_max`."""
    if meta.max_query_len <= NATIVE_QUERY_MIN:
        return NATIVE_QUERY_MIN
    return native_query_max(heads, kv_heads, head_dim, dtype, torch.get_num_threads())


@cache
def native_query_max(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, threads: int) -> int:
    """The longest prompt chunk that the native kernels run faster than SDPA on this CPU, timed once: the
    extend kernel where it runs, else each token as a query of the decode kernel.

    The answer differs by an order of magnitude between CPUs: SDPA's blocked kernel is fast where it runs on
    AMX tiles or on many cores, and so is the extend kernel where it has AMX too (`csrc/paged_extend.c`);
    without AMX the extend kernel's vector routine wins on some CPUs at every length and loses on others.
    A wrong pick costs time, never accuracy.
    """
    gen = torch.Generator().manual_seed(0)
    block_size, scale = 16, head_dim**-0.5

    def inputs(n: int):
        blocks = (n + block_size - 1) // block_size
        q = torch.randn(n, heads, head_dim, generator=gen).to(dtype)
        k, v = (torch.randn(blocks * block_size, kv_heads, head_dim, generator=gen).to(dtype) for _ in "kv")
        tables = torch.arange(blocks, dtype=torch.int32).expand(n, blocks)
        return q, k, v, tables, torch.arange(1, n + 1, dtype=torch.int32)

    def native(n: int) -> float:
        q, k, v, tables, lens = inputs(n)
        caches = k.view(-1, block_size, kv_heads, head_dim), v.view(-1, block_size, kv_heads, head_dim)
        chunk = torch.tensor([0, n], dtype=torch.int32)
        extend = (q, *caches, tables[:1], chunk, lens[-1:], scale, torch.empty_like(q))
        if cpu_attention.paged_extend(*extend):
            return best_time(lambda: cpu_attention.paged_extend(*extend))
        if cpu_attention.paged_decode(q, *caches, tables, lens, scale) is None:
            return float("inf")  # no kernel here, or not for this shape
        return best_time(lambda: cpu_attention.paged_decode(q, *caches, tables, lens, scale))

    def sdpa(n: int) -> float:
        q, k, v, _, _ = inputs(n)
        return best_time(lambda: _sdpa(q, k[:n], v[:n], None, True, scale))

    return longest_faster(native, sdpa)


def longest_faster(native: Callable[[int], float], sdpa: Callable[[int], float]) -> int:
    """The last calibration length, going up, at which `native` still takes less time than `sdpa`; every
    length where it is faster at all of them (both grow quadratically from there; a measured case:
    benchmarks/results/kernel-and-runner-timings.md)."""
    best = NATIVE_QUERY_MIN
    for n in _CALIBRATION_LENGTHS:
        if native(n) >= sdpa(n):
            return best
        best = n
    return EVERY_LENGTH


def _gather(k_cache, v_cache, block_table: torch.Tensor, length: int):
    block_size = k_cache.shape[1]
    blocks = block_table[: (length + block_size - 1) // block_size]
    keys = k_cache.index_select(0, blocks).flatten(0, 1)[:length]
    values = v_cache.index_select(0, blocks).flatten(0, 1)[:length]
    return keys, values


def _decode(
    q, k_cache, v_cache, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, **variant
) -> torch.Tensor:
    out = cpu_attention.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, **variant)
    if out is not None:
        return out
    if variant["window"] or variant["softcap"]:
        return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, **variant)
    return decode_reference(q, k_cache, v_cache, block_tables, seq_lens, scale)


def decode_reference(
    q, k_cache, v_cache, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Decode attention in PyTorch ops: the fallback, and the reference the native kernel is tested on."""
    batch, heads, dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    num_blocks = (int(seq_lens.max()) + block_size - 1) // block_size
    # index_select rather than k_cache[tables]: the same gather, several times faster on the CPU.
    blocks = block_tables[:, :num_blocks].flatten()
    padded = (batch, num_blocks * block_size, kv_heads, dim)
    keys = k_cache.index_select(0, blocks).view(padded).transpose(1, 2)  # [batch, kv_heads, padded_len, dim]
    values = v_cache.index_select(0, blocks).view(padded).transpose(1, 2)
    valid = torch.arange(keys.shape[2]) < seq_lens.unsqueeze(1)
    # An additive mask in the compute dtype: CPU SDPA is several times slower with a boolean one.
    bias = torch.zeros(valid.shape, dtype=q.dtype).masked_fill_(~valid, float("-inf"))[:, None, None, :]
    # The query heads sharing a KV head are that head's query rows, so K/V are never repeated per head.
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=bias, scale=scale)
    return out.reshape(batch, heads, dim)


def _sdpa(q, k, v, mask, causal: bool, scale: float) -> torch.Tensor:
    """One sequence: q [q_len, heads, dim], k/v [kv_len, kv_heads, dim] -> [q_len, heads, dim].

    The inputs get a batch dimension because the CPU's flash kernel only takes 4-D ones: 3-D inputs fall
    back to the unfused math path, several times slower on long prompts.
    """
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)
