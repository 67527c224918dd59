"""Native CPU kernels: C sources in `csrc/`, compiled on first use and called through ctypes.

Why not PyTorch: decode attention over a paged cache in PyTorch must first gather every sequence's
blocks into a padded copy and then run a masked SDPA that handles a handful of query rows per head
poorly, and a decode step of a small model is hundreds of elementwise ops that each cost more in
dispatch than in arithmetic. `attention` reads the paged cache in place and writes a step's K/V into
it; `fused` has the residual add fused with RMSNorm, and the rotary embedding (bf16); `sampling` has
greedy argmax (torch runs it on one core) and batched top-k / top-p / min-p sampling without sorting rows;
`team` starts a thread's OpenMP team spread over the cores.
"""

from llmserve_kernels.cpu import attention, fused, sampling
from llmserve_kernels.cpu._build import available

__all__ = ["attention", "available", "fused", "sampling"]
