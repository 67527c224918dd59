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
