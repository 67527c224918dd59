"""Check the Triton kernels at production shapes and time them on a CUDA GPU.

1. Every kernel is compared with its PyTorch reference (SmolLM2-135M and Llama-8B shapes, bf16): attention
   and the KV store, the fused layers (residual add + RMSNorm, rotary, SiLU-and-multiply) and the
   quantized matmul (int4 group 128 and 32, int8 per channel) against ``x.float() @ w.dequantize().T``.
2. The decode kernel is timed with CUDA events (median, L2 flushed before each run) for batch 1..256 and
   contexts 128..8192; the K+V bytes it must read give its bandwidth, reported as a share of the device's
   measured copy bandwidth, because decode attention is bound by reading the cache. The same problem is
   timed with ``torch.nn.functional.scaled_dot_product_attention`` over K/V gathered into contiguous
   tensors beforehand: a dense kernel that need not follow a block table.
3. A mixed step, one 1,793-token chunk beside 255 single-token decodes (Llama-8B heads), runs through the
   one-grid extend kernel and, for comparison, as two launches (the chunk through the extend kernel, the
   decodes through the split-K decode kernel); the programs each grid launches are reported.
4. The fused layers against the PyTorch ops they replace, at 1, 256 and 2048 tokens.
5. The quantized matmul against cuBLAS on the dense bf16 weight of the same shape (Llama-8B's
   projections) for 1..2048 rows; at one row, the packed weight's bytes per second as a share of the copy
   bandwidth (decode reads every weight once a step).
6. The offline throughput benchmark (``benchmarks/offline_throughput.py``: our engine on the Triton backend
   against transformers static batching) runs on the GPU, unless ``--skip-throughput``.

Only the kernels run between the CUDA events: inputs are built beforehand, and each call is captured in a
CUDA graph and replayed where it can be, so that the host's launch overhead is not counted (the engine
replays its decode steps the same way). Results go to a JSON file
(``--out``) and PNG plots beside it. The process exits with status 1 when a correctness check fails.

    python benchmarks/gpu_kernels.py --out benchmarks/results/gpu_kernels.json
"""

import argparse
import functools
import json
import math
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # `python benchmarks/gpu_kernels.py` works without an install

from llmserve_kernels import reference  # noqa: E402
from llmserve_kernels import triton as kernels  # noqa: E402
from llmserve_kernels.quantized import Int4Weight, Int8Weight, QuantizedWeight  # noqa: E402
from llmserve_kernels.triton import choose_num_splits, sm_count  # noqa: E402
from llmserve_kernels.triton import linear as quantized_linear  # noqa: E402
from llmserve_kernels.triton.extend_attention import extend_grid, extend_tile  # noqa: E402


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


# Times one call of a function in ms (CUDA events on the GPU; the tests pass a stand-in to run the rest).
Timer = Callable[[Callable[[], object]], float]

MODELS = (ModelShape("smollm2-135m", 9, 3, 64), ModelShape("llama-8b", 32, 8, 128))
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTEXTS = (128, 256, 512, 1024, 2048, 4096, 8192)
BLOCK_SIZE = 16
TOLERANCE = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 3e-2}

# The mixed step of issue 16: one prefill chunk beside single-token decodes, Llama-8B heads.
MIXED_CHUNK, MIXED_DECODES, MIXED_DECODE_CONTEXT = 1793, 255, 1024
# Llama-8B layer dimensions (hidden, heads, kv heads, head_dim, intermediate) for the fused layers.
LLAMA_8B_LAYER = (4096, 32, 8, 128, 14336)
FUSED_TOKENS = (1, 256, 2048)
# (name, in_features, out_features): Llama-8B's projections (QKV, O, gate+up, down).
LINEAR_SHAPES = (
    ("qkv", 4096, 6144),
    ("o", 4096, 4096),
    ("gate_up", 4096, 28672),
    ("down", 14336, 4096),
)
LINEAR_ROWS = (1, 16, 64, 256, 2048)
QUANTIZED_FORMATS = ("int4-g128", "int4-g32", "int8")


# ---------------------------------------------------------------------------------------------- pure parts


def decode_grid(batches: Iterable[int], contexts: Iterable[int], max_tokens: int) -> list[tuple[int, int]]:
    """(batch, context) points to time, skipping those whose cache would exceed ``max_tokens`` tokens."""
    return [(b, c) for b in batches for c in contexts if b * c <= max_tokens]


def decode_bytes(batch: int, context: int, num_kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """Bytes of K and V one decode step must read; q, the output and the block table are negligible."""
    return 2 * batch * context * num_kv_heads * head_dim * elem_bytes


def gbps(num_bytes: float, ms: float) -> float:
    return num_bytes / (ms * 1e-3) / 1e9


def mixed_step_programs(q_lens: Sequence[int], num_heads: int, num_kv_heads: int) -> dict[str, int]:
    """Programs the extend kernel launches for one step: with today's grid (query tokens plus sequences),
    with the grid it had before (the longest chunk's tiles for every sequence), and those that do work."""
    _, block_q = extend_tile(num_heads, num_kv_heads, max(q_lens))
    tiles, kv_heads = extend_grid(sum(q_lens), len(q_lens), num_kv_heads, block_q)
    return {
        "block_q": block_q,
        "programs": tiles * kv_heads,
        "programs_longest_chunk_grid": -(-max(q_lens) // block_q) * len(q_lens) * num_kv_heads,
        "working_programs": sum(-(-n // block_q) for n in q_lens) * num_kv_heads,
    }


def random_quantized(
    fmt: str, out_features: int, in_features: int, gen: torch.Generator, device: str
) -> QuantizedWeight:
    """A random weight of ``fmt``: "int4-g128" (AWQ/GPTQ-like s * (q - z)), "int4-g32" (GGUF Q4_1-like, fp16
    d and m) or "int8" (per output channel)."""
    if fmt == "int8":
        dense = torch.randn(out_features, in_features, generator=gen, device=device) * 0.02
        return Int8Weight.quantize(dense)
    group = group_size(fmt)
    groups = in_features // group
    q = torch.randint(0, 16, (out_features, in_features), generator=gen, device=device, dtype=torch.uint8)
    scale = torch.rand(out_features, groups, generator=gen, device=device) * 0.004 + 1e-4
    if fmt == "int4-g32":
        scale = scale.half().float()
        return Int4Weight(q, scale, (-8 * scale).half().float(), group)
    zeros = torch.randint(0, 16, (out_features, groups), generator=gen, device=device).float()
    return Int4Weight(q, scale, -scale * zeros, group)


def group_size(fmt: str) -> int:
    return {"int4-g128": 128, "int4-g32": 32, "int8": 1}[fmt]


def formats_for(in_features: int) -> list[str]:
    """The formats a layer of `in_features` inputs can be stored in: whole groups only, as every quantizer
    writes them (SmolLM2's 576 inputs have no 128-wide AWQ/GPTQ form)."""
    return [fmt for fmt in QUANTIZED_FORMATS if in_features % group_size(fmt) == 0]


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Aligned text table of the decode timings (times in microseconds)."""
    columns: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("model", lambda r: r["model"]),
        ("batch", lambda r: str(r["batch"])),
        ("context", lambda r: str(r["context"])),
        ("splits", lambda r: str(r["num_splits"])),
        ("triton us", lambda r: f"{r['triton_ms'] * 1e3:.1f}"),
        ("GB/s", lambda r: f"{r['triton_gbps']:.0f}"),
        ("% copy bw", lambda r: f"{r['triton_bw_share']:.0%}"),
        ("1-split us", lambda r: f"{r['triton_one_split_ms'] * 1e3:.1f}"),
        ("sdpa us", lambda r: f"{r['sdpa_ms'] * 1e3:.1f}"),
        ("sdpa/triton", lambda r: f"{r['sdpa_over_triton']:.2f}"),
    ]
    cells = [[title for title, _ in columns]] + [[cell(row) for _, cell in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)) for line in cells
    )


def format_linear_table(rows: Sequence[dict[str, Any]]) -> str:
    """Aligned text table of the quantized matmul timings against dense cuBLAS (times in microseconds)."""
    formats = sorted({f for row in rows for f in row["quantized_ms"]})
    header = ["shape", "rows", "dense us", *(f"{f} us" for f in formats), *(f"{f} x" for f in formats)]
    cells = [header]
    for row in rows:
        times = [row["quantized_ms"].get(f) for f in formats]
        cells.append(
            [
                f"{row['name']} {row['in_features']}->{row['out_features']}",
                str(row["rows"]),
                f"{row['dense_ms'] * 1e3:.1f}",
                *(f"{t * 1e3:.1f}" if t else "-" for t in times),
                *(f"{row['dense_ms'] / t:.2f}" if t else "-" for t in times),
            ]
        )
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in cells)


def write_json(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")


def plot_results(
    path: Path, rows: Sequence[dict[str, Any]], show_batches: Sequence[int] = (1, 8, 64, 256)
) -> None:
    """Share of copy bandwidth against context, one panel per model, Triton solid and SDPA dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({row["model"] for row in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for i, batch in enumerate(show_batches):
            points = sorted((r["context"], r) for r in rows if r["model"] == model and r["batch"] == batch)
            if not points:
                continue
            contexts = [c for c, _ in points]
            color = f"C{i}"
            ax.plot(
                contexts,
                [100 * r["triton_bw_share"] for _, r in points],
                "-o",
                color=color,
                label=f"triton b={batch}",
            )
            ax.plot(
                contexts,
                [100 * r["sdpa_bw_share"] for _, r in points],
                "--",
                color=color,
                label=f"sdpa b={batch}",
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("% of measured copy bandwidth")
        ax.set_title(f"paged decode attention, {model}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_linear(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Matmul time against rows, one panel per projection: cuBLAS on bf16 and each quantized format."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(row["name"] for row in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        points = sorted((r["rows"], r) for r in rows if r["name"] == name)
        counts = [m for m, _ in points]
        ax.plot(counts, [r["dense_ms"] * 1e3 for _, r in points], "-o", color="k", label="cuBLAS bf16")
        formats = sorted({f for _, r in points for f in r["quantized_ms"]})
        for i, fmt in enumerate(formats):
            ax.plot(counts, [r["quantized_ms"][fmt] * 1e3 for _, r in points], "-o", color=f"C{i}", label=fmt)
        first = points[0][1]
        ax.set_title(f"{name} {first['in_features']}->{first['out_features']}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rows")
        ax.set_ylabel("us")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results path (the plot goes beside it)")
    parser.add_argument("--iters", type=int, default=20, help="timed runs per point (median reported)")
    parser.add_argument(
        "--max-tokens", type=int, default=256 * 8192, help="skip points with more cached tokens"
    )
    parser.add_argument("--quick", action="store_true", help="a few points only, to try the script out")
    parser.add_argument("--skip-throughput", action="store_true", help="skip the offline throughput run")
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------ inputs and checks


def random_paged_kv(
    gen: torch.Generator,
    shape: ModelShape,
    seq_lens: Sequence[int],
    block_size: int,
    dtype: torch.dtype,
    device: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches with every sequence on shuffled physical blocks: (k_cache, v_cache, tables, lens)."""
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks)
    cache_shape = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen, device=device).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=device)
    first = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = perm[first : first + n]
        first += n
    lens = torch.tensor(list(seq_lens), dtype=torch.int32, device=device)
    return k_cache, v_cache, tables, lens


def slot_mapping_for(tables: torch.Tensor, seq_lens: Sequence[int], block_size: int) -> torch.Tensor:
    """Flat cache slot of every token of every sequence, in order."""
    slots = []
    for b, length in enumerate(seq_lens):
        pos = torch.arange(length, device=tables.device)
        slots.append(tables[b, pos // block_size].long() * block_size + pos % block_size)
    return torch.cat(slots)


def check_kernels(
    shape: ModelShape,
    seq_lens: Sequence[int],
    chunk_lens: Sequence[int],
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> dict[str, Any]:
    """Run each kernel and its reference on the same random inputs; report max abs errors and pass/fail.

    ``chunk_lens[b] <= seq_lens[b]`` is the length of the last chunk of sequence b for the extend kernel.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    k_cache, v_cache, tables, lens = random_paged_kv(gen, shape, seq_lens, block_size, dtype, device)
    scale = 1 / math.sqrt(shape.head_dim)
    tol = TOLERANCE[dtype]
    errors: dict[str, float] = {}

    # Store every token's K/V through the kernel and the reference into separate copies of the cache.
    total = sum(seq_lens)
    key = torch.randn(total, shape.num_kv_heads, shape.head_dim, generator=gen, device=device).to(dtype)
    value = torch.randn(key.shape, generator=gen, device=device).to(dtype)
    slots = slot_mapping_for(tables, seq_lens, block_size)
    slots[::7] = -1  # padding entries must write nothing
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kernels.store_kvcache(key, value, k_cache, v_cache, slots)
    reference.store_kvcache_ref(key, value, k_ref, v_ref, slots)
    errors["store_kvcache"] = max(float((k_cache - k_ref).abs().max()), float((v_cache - v_ref).abs().max()))

    q = torch.randn(len(seq_lens), shape.num_heads, shape.head_dim, generator=gen, device=device).to(dtype)
    for num_splits in (1, None):
        out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, num_splits)
        ref = reference.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, scale)
        errors[f"paged_decode_attention(num_splits={num_splits})"] = float(
            (out.float() - ref.float()).abs().max()
        )

    query_start_loc = torch.tensor([0, *chunk_lens], device=device).cumsum(0).to(torch.int32)
    q_ext = torch.randn(sum(chunk_lens), shape.num_heads, shape.head_dim, generator=gen, device=device).to(
        dtype
    )
    args = (q_ext, k_cache, v_cache, tables, query_start_loc, lens, scale, max(chunk_lens))
    out = kernels.paged_extend_attention(*args)
    ref = reference.paged_extend_attention_ref(*args)
    errors["paged_extend_attention"] = float((out.float() - ref.float()).abs().max())

    # NaN compares false, so `not err <= tol` also fails on NaN.
    failed = sorted(
        name for name, err in errors.items() if not err <= (0.0 if name == "store_kvcache" else tol)
    )
    return {
        "model": shape.name,
        "dtype": str(dtype),
        "block_size": block_size,
        "errors": errors,
        "failed": failed,
    }


def check_layers(
    hidden: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate: int,
    tokens: int,
    linear_shapes: Sequence[tuple[int, int]],
    linear_rows: Sequence[int],
    device: str,
    seed: int = 0,
) -> dict[str, Any]:
    """The fused layers and the quantized matmul against their references on random bf16 inputs; errors
    are relative to 1 + |reference| for the layers, to the reference's largest magnitude for the matmul."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.bfloat16

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    def max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
        """Largest error relative to 1 + |reference| (absolute near zero, relative for large values)."""
        return float(((out.float() - ref.float()).abs() / (1 + ref.float().abs())).max())

    errors: dict[str, float] = {}
    x, residual, weight = randn(tokens, hidden), randn(tokens, hidden), randn(hidden)
    out, new_residual = kernels.add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_residual = reference.add_rms_norm_ref(x, residual, weight, 1e-5)
    errors["add_rms_norm"] = max(max_error(out, ref_out), max_error(new_residual, ref_residual))
    errors["rms_norm"] = max_error(
        kernels.rms_norm(x, weight, 1e-5), reference.add_rms_norm_ref(x, None, weight, 1e-5)
    )

    max_position = 4096
    freqs = torch.outer(
        torch.arange(max_position, device=device).float(),
        1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim),
    )
    cos = torch.cat((freqs.cos(), freqs.cos()), -1)
    sin = torch.cat((-freqs.sin(), freqs.sin()), -1)
    qk = randn(tokens, num_heads + num_kv_heads, head_dim)
    positions = torch.randint(0, max_position, (tokens,), generator=gen, device=device)
    ref_qk = reference.rotary_embedding_ref(qk, positions, cos, sin)
    errors["rotary_embedding_"] = max_error(kernels.rotary_embedding_(qk, positions, cos, sin), ref_qk)

    gate_up = randn(tokens, 2 * intermediate)
    errors["silu_and_mul"] = max_error(kernels.silu_and_mul(gate_up), reference.silu_and_mul_ref(gate_up))

    for in_features, out_features in linear_shapes:
        for fmt in formats_for(in_features):
            weight_q = random_quantized(fmt, out_features, in_features, gen, device)
            packed = quantized_linear.pack(weight_q, dtype)
            dequantized = weight_q.dequantize()
            for rows in linear_rows:
                x = randn(rows, in_features)
                ref = x.float() @ dequantized.T
                out = quantized_linear.linear(x, packed)
                err = float((out.float() - ref).abs().max() / ref.abs().max())
                errors[f"linear {fmt} {in_features}->{out_features} rows={rows}"] = err

    tol = TOLERANCE[dtype]
    return {"errors": errors, "failed": sorted(name for name, err in errors.items() if not err <= tol)}


# ------------------------------------------------------------------------------------------ GPU timing


def cuda_median_ms(fn: Callable[[], object], iters: int, flush: torch.Tensor, graph: bool = False) -> float:
    """Median time of ``fn`` in ms with CUDA events; ``flush`` is rewritten before each run to empty L2.

    With ``graph``, ``fn`` is captured once in a CUDA graph and its replays are timed, as the engine replays
    its decode steps: a Triton launch from Python takes tens of microseconds of host time, longer than a
    small kernel runs, so eager timing would measure the launch. A call that cannot be captured (one that
    waits on the device) is timed eagerly."""
    for _ in range(3):
        fn()
    if graph:
        fn = _captured(fn) or fn
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _captured(fn: Callable[[], object]) -> Callable[[], object] | None:
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:
        torch.cuda.synchronize()
        return None
    return graph.replay


def copy_bandwidth_gbps(flush: torch.Tensor, num_bytes: int = 4 << 30, iters: int = 10) -> float:
    """Device-to-device copy bandwidth (bytes read + bytes written per second) of a large buffer."""
    src = torch.empty(num_bytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_median_ms(lambda: dst.copy_(src), iters, flush)
    return gbps(2 * src.numel(), ms)


def time_decode(
    shape: ModelShape, batch: int, context: int, timer: Timer, copy_gbps: float, device: str = "cuda"
) -> dict[str, Any]:
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(batch * 100_003 + context)
    k_cache, v_cache, tables, lens = random_paged_kv(gen, shape, [context] * batch, BLOCK_SIZE, dtype, device)
    q = torch.randn(batch, shape.num_heads, shape.head_dim, generator=gen, device=device).to(dtype)
    scale = 1 / math.sqrt(shape.head_dim)
    out = torch.empty_like(q)
    num_splits = choose_num_splits(
        batch, shape.num_kv_heads, tables.shape[1] * BLOCK_SIZE, sm_count(q.device)
    )

    def triton_decode(splits: int | None) -> Callable[[], object]:
        return lambda: kernels.paged_decode_attention(
            q, k_cache, v_cache, tables, lens, scale, splits, out=out
        )

    triton_ms = timer(triton_decode(None))
    one_split_ms = timer(triton_decode(1))

    # Dense baseline: K/V gathered to [batch, kv_heads, context, head_dim] before timing.
    def gather(cache: torch.Tensor) -> torch.Tensor:
        return cache[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()

    k_dense, v_dense = gather(k_cache), gather(v_cache)
    q_dense = q.unsqueeze(2)
    sdpa_ms = timer(
        lambda: torch.nn.functional.scaled_dot_product_attention(
            q_dense, k_dense, v_dense, scale=scale, enable_gqa=True
        )
    )
    num_bytes = decode_bytes(batch, context, shape.num_kv_heads, shape.head_dim, dtype.itemsize)
    return {
        "model": shape.name,
        "batch": batch,
        "context": context,
        "num_splits": num_splits,
        "bytes": num_bytes,
        "triton_ms": triton_ms,
        "triton_gbps": gbps(num_bytes, triton_ms),
        "triton_bw_share": gbps(num_bytes, triton_ms) / copy_gbps,
        "triton_one_split_ms": one_split_ms,
        "sdpa_ms": sdpa_ms,
        "sdpa_gbps": gbps(num_bytes, sdpa_ms),
        "sdpa_bw_share": gbps(num_bytes, sdpa_ms) / copy_gbps,
        "sdpa_over_triton": sdpa_ms / triton_ms,
    }


def time_mixed_step(
    shape: ModelShape, chunk: int, decodes: int, decode_context: int, timer: Timer, device: str = "cuda"
) -> dict[str, Any]:
    """One chunk of ``chunk`` new tokens beside ``decodes`` single-token decodes: one launch of the extend
    kernel against two (the chunk through the extend kernel, the decodes through the split-K decode
    kernel). Both write the same output, compared with the reference."""
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(chunk)
    q_lens = [chunk] + [1] * decodes
    seq_lens = [chunk] + [decode_context] * decodes
    k_cache, v_cache, tables, lens = random_paged_kv(gen, shape, seq_lens, BLOCK_SIZE, dtype, device)
    q = torch.randn(sum(q_lens), shape.num_heads, shape.head_dim, generator=gen, device=device).to(dtype)
    scale = 1 / math.sqrt(shape.head_dim)
    starts = torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32)
    one_grid_out, two_launch_out = torch.empty_like(q), torch.empty_like(q)
    # Each half of the two-launch version, prepared beforehand.
    chunk_args = (q[:chunk], k_cache, v_cache, tables[:1], starts[:2].clone(), lens[:1], scale, chunk)
    decode_args = (q[chunk:], k_cache, v_cache, tables[1:].contiguous(), lens[1:].contiguous(), scale)

    def one_grid() -> None:
        kernels.paged_extend_attention(
            q, k_cache, v_cache, tables, starts, lens, scale, chunk, out=one_grid_out
        )

    def two_launches() -> None:
        kernels.paged_extend_attention(*chunk_args, out=two_launch_out[:chunk])
        kernels.paged_decode_attention(*decode_args, out=two_launch_out[chunk:])

    row = {
        "model": shape.name,
        "chunk": chunk,
        "decodes": decodes,
        "decode_context": decode_context,
        **mixed_step_programs(q_lens, shape.num_heads, shape.num_kv_heads),
        "one_grid_ms": timer(one_grid),
        "extend_plus_decode_ms": timer(two_launches),
    }
    ref = reference.paged_extend_attention_ref(q, k_cache, v_cache, tables, starts, lens, scale, chunk)
    row["max_error"] = max(
        float((out.float() - ref.float()).abs().max()) for out in (one_grid_out, two_launch_out)
    )
    return row


def time_fused(
    layer: tuple[int, int, int, int, int], tokens: int, timer: Timer, device: str = "cuda"
) -> dict[str, Any]:
    """Each fused layer against the PyTorch ops it replaces; ``layer`` is (hidden, heads, kv heads,
    head_dim, intermediate), bf16."""
    hidden, num_heads, num_kv_heads, head_dim, intermediate = layer
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(tokens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    x, residual, weight = randn(tokens, hidden), randn(tokens, hidden), randn(hidden)
    freqs = torch.randn(8192, head_dim // 2, generator=gen, device=device)
    cos, sin = torch.cat((freqs.cos(), freqs.cos()), -1), torch.cat((-freqs.sin(), freqs.sin()), -1)
    qk = randn(tokens, num_heads + num_kv_heads, head_dim)
    positions = torch.randint(0, 8192, (tokens,), generator=gen, device=device)
    gate_up = randn(tokens, 2 * intermediate)

    def torch_norm() -> None:
        h = x + residual
        torch.nn.functional.rms_norm(h, (hidden,), weight, 1e-5)

    def torch_rotary() -> None:  # the engine's own fallback, cos/sin rows looked up in the step
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        xf = qk.float()
        rotated = torch.cat((xf[..., head_dim // 2 :], xf[..., : head_dim // 2]), dim=-1)
        (xf * c + rotated * s).to(dtype)

    def torch_silu() -> None:
        gate, up = gate_up.chunk(2, dim=-1)
        torch.nn.functional.silu(gate) * up

    pairs = {
        "add_rms_norm": (lambda: kernels.add_rms_norm(x, residual, weight, 1e-5), torch_norm),
        "rotary_embedding_": (lambda: kernels.rotary_embedding_(qk, positions, cos, sin), torch_rotary),
        "silu_and_mul": (lambda: kernels.silu_and_mul(gate_up), torch_silu),
    }
    row: dict[str, Any] = {"tokens": tokens}
    for name, (fused, eager) in pairs.items():
        row[f"{name}_triton_ms"] = timer(fused)
        row[f"{name}_torch_ms"] = timer(eager)
    return row


def time_linear(
    name: str,
    in_features: int,
    out_features: int,
    rows: int,
    timer: Timer,
    copy_gbps: float,
    device: str = "cuda",
) -> dict[str, Any]:
    """Quantized matmuls against cuBLAS on the dense bf16 weight of the same shape."""
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(rows * 7 + in_features)
    x = torch.randn(rows, in_features, generator=gen, device=device).to(dtype)
    dense = torch.randn(out_features, in_features, generator=gen, device=device).to(dtype)
    row: dict[str, Any] = {
        "name": name,
        "in_features": in_features,
        "out_features": out_features,
        "rows": rows,
        "dense_ms": timer(lambda: torch.nn.functional.linear(x, dense)),
        "dense_bytes": dense.numel() * dense.element_size(),
        "quantized_ms": {},
        "quantized_bytes": {},
    }
    for fmt in formats_for(in_features):
        packed = quantized_linear.pack(random_quantized(fmt, out_features, in_features, gen, device), dtype)
        row["quantized_ms"][fmt] = timer(lambda p=packed: quantized_linear.linear(x, p))
        row["quantized_bytes"][fmt] = packed.nbytes
    if rows == 1:  # decode: every weight byte read once
        row["dense_bw_share"] = gbps(row["dense_bytes"], row["dense_ms"]) / copy_gbps
        row["quantized_bw_share"] = {
            fmt: gbps(row["quantized_bytes"][fmt], ms) / copy_gbps for fmt, ms in row["quantized_ms"].items()
        }
    return row


def run_checks(device: str) -> list[dict[str, Any]]:
    """Production shapes: ragged lengths around block boundaries, up to a few thousand tokens; the layers
    of SmolLM2-135M (576 hidden, 1536 intermediate) and Llama-8B."""
    seq_lens = [1, 15, 16, 17, 255, 256, 257, 1000, 2048, 3333]
    chunk_lens = [1, 15, 1, 17, 128, 200, 7, 513, 1, 64]
    checks = [
        check_kernels(shape, seq_lens, chunk_lens, block_size, torch.bfloat16, device, seed=i)
        for i, (shape, block_size) in enumerate((s, bs) for s in MODELS for bs in (16, 32))
    ]
    smollm2 = check_layers(576, 9, 3, 64, 1536, 37, [(576, 960), (1536, 576)], [1, 3, 16, 70], device)
    llama = check_layers(*LLAMA_8B_LAYER, 300, [(k, n) for _, k, n in LINEAR_SHAPES], [1, 256], device)
    return [*checks, {"model": "smollm2-135m layers", **smollm2}, {"model": "llama-8b layers", **llama}]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    checks = run_checks("cuda")
    for check in checks:
        status = "FAILED " + ", ".join(check["failed"]) if check["failed"] else "ok"
        print(f"check {check['model']} {check.get('block_size', '')}: {status}  {check['errors']}")

    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # larger than any L2 today
    copy_gbps = copy_bandwidth_gbps(flush)
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s")
    timer = functools.partial(cuda_median_ms, iters=args.iters, flush=flush, graph=True)
    batches, contexts = ((1, 64), (1024, 8192)) if args.quick else (BATCHES, CONTEXTS)
    rows = []
    for shape in MODELS:
        for batch, context in decode_grid(batches, contexts, args.max_tokens):
            rows.append(time_decode(shape, batch, context, timer, copy_gbps))
            torch.cuda.empty_cache()
    print(format_table(rows))

    mixed = time_mixed_step(MODELS[1], MIXED_CHUNK, MIXED_DECODES, MIXED_DECODE_CONTEXT, timer)
    torch.cuda.empty_cache()
    print(f"mixed step: {mixed}")
    fused = [time_fused(LLAMA_8B_LAYER, tokens, timer) for tokens in FUSED_TOKENS]
    for row in fused:
        print(f"fused: {row}")
    linear_rows = (1, 256) if args.quick else LINEAR_ROWS
    linear = [
        time_linear(name, k, n, rows, timer, copy_gbps)
        for name, k, n in LINEAR_SHAPES
        for rows in linear_rows
    ]
    print(format_linear_table(linear))

    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": "bfloat16",
        "timing": "CUDA graph replays where a call can be captured, else eager calls",
        "block_size": BLOCK_SIZE,
        "copy_bandwidth_gbps": copy_gbps,
        "checks": checks,
        "decode": rows,
        "mixed_step": mixed,
        "fused": fused,
        "linear": linear,
    }
    write_json(args.out, results)
    plot_results(args.out.with_suffix(".png"), rows)
    linear_png = args.out.with_name(args.out.stem + "_linear.png")
    plot_linear(linear_png, linear)
    print(f"wrote {args.out}, {args.out.with_suffix('.png')} and {linear_png}")
    if not args.skip_throughput:
        import subprocess

        command = [sys.executable, "-m", "benchmarks.offline_throughput", "--device", "cuda"]
        subprocess.run([*command, "--out", str(args.out.parent)], cwd=REPO_ROOT, check=True)
    attention_ok = mixed["max_error"] <= TOLERANCE[torch.bfloat16]  # False on NaN too
    return 1 if any(check["failed"] for check in checks) or not attention_ok else 0


if __name__ == "__main__":
    sys.exit(main())
