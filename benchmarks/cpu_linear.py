"""The CPU linear kernels against oneDNN and PyTorch's weight-only ops, in one run.

    .venv/bin/python -m benchmarks.cpu_linear [--threads 2] [--rounds 5] [--engine] [--out PATH]

1. The machine's memory bandwidth: a 512 MiB copy (bytes read + written) and a 512 MiB reduction (read).
2. Per weight shape of SmolLM2-135M (and its 49152 x 576 LM head), format and row count: our routines
   (kernels/cpu/linear.py), oneDNN's prepacked bf16 linear, and PyTorch's `_weight_int4pack_mm_for_cpu`
   (int4, groups of 32) and `_weight_int8pack_mm` (int8 per channel); µs per call and GB/s of weight
   bytes. Each routine cycles through enough copies of its weight (over 96 MB) that every call reads it
   from memory; routines are timed in turn, round after round, and the best round is kept.
3. The model's linear layers at batch 1 as one decode step would call them (30 layers of qkv, o,
   gate_up, down, then the LM head, each layer its own weights): bf16 through our kernel and through
   oneDNN, and Q4_1 layers with the Q8_0 tied head through our kernel, against the time to read those
   weights once at the measured read bandwidth.
4. With --engine, the bundled model through `inference_engine.LLM`: the batch-1 decode step with the GGUF
   file dequantized to bf16 (`quantization="none"`), then with its Q4_1 and Q8_0 tensors kept quantized (the
   engine's default for the file), and how many of 16 greedy completions of 32 tokens the two agree on.

Writes a JSON file and a PNG plot beside it (default benchmarks/results/cpu_linear.json).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from llmserve_kernels.cpu import linear as cpu_linear
from llmserve_kernels.cpu.huge_pages import on_huge_pages
from llmserve_kernels.quantized import Int4Weight, Int8Weight

BF16 = torch.bfloat16
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LM_HEAD = (49152, 576)
LAYERS = 30
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 32, 256)
STREAM_BYTES = 96 << 20  # weight copies per routine: beyond the 32 MiB L3 of the machines we run on


# -------------------------------------------------------------------------------------------- memory


def memory_bandwidth(size: int = 512 << 20) -> dict:
    """On huge pages, where the packed weights lie (they read faster there)."""
    src = on_huge_pages(torch.ones(size, dtype=torch.uint8))
    dst = on_huge_pages(torch.empty_like(src))
    words = src.view(torch.int64)
    copy, read = math.inf, math.inf
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        copy = min(copy, time.perf_counter() - t)
        t = time.perf_counter()
        words.sum()
        read = min(read, time.perf_counter() - t)
    return {"copy_gb_s": 2 * size / copy / 1e9, "read_gb_s": size / read / 1e9}


# -------------------------------------------------------------------------------------------- weights


def q4_1(n: int, k: int, gen: torch.Generator) -> Int4Weight:
    scale = (torch.rand(n, k // 32, generator=gen) / 8).half().float()
    offset = (-8 * scale).half().float()
    return Int4Weight(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8), scale, offset, 32)


def int8(n: int, k: int, group: int, gen: torch.Generator) -> Int8Weight:
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    return Int8Weight(q, (torch.rand(n, k // group, generator=gen) / 64).half().float(), group)


class TorchInt4:
    """PyTorch's int4 weight-only matmul: w = (q - 8) * scale + zero, scale and zero in bf16."""

    def __init__(self, weight: Int4Weight) -> None:
        self.group = weight.group_size
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.q.int(), 1)
        zero = weight.offset + 8 * weight.scale
        self.scales = torch.stack([weight.scale.T, zero.T], dim=-1).to(BF16).contiguous()
        self.nbytes = self.packed.numel() + self.scales.numel() * 2

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales)


class TorchInt8:
    """PyTorch's int8 weight-only matmul (per-channel scales only)."""

    def __init__(self, weight: Int8Weight) -> None:
        self.q, self.scales = weight.q, weight.scale[:, 0].to(BF16)
        self.nbytes = self.q.numel() + self.scales.numel() * 2

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scales)


def routines(fmt: str, shape: tuple[int, int], gen: torch.Generator) -> dict[str, Callable[[], object]]:
    """name -> a maker of one routine (a fresh copy of the weight each call) for a format and shape."""
    n, k = shape
    if fmt == "bf16":
        weight = torch.randn(n, k, generator=gen).to(BF16)
        return {
            "ours": lambda: cpu_linear._BF16Tiles(weight.clone()),
            "onednn": lambda: cpu_linear._OneDNN(weight.clone(), pad=False),
        }
    if fmt == "q4_1":
        weight = q4_1(n, k, gen)
        return {"ours": lambda: cpu_linear._QuantTiles(weight), "torch_int4pack": lambda: TorchInt4(weight)}
    if fmt == "q8_0":
        return {"ours": lambda: cpu_linear._QuantTiles(int8(n, k, 32, gen))}
    weight = int8(n, k, k, gen)  # int8 per channel
    return {"ours": lambda: cpu_linear._QuantTiles(weight), "torch_int8pack": lambda: TorchInt8(weight)}


def nbytes(routine) -> int:
    if isinstance(routine, cpu_linear._BF16Tiles):
        return routine.tiles.numel() * 2
    if isinstance(routine, cpu_linear._OneDNN):
        return routine.resident.numel() * 2
    if isinstance(routine, cpu_linear._QuantTiles):
        return sum(t.numel() * t.element_size() for t in routine.resident)
    return routine.nbytes


# ----------------------------------------------------------------------------------------------- grid


def time_round(copies: list, x: torch.Tensor, calls: int) -> float:
    """Seconds per call over `calls` calls cycling through the copies."""
    start = time.perf_counter()
    for i in range(calls):
        copies[i % len(copies)](x, None)
    return (time.perf_counter() - start) / calls


def kernel_grid(rounds: int, rows_list: tuple[int, ...]) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    cases = [(name, shape, fmt) for name, shape in SHAPES.items() for fmt in ("bf16", "q4_1", "int8_channel")]
    cases += [("lm_head", LM_HEAD, fmt) for fmt in ("bf16", "q8_0", "int8_channel")]
    results = []
    for name, shape, fmt in cases:
        made = {}
        for routine, make in routines(fmt, shape, gen).items():
            first = make()
            size = nbytes(first)
            made[routine] = ([first] + [make() for _ in range(max(1, STREAM_BYTES // size) - 1)], size)
        for rows in rows_list:
            x = torch.randn(rows, shape[1], generator=gen).to(BF16)
            best = {routine: math.inf for routine in made}
            for _ in range(rounds):
                for routine, (copies, _) in made.items():
                    calls = len(copies) if rows <= 8 else min(len(copies), 8)
                    best[routine] = min(best[routine], time_round(copies, x, calls))
            for routine, seconds in best.items():
                size = made[routine][1]
                results.append(
                    {
                        "layer": name,
                        "shape": list(shape),
                        "format": fmt,
                        "routine": routine,
                        "rows": rows,
                        "us": seconds * 1e6,
                        "weight_bytes": size,
                        "gb_s": size / seconds / 1e9,
                    }
                )
                print(
                    f"{name:8s} {fmt:12s} {routine:15s} rows {rows:3d}: {seconds * 1e6:9.1f} us "
                    f"{size / seconds / 1e9:6.1f} GB/s",
                    flush=True,
                )
        del made
    return results


# --------------------------------------------------------------------------------- decode-step sequence


def decode_sequence(rounds: int, read_gb_s: float) -> dict:
    """The 121 linear calls of one batch-1 decode step, each layer with its own weights."""
    gen = torch.Generator().manual_seed(1)
    dense = {name: torch.randn(*shape, generator=gen).to(BF16) for name, shape in SHAPES.items()}
    head = torch.randn(*LM_HEAD, generator=gen).to(BF16)
    quant = {name: q4_1(*shape, gen) for name, shape in SHAPES.items()}
    steps = {
        "bf16_ours": [cpu_linear._BF16Tiles(dense[n].clone()) for _ in range(LAYERS) for n in SHAPES]
        + [cpu_linear._BF16Tiles(head)],
        "bf16_onednn": [
            cpu_linear._OneDNN(dense[n].clone(), pad=False) for _ in range(LAYERS) for n in SHAPES
        ]
        + [cpu_linear._OneDNN(head, pad=False)],
        "q4_1_ours": [cpu_linear._QuantTiles(quant[n]) for _ in range(LAYERS) for n in SHAPES]
        + [cpu_linear._QuantTiles(int8(*LM_HEAD, 32, gen))],
    }
    inputs = [torch.randn(1, r.k, generator=gen).to(BF16) for r in steps["bf16_ours"]]
    best = {name: math.inf for name in steps}
    for _ in range(rounds):
        for name, calls in steps.items():
            start = time.perf_counter()
            for routine, x in zip(calls, inputs, strict=True):
                routine(x, None)
            best[name] = min(best[name], time.perf_counter() - start)
    result = {}
    for name, calls in steps.items():
        weight_bytes = sum(nbytes(r) for r in calls)
        result[name] = {
            "ms": best[name] * 1e3,
            "weight_bytes": weight_bytes,
            "read_floor_ms": weight_bytes / (read_gb_s * 1e9) * 1e3,
        }
        print(
            f"decode step, linear layers only, {name}: {best[name] * 1e3:.2f} ms "
            f"({weight_bytes / 1e6:.0f} MB)"
        )
    return result


# ------------------------------------------------------------------------------------------- engine


def engine_decode() -> dict:
    from benchmarks.offline_throughput import decode_step_vs_floor
    from inference_engine import LLM, SamplingParams

    prompts = [f"Write one sentence about the number {i}." for i in range(16)]
    greedy = SamplingParams(temperature=0, max_tokens=32)
    result, outputs = {}, {}
    # The bundled file dequantized to dense bf16, then kept quantized (its Q4_1 layers and Q8_0 head).
    for name, quantization in (("bf16", "none"), ("q4_1", None)):
        llm = LLM(dtype="bfloat16", quantization=quantization)
        result[name] = decode_step_vs_floor(llm)
        outputs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        del llm
    pairs = zip(outputs["bf16"], outputs["q4_1"], strict=True)
    result["greedy_identical_of_16"] = sum(a == b for a, b in pairs)
    for name in ("bf16", "q4_1"):
        r = result[name]
        print(
            f"engine decode step at batch 1, {name}: {r['decode_step_ms']:.2f} ms; weights "
            f"{r['weight_bytes'] / 1e6:.0f} MB, read floor {r['weight_read_floor_ms']:.2f} ms"
        )
    print(f"greedy completions identical, Q4_1 vs bf16: {result['greedy_identical_of_16']} of 16")
    return result


# --------------------------------------------------------------------------------------------- output


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [*SHAPES, "lm_head"]
    labels = sorted({f"{row['format']} {row['routine']}" for row in result["grid"]})
    colors = dict(zip(labels, plt.cm.tab10.colors, strict=False))
    fig, axes = plt.subplots(1, len(layers), figsize=(4.2 * len(layers), 4.4), sharey=True)
    for ax, layer in zip(axes, layers, strict=True):
        for label in labels:
            points = [
                (row["rows"], row["gb_s"])
                for row in result["grid"]
                if row["layer"] == layer and f"{row['format']} {row['routine']}" == label
            ]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", color=colors[label], label=label)
        ax.axhline(result["memory"]["read_gb_s"], color="grey", linestyle="--", label="memory read")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{layer} {list(SHAPES.get(layer, LM_HEAD))}")
        ax.set_xlabel("rows")
    axes[0].set_ylabel("GB/s of weight bytes")
    handles = {h.get_label(): h for ax in axes for h in ax.get_lines()}
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=len(handles), fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--engine", action="store_true", help="also time the bundled model's decode step")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_linear.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = {
        "machine": {"cpu": cpu_linear_cpu(), "threads": args.threads, "python": platform.python_version()},
        "native": {"bf16": cpu_linear.native_bf16(), "vnni": cpu_linear.native_quant()},
        "memory": memory_bandwidth(),
    }
    print(
        f"memory: copy {result['memory']['copy_gb_s']:.1f} GB/s, "
        f"read {result['memory']['read_gb_s']:.1f} GB/s"
    )
    result["grid"] = kernel_grid(args.rounds, tuple(int(r) for r in args.rows.split(",")))
    result["decode_sequence"] = decode_sequence(args.rounds, result["memory"]["read_gb_s"])
    if args.engine:
        result["engine"] = engine_decode()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def cpu_linear_cpu() -> str:
    from llmserve_kernels.cpu._build import _cpu_model

    return _cpu_model().split(":", 1)[-1].strip()


if __name__ == "__main__":
    main()
