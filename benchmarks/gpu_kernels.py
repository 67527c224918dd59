"""Check the Triton kernels at production shapes and measure paged decode attention on a CUDA GPU.

1. Every kernel is compared with its PyTorch reference (SmolLM2-135M and Llama-8B attention shapes, bf16).
2. The decode kernel is timed with CUDA events (median, L2 flushed before each run) for batch 1..256 and
   contexts 128..8192; the K+V bytes it must read give its bandwidth, reported as a share of the device's
   measured copy bandwidth, because decode attention is bound by reading the cache.
3. The same problem is timed with ``torch.nn.functional.scaled_dot_product_attention`` over K/V that were
   gathered into contiguous tensors beforehand: a dense kernel that need not follow a block table.
4. The offline throughput benchmark (``benchmarks/offline_throughput.py``: our engine on the Triton backend
   against transformers static batching) runs on the GPU, unless ``--skip-throughput``.

Results go to a JSON file (``--out``) and a PNG plot beside it. The process exits with status 1 when a
correctness check fails.

    python benchmarks/gpu_kernels.py --out benchmarks/results/gpu_kernels.json
"""

import argparse
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

from kernels import reference  # noqa: E402
from kernels import triton as kernels  # noqa: E402
from kernels.triton.decode_attention import choose_num_splits  # noqa: E402


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


MODELS = (ModelShape("smollm2-135m", 9, 3, 64), ModelShape("llama-8b", 32, 8, 128))
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTEXTS = (128, 256, 512, 1024, 2048, 4096, 8192)
BLOCK_SIZE = 16
TOLERANCE = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 3e-2}


# ---------------------------------------------------------------------------------------------- pure parts


def decode_grid(batches: Iterable[int], contexts: Iterable[int], max_tokens: int) -> list[tuple[int, int]]:
    """(batch, context) points to time, skipping those whose cache would exceed ``max_tokens`` tokens."""
    return [(b, c) for b in batches for c in contexts if b * c <= max_tokens]


def decode_bytes(batch: int, context: int, num_kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """Bytes of K and V one decode step must read; q, the output and the block table are negligible."""
    return 2 * batch * context * num_kv_heads * head_dim * elem_bytes


def gbps(num_bytes: float, ms: float) -> float:
    return num_bytes / (ms * 1e-3) / 1e9


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


# ------------------------------------------------------------------------------------------ GPU timing


def cuda_median_ms(fn: Callable[[], object], iters: int, flush: torch.Tensor) -> float:
    """Median time of ``fn`` in ms with CUDA events; ``flush`` is rewritten before each run to empty L2."""
    for _ in range(3):
        fn()
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


def copy_bandwidth_gbps(flush: torch.Tensor, num_bytes: int = 4 << 30, iters: int = 10) -> float:
    """Device-to-device copy bandwidth (bytes read + bytes written per second) of a large buffer."""
    src = torch.empty(num_bytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_median_ms(lambda: dst.copy_(src), iters, flush)
    return gbps(2 * src.numel(), ms)


def time_decode(
    shape: ModelShape, batch: int, context: int, iters: int, flush: torch.Tensor, copy_gbps: float
) -> dict[str, Any]:
    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(batch * 100_003 + context)
    k_cache, v_cache, tables, lens = random_paged_kv(gen, shape, [context] * batch, BLOCK_SIZE, dtype, "cuda")
    q = torch.randn(batch, shape.num_heads, shape.head_dim, generator=gen, device="cuda").to(dtype)
    scale = 1 / math.sqrt(shape.head_dim)
    out = torch.empty_like(q)
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    num_splits = choose_num_splits(batch, shape.num_kv_heads, tables.shape[1] * BLOCK_SIZE, num_sms)

    def triton_decode(splits: int | None) -> Callable[[], object]:
        return lambda: kernels.paged_decode_attention(
            q, k_cache, v_cache, tables, lens, scale, splits, out=out
        )

    triton_ms = cuda_median_ms(triton_decode(None), iters, flush)
    one_split_ms = cuda_median_ms(triton_decode(1), iters, flush)

    # Dense baseline: K/V gathered to [batch, kv_heads, context, head_dim] before timing.
    def gather(cache: torch.Tensor) -> torch.Tensor:
        return cache[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()

    k_dense, v_dense = gather(k_cache), gather(v_cache)
    q_dense = q.unsqueeze(2)
    sdpa_ms = cuda_median_ms(
        lambda: torch.nn.functional.scaled_dot_product_attention(
            q_dense, k_dense, v_dense, scale=scale, enable_gqa=True
        ),
        iters,
        flush,
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


def run_checks(device: str) -> list[dict[str, Any]]:
    """Production shapes: ragged lengths around block boundaries, up to a few thousand tokens."""
    seq_lens = [1, 15, 16, 17, 255, 256, 257, 1000, 2048, 3333]
    chunk_lens = [1, 15, 1, 17, 128, 200, 7, 513, 1, 64]
    return [
        check_kernels(shape, seq_lens, chunk_lens, block_size, torch.bfloat16, device, seed=i)
        for i, (shape, block_size) in enumerate((s, bs) for s in MODELS for bs in (16, 32))
    ]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    checks = run_checks("cuda")
    for check in checks:
        status = "FAILED " + ", ".join(check["failed"]) if check["failed"] else "ok"
        print(f"check {check['model']} block_size={check['block_size']}: {status}  {check['errors']}")

    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # larger than any L2 today
    copy_gbps = copy_bandwidth_gbps(flush)
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s")
    batches, contexts = ((1, 64), (1024, 8192)) if args.quick else (BATCHES, CONTEXTS)
    rows = []
    for shape in MODELS:
        for batch, context in decode_grid(batches, contexts, args.max_tokens):
            rows.append(time_decode(shape, batch, context, args.iters, flush, copy_gbps))
            torch.cuda.empty_cache()
    print(format_table(rows))

    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": "bfloat16",
        "block_size": BLOCK_SIZE,
        "copy_bandwidth_gbps": copy_gbps,
        "checks": checks,
        "decode": rows,
    }
    write_json(args.out, results)
    plot_results(args.out.with_suffix(".png"), rows)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    if not args.skip_throughput:
        import subprocess

        command = [sys.executable, "-m", "benchmarks.offline_throughput", "--device", "cuda"]
        subprocess.run([*command, "--out", str(args.out.parent)], cwd=REPO_ROOT, check=True)
    return 1 if any(check["failed"] for check in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
