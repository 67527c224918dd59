"""Linear layers shaped for tensor parallelism, as in Megatron / vLLM / nano-vllm.

A column-parallel layer shards its output features, a row-parallel layer its input features and
all-reduces the result; fused projections (QKV, gate+up) are one layer whose checkpoint tensors each
load into their part. Weights arrive dense or quantized (`llmserve_kernels.quantized`); each layer keeps its
rank's shard of every part until `finalize`, which fuses the parts and packs them once for the
device's kernels (kernels/cpu/linear.py or kernels/triton/linear.py). Parts of different quantized
formats (a GGUF file may store V in Q6_K beside Q and K in Q4_K) stay separate matmuls.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import nn

from inference_engine.distributed import all_reduce, tp_rank, tp_size
from llmserve_kernels.quantized import Int4Weight, Int8Weight, QuantizedWeight

if TYPE_CHECKING:
    from inference_engine.lora.layers import LoRALayer

Weight = torch.Tensor | QuantizedWeight


def linear_kernels(device: torch.device) -> ModuleType:
    if device.type == "cuda":
        from llmserve_kernels.triton import linear
    else:
        from llmserve_kernels.cpu import linear
    return linear


def fuse(parts: list[Weight]) -> list[Weight]:
    """Concatenates runs of parts that share a format (rows one after the other)."""
    runs: list[list[Weight]] = []
    for part in parts:
        kind = _kind(part)
        if runs and _kind(runs[-1][0]) == kind:
            runs[-1].append(part)
        else:
            runs.append([part])
    fused = []
    for run in runs:
        if len(run) == 1:
            fused.append(run[0])
        elif isinstance(run[0], torch.Tensor):
            fused.append(torch.cat(run))
        else:
            fused.append(type(run[0]).cat(run))
    return fused


def _kind(w: Weight) -> tuple:
    if isinstance(w, torch.Tensor):
        return ("dense",)
    perm = None if w.perm is None else w.perm.data_ptr()
    return (type(w), w.group_size, perm)


class LinearBase(nn.Module):
    def __init__(self, shard_ids: list, bias_size: int | None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.shard_ids = shard_ids  # the checkpoint tensors that make up the weight, in row order
        self.parts: dict = {}
        self.packed: list = []
        self.device, self.dtype = torch.get_default_device(), torch.get_default_dtype()
        self.bias = nn.Parameter(torch.empty(bias_size), requires_grad=False) if bias_size else None
        self.lora: LoRALayer | None = (
            None  # set where the engine serves LoRA adapters (inference_engine/lora)
        )

    def shard(self, weight: Weight, shard_id) -> Weight:
        """This rank's slice of one checkpoint tensor."""
        raise NotImplementedError

    def load_weight(self, weight: Weight, shard_id=None) -> None:
        if shard_id not in self.shard_ids:
            raise ValueError(f"unexpected weight part {shard_id!r}")
        part = self.shard(weight, shard_id)
        self.parts[shard_id] = _to(part, self.device, self.dtype)

    def finalize(self, quantize_int8: bool = False) -> None:
        """Packs the loaded parts for the kernels; `quantize_int8` quantizes dense weights first."""
        missing = [s for s in self.shard_ids if s not in self.parts]
        if missing:
            raise ValueError(f"checkpoint is missing weight parts {missing}")
        parts = [self.parts.pop(s) for s in self.shard_ids]
        if quantize_int8:
            parts = [Int8Weight.quantize(p) if isinstance(p, torch.Tensor) else p for p in parts]
        kernels = linear_kernels(self.device)
        self.packed = [kernels.pack(w, self.dtype) for w in fuse(parts)]
        self._kernels = kernels

    @property
    def weight_bytes(self) -> int:
        return sum(p.nbytes for p in self.packed)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if len(self.packed) == 1:
            out = self._kernels.linear(x, self.packed[0], bias)
        else:
            out = torch.cat([self._kernels.linear(x, p) for p in self.packed], dim=-1)
            out = out + bias if bias is not None else out
        # Each row's own adapter's low-rank update, after the base matmul (dense or quantized alike).
        if self.lora is not None and self.lora.batch.slots is not None:
            self.lora.apply(x, out)
        return out


def _to(weight: Weight, device: torch.device, dtype: torch.dtype) -> Weight:
    if isinstance(weight, torch.Tensor):
        return weight.to(device=device, dtype=dtype)
    if isinstance(weight, Int4Weight):
        return Int4Weight(
            weight.q.to(device),
            weight.scale.to(device),
            weight.offset.to(device),
            weight.group_size,
            None if weight.perm is None else weight.perm.to(device),
        )
    return Int8Weight(weight.q.to(device), weight.scale.to(device), weight.group_size)


class ColumnParallelLinear(LinearBase):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        output_sizes: list[int] | None = None,
        part_ids: list | None = None,
    ) -> None:
        super().__init__(part_ids or [None], output_size // tp_size() if bias else None)
        self.input_size = input_size
        self.output_sizes = output_sizes or [output_size]
        assert all(size % self.tp_size == 0 for size in self.output_sizes)

    def part_slice(self, shard_id) -> tuple[int, int, int]:
        """(offset in this rank's fused output, first row in the checkpoint tensor, rows) of one part."""
        index = self.shard_ids.index(shard_id)
        sizes = [s // self.tp_size for s in self.output_sizes]
        return sum(sizes[:index]), self.tp_rank * sizes[index], sizes[index]

    def shard(self, weight: Weight, shard_id) -> Weight:
        _, first, rows = self.part_slice(shard_id)
        return weight.narrow(0, first, rows)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Loads (this rank's slice of) a bias part."""
        offset, first, rows = self.part_slice(shard_id)
        param.data.narrow(0, offset, rows).copy_(loaded.narrow(0, first, rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate_proj + up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        parts = list(range(len(output_sizes)))
        super().__init__(input_size, sum(output_sizes), bias, output_sizes, parts)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul; each rank holds its share of query and KV heads. With more
    ranks than KV heads, each KV head is replicated on the ranks whose query heads read it (as vLLM)."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        size = tp_size()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            num_heads // size,
            max(1, num_kv_heads // size),
            head_dim,
        )
        # this rank's first KV head in the checkpoint
        self.kv_head = (
            tp_rank() * num_kv_heads // size if num_kv_heads < size else tp_rank() * self.num_kv_heads
        )
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(
            hidden_size, (q + 2 * kv) * size, bias, [q * size, kv * size, kv * size], ["q", "k", "v"]
        )

    def part_slice(self, shard_id) -> tuple[int, int, int]:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            return 0, self.tp_rank * q, q
        return q + (kv if shard_id == "v" else 0), self.kv_head * self.head_dim, kv


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__([None], output_size if bias else None)
        assert input_size % self.tp_size == 0
        self.input_size, self.output_size = input_size, output_size

    def shard(self, weight: Weight, shard_id) -> Weight:
        cols = self.input_size // self.tp_size
        return weight.narrow(1, self.tp_rank * cols, cols)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded)  # the bias is added once, after the all-reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, None)
        if self.tp_size > 1:
            all_reduce(y)
        return y + self.bias if self.bias is not None else y
