"""Plain PyTorch references for the kernels: per-sequence loops in fp32, written to be obviously correct.

The kernel tests compare against these; they also document the exact semantics of each kernel.
"""

import torch


def _gather(cache: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence as ``[length, num_kv_heads, head_dim]`` fp32."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    pages = block_table_row[:num_blocks].long()
    return cache[pages].flatten(0, 1)[:length].float()


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    q_pos: torch.Tensor,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Softmax attention of ``q [n, H, D]`` (at positions ``q_pos``) over ``k, v [L, Hkv, D]``, causal.

    ``window`` > 0: a query at position p sees keys p - window + 1 to p (Mistral's and Gemma's sliding
    window, as transformers masks it). ``softcap`` > 0: scores become ``softcap * tanh(score / softcap)``
    after scaling, before the mask and softmax (Gemma 2)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # query head h reads kv head h // group
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    key_pos = torch.arange(k.shape[0], device=q.device)[None, :]
    visible = key_pos <= q_pos[:, None]
    if window > 0:
        visible &= key_pos > q_pos[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def store_kvcache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Reference for :func:`kernels.store_kvcache`."""
    block_size = k_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = key[token]
        v_cache[slot // block_size, slot % block_size] = value[token]


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    *,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Reference for :func:`kernels.paged_decode_attention`; ``num_splits`` is accepted and ignored.
    ``window`` and ``softcap`` as `_attend` takes them (0: none)."""
    out = torch.empty_like(q)
    for b, length in enumerate(seq_lens.tolist()):
        k = _gather(k_cache, block_tables[b], length)
        v = _gather(v_cache, block_tables[b], length)
        q_pos = torch.tensor([length - 1], device=q.device)
        out[b] = _attend(q[b : b + 1], k, v, scale, q_pos, window, softcap)[0].to(q.dtype)
    return out


def paged_extend_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    *,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Reference for :func:`kernels.paged_extend_attention`; ``max_query_len`` is accepted and ignored.
    ``window`` and ``softcap`` as `_attend` takes them (0: none)."""
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for b, length in enumerate(seq_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        k = _gather(k_cache, block_tables[b], length)
        v = _gather(v_cache, block_tables[b], length)
        q_pos = torch.arange(length - (hi - lo), length, device=q.device)
        out[lo:hi] = _attend(q[lo:hi], k, v, scale, q_pos, window, softcap).to(q.dtype)
    return out


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`triton.fused.add_rms_norm` (and ``rms_norm`` when ``residual`` is None):
    transformers' ``LlamaRMSNorm`` after the residual add, which rounds the sum and the normalised value to
    the activation dtype before the weight multiplies it."""
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = (normed.float() * weight.float()).to(x.dtype)
    return out if residual is None else (out, h)


def rotary_embedding_ref(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Reference for :func:`triton.fused.rotary_embedding_` (returns a new tensor): rotate-half
    RoPE, ``x * cos + rotate_half(x) * sin`` in fp32 with the caches of ``RotaryEmbedding`` (sin's first
    half already negated, so rotate_half only swaps the halves)."""
    xf = x.float()
    half = x.shape[-1] // 2
    swapped = torch.cat((xf[..., half:], xf[..., :half]), dim=-1)
    c, s = cos[positions].float().unsqueeze(1), sin[positions].float().unsqueeze(1)
    return (xf * c + swapped * s).to(x.dtype)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Reference for :func:`llmserve_kernels.triton.fused.silu_and_mul`: ``silu(gate) * up`` in fp32."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Reference for the fused mixture-of-experts kernels (``cpu.moe.fused_moe``, ``triton.fused_moe``):
    token t's output is ``sum_j topk_weights[t, j] * expert_e(x[t])`` over its chosen experts
    ``e = topk_ids[t, j]``, where ``expert_e(x) = w2[e] @ (silu(w13[e, :I] @ x) * (w13[e, I:] @ x))``
    (x [T, H], w13 [E, 2I, H] gate rows then up rows, w2 [E, H, I]). All in fp32, rounded once at the end."""
    xf, out = x.float(), torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w13.shape[1] // 2
    for e in topk_ids.unique().tolist():
        tokens, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        gate_up = xf[tokens] @ w13[e].float().T
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, tokens, (act @ w2[e].float().T) * topk_weights[tokens, slot, None].float())
    return out.to(x.dtype)


def lora_ref(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slots: torch.Tensor,
    scales: torch.Tensor,
) -> torch.Tensor:
    """Reference for the batched LoRA kernels (``cpu.lora.lora_add_``, ``triton.lora.lora_add_``): row t of
    ``y`` gains ``scales[s] * (x[t] @ lora_a[s].T) @ lora_b[s].T`` where ``s = slots[t]``, nothing where
    ``s`` is -1 (x [T, in], y [T, out], lora_a [S, R, in], lora_b [S, out, R], scales [S]). A slot of a
    smaller rank holds zeros past it. fp32 inside, each updated row rounded once; ``y`` updated in place."""
    for s in slots[slots >= 0].unique().tolist():
        rows = torch.nonzero(slots == s, as_tuple=True)[0]
        shrunk = (x[rows].float() @ lora_a[s].float().T) * scales[s].float()
        y[rows] = (y[rows].float() + shrunk @ lora_b[s].float().T).to(y.dtype)
    return y
