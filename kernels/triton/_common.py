"""Small helpers shared by the Triton kernel launchers."""

import functools
import math
import os

import torch

import triton
import triton.language as tl

# Triton's interpreter computes bf16/fp16 ``tl.dot`` wrongly, so kernels upcast dot operands to fp32 there.
# Read once at import: the interpreter itself is chosen when triton is imported, so it cannot change later.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET") == "1"

LOG2E: float = math.log2(math.e)

DEFAULT_NUM_SMS = 132  # H100/H200, used when no CUDA device can be asked


@functools.lru_cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``: launchers size split-K grids to keep every SM busy."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs would silently use TF32 tensor cores on CUDA; ask for IEEE so fp32 means fp32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def head_block(head_dim: int) -> int:
    """Columns of a head as a tile: a power of two, and at least 16 because ``tl.dot`` needs K and N >= 16
    on the GPU (head_dim 8 would not compile; the extra columns are masked to zero)."""
    return max(16, triton.next_power_of_2(head_dim))


def require_last_dim_contiguous(*tensors: torch.Tensor) -> None:
    """Kernels address the head dimension with unit stride; every other stride is passed explicitly."""
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"last dimension must be contiguous, got strides {tuple(t.stride())}")


@triton.jit
def tanh(x):
    """tanh as 1 - 2 / (e^2x + 1), which the interpreter and every GPU compute alike (exp overflowing to inf
    gives 1, underflowing to 0 gives -1): attention soft-capping's."""
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


def group_rows(groups: torch.Tensor, num_groups: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids, block_group): the ids of the entries of `groups` (group numbers; -1: none) that have a
    group, sorted by group (stable), each group's run padded to a multiple of `block_m` with the invalid id
    ``groups.numel()``; and the group of each `block_m` block. The fused-MoE kernels (token-expert pairs by
    expert) and the LoRA kernels (rows by adapter slot) walk their rows in this order, so that each block of
    rows reads one group's weights."""
    flat = groups.flatten().long()
    has_group = torch.nonzero(flat >= 0, as_tuple=True)[0]
    order = has_group[torch.argsort(flat[has_group], stable=True)]
    counts = torch.bincount(flat[has_group], minlength=num_groups)
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(counts, 0) - counts
    padded_start = torch.cumsum(padded, 0) - padded
    sorted_groups = flat[order]
    rank = torch.arange(order.numel(), device=flat.device) - start[sorted_groups]
    sorted_ids = torch.full((int(padded.sum()),), flat.numel(), dtype=torch.int32, device=flat.device)
    sorted_ids[padded_start[sorted_groups] + rank] = order.to(torch.int32)
    block_group = torch.repeat_interleave(torch.arange(num_groups, device=flat.device), padded // block_m)
    return sorted_ids, block_group.to(torch.int32)
