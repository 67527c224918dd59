"""The CPU-side logic of benchmarks/gpu_kernels.py: grid, byte counts, table, JSON, plot and the checks."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_kernels.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_kernels_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(model: str, batch: int, context: int) -> dict:
    return {
        "model": model,
        "batch": batch,
        "context": context,
        "num_splits": 4,
        "bytes": 1 << 20,
        "triton_ms": 0.0125,
        "triton_gbps": 3900.0,
        "triton_bw_share": 0.82,
        "triton_one_split_ms": 0.05,
        "sdpa_ms": 0.025,
        "sdpa_gbps": 1950.0,
        "sdpa_bw_share": 0.41,
        "sdpa_over_triton": 2.0,
    }


def test_grid_covers_the_brief_and_respects_the_token_budget(bench):
    full = bench.decode_grid(bench.BATCHES, bench.CONTEXTS, max_tokens=256 * 8192)
    assert (1, 128) in full and (256, 8192) in full
    assert len(full) == len(bench.BATCHES) * len(bench.CONTEXTS)
    small = bench.decode_grid([1, 64, 256], [128, 8192], max_tokens=64 * 8192)
    assert small == [(1, 128), (1, 8192), (64, 128), (64, 8192), (256, 128)]


def test_decode_bytes_counts_k_and_v(bench):
    # Llama-8B: 8 kv heads x 128 dims x 2 bytes = 2 KiB per token for K, the same for V.
    assert (
        bench.decode_bytes(batch=2, context=1000, num_kv_heads=8, head_dim=128, elem_bytes=2)
        == 2000 * 4096  # 2000 tokens x 4 KiB
    )
    assert bench.gbps(num_bytes=4e9, ms=1.0) == pytest.approx(4000.0)


def test_table_json_and_plot(bench, tmp_path):
    rows = [_row(m, b, c) for m in ("a", "b") for b in (1, 8) for c in (128, 1024)]
    table = bench.format_table(rows).splitlines()
    assert len(table) == 1 + len(rows)
    assert table[0].split()[:3] == ["model", "batch", "context"]
    assert "12.5" in table[1] and "82%" in table[1]  # 0.0125 ms shown in us; share as a percentage

    out = tmp_path / "nested" / "result.json"
    bench.write_json(out, {"decode": rows})
    assert json.loads(out.read_text())["decode"] == rows

    pytest.importorskip("matplotlib")
    png = tmp_path / "plot.png"
    bench.plot_results(png, rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_parse_args(bench, tmp_path):
    args = bench.parse_args(["--out", str(tmp_path / "r.json"), "--quick"])
    assert args.quick and args.iters > 0 and args.out == tmp_path / "r.json"


def test_correctness_checks_run_and_pass(bench, device):
    """The checks the script runs on the GPU, at a tiny shape (under the interpreter on CPU)."""
    shape = bench.ModelShape("tiny", num_heads=6, num_kv_heads=2, head_dim=64)
    result = bench.check_kernels(
        shape, [1, 17, 40], [1, 5, 40], block_size=8, dtype=torch.bfloat16, device=device
    )
    assert result["failed"] == [], result["errors"]
    assert set(result["errors"]) == {
        "store_kvcache",
        "paged_decode_attention(num_splits=1)",
        "paged_decode_attention(num_splits=None)",
        "paged_extend_attention",
    }


def test_layer_checks_run_and_pass(bench, device):
    """The fused layers and each quantized format the script checks on the GPU, at tiny shapes (under the
    interpreter on CPU); 96 inputs take the group-32 and int8 formats only."""
    result = bench.check_layers(64, 4, 2, 16, 128, 5, [(128, 48), (96, 32)], [1, 3], device)
    assert result["failed"] == [], result["errors"]
    assert {"add_rms_norm", "rms_norm", "rotary_embedding_", "silu_and_mul"} <= set(result["errors"])
    assert sum(name.startswith("linear int4-g128 128->48") for name in result["errors"]) == 2
    assert not any(name.startswith("linear int4-g128 96") for name in result["errors"])
    assert sum(name.startswith("linear int4-g32 96->32") for name in result["errors"]) == 2


def test_mixed_step_programs_of_the_issue(bench):
    """One 1,793-token chunk beside 255 decodes on Llama-8B heads: the grid before and after."""
    counts = bench.mixed_step_programs([1793] + [1] * 255, num_heads=32, num_kv_heads=8)
    assert counts == {
        "block_q": 16,
        "programs": 3_072,
        "programs_longest_chunk_grid": 231_424,
        "working_programs": 2_944,
    }


def _time_once(fn) -> float:
    """Stands in for CUDA events: runs the function once, so the timing code runs on the CPU."""
    fn()
    return 0.5


def test_timed_parts_run_and_agree_with_references(bench, device):
    """The mixed-step, fused and quantized-matmul timings at tiny shapes (the interpreter on CPU)."""
    shape = bench.ModelShape("tiny", num_heads=4, num_kv_heads=2, head_dim=16)
    mixed = bench.time_mixed_step(
        shape, chunk=70, decodes=5, decode_context=30, timer=_time_once, device=device
    )
    assert mixed["one_grid_ms"] == mixed["extend_plus_decode_ms"] == 0.5
    assert mixed["programs"] < mixed["programs_longest_chunk_grid"]
    assert mixed["max_error"] <= bench.TOLERANCE[torch.bfloat16]

    fused = bench.time_fused((64, 4, 2, 16, 96), tokens=3, timer=_time_once, device=device)
    assert set(fused) == {"tokens"} | {
        f"{name}_{impl}_ms"
        for name in ("add_rms_norm", "rotary_embedding_", "silu_and_mul")
        for impl in ("triton", "torch")
    }

    row = bench.time_linear("tiny", 128, 96, rows=1, timer=_time_once, copy_gbps=1000.0, device=device)
    assert set(row["quantized_ms"]) == set(bench.QUANTIZED_FORMATS)
    assert row["quantized_bytes"]["int4-g128"] < row["quantized_bytes"]["int8"] < row["dense_bytes"]
    assert row["quantized_bw_share"]["int4-g128"] == pytest.approx(
        bench.gbps(row["quantized_bytes"]["int4-g128"], 0.5) / 1000.0
    )

    decode = bench.time_decode(shape, batch=2, context=40, timer=_time_once, copy_gbps=1000.0, device=device)
    assert decode["bytes"] == bench.decode_bytes(2, 40, 2, 16, 2)


def test_random_quantized_formats(bench, gen):
    for fmt, bits, group in (("int4-g128", 4, 128), ("int4-g32", 4, 32), ("int8", 8, 256)):
        weight = bench.random_quantized(fmt, 8, 256, gen, "cpu")
        assert (weight.bits, weight.group_size, weight.shape) == (bits, group, (8, 256))
    gguf = bench.random_quantized("int4-g32", 8, 256, gen, "cpu")
    assert torch.equal(gguf.scale.half().float(), gguf.scale)  # fp16 d, as GGUF stores it


def test_linear_table_and_plot(bench, tmp_path):
    rows = [
        {
            "name": name,
            "in_features": 4096,
            "out_features": 4096,
            "rows": m,
            "dense_ms": 0.02,
            "quantized_ms": {"int4-g128": 0.01, "int8": 0.04},
        }
        for name in ("qkv", "o")
        for m in (1, 256)
    ]
    table = bench.format_linear_table(rows).splitlines()
    assert len(table) == 1 + len(rows)
    assert table[0].split()[:4] == ["shape", "rows", "dense", "us"]
    assert table[1].split()[-2:] == ["2.00", "0.50"]  # dense time over each format's

    pytest.importorskip("matplotlib")
    png = tmp_path / "linear.png"
    bench.plot_linear(png, rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
