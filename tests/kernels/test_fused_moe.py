"""The fused mixture-of-experts kernels (native CPU, Triton) against `fused_moe_ref`, on fresh random inputs:
token counts 1 to 300, 8 and 64 experts, top-1/2/8. Experts that no token chose hold NaN weights, so a kernel
that reads them (or lets them into a sum) fails; with 64 experts and few tokens most experts are such."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmserve_kernels.cpu import available
from llmserve_kernels.cpu.moe import fused_moe as cpu_fused_moe
from llmserve_kernels.reference import fused_moe_ref

F32, BF16 = torch.float32, torch.bfloat16
HIDDEN, INTER = 64, 48  # not multiples of the Triton tiles: their masks are exercised
TOLERANCE = {F32: {"atol": 1e-4, "rtol": 1e-4}, BF16: {"atol": 2e-2, "rtol": 2e-2}}


def _problem(gen, tokens, experts, top_k, dtype, device="cpu", hidden=HIDDEN, inter=INTER):
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    topk_weights, topk_ids = torch.rand(tokens, experts, generator=gen).softmax(-1).topk(top_k, dim=-1)
    unused = torch.ones(experts, dtype=torch.bool)
    unused[topk_ids.flatten()] = False
    w13[unused], w2[unused] = float("nan"), float("nan")
    tensors = (x.to(dtype), w13.to(dtype), w2.to(dtype), topk_weights, topk_ids)
    return [t.to(device) for t in tensors]


def _check(out, ref):
    assert not out.isnan().any()
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), **TOLERANCE[ref.dtype])


@pytest.mark.skipif(not available(), reason="no C compiler for the CPU kernels")
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("experts", [8, 64])
@pytest.mark.parametrize("tokens", [1, 3, 17, 64, 300])
def test_cpu_fused_moe_matches_reference(gen, tokens, experts, top_k, dtype):
    problem = _problem(gen, tokens, experts, top_k, dtype)
    ref = fused_moe_ref(*problem)
    assert not ref.isnan().any()
    _check(cpu_fused_moe(*problem), ref)


@pytest.mark.skipif(not available(), reason="no C compiler for the CPU kernels")
def test_cpu_fused_moe_one_expert_takes_every_token(gen):
    """Every token routed to the same two experts: the other six own no pair and hold NaN."""
    x, w13, w2, weights, _ = _problem(gen, 40, 8, 2, BF16)
    ids = torch.tensor([[5, 2]] * 40)
    w13[[0, 1, 3, 4, 6, 7]] = float("nan")
    _check(cpu_fused_moe(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids))


@pytest.mark.skipif(not available(), reason="no C compiler for the CPU kernels")
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k"), [(1, 8, 2), (3, 64, 8), (17, 8, 1), (64, 64, 2), (300, 8, 2)]
)
@pytest.mark.parametrize(("group13", "group2"), [(32, 32), (64, 96)])
def test_cpu_fused_moe_int8_experts_match_reference(gen, tokens, experts, top_k, dtype, group13, group2):
    """int8 experts with a scale per group of inputs (32: GGUF's Q8_0; one per row: the engine's int8),
    against the reference on their dequantized values: decode-sized groups read them as stored, larger
    ones widen each block first."""
    x, _, _, weights, ids = _problem(gen, tokens, experts, top_k, dtype)
    hidden, inter = 64, 96
    q13 = torch.randint(-127, 128, (experts, 2 * inter, hidden), generator=gen, dtype=torch.int8)
    q2 = torch.randint(-127, 128, (experts, hidden, inter), generator=gen, dtype=torch.int8)
    s13 = torch.rand(experts, 2 * inter, hidden // group13, generator=gen) / 127 / hidden**0.5
    s2 = torch.rand(experts, hidden, inter // group2, generator=gen) / 127 / inter**0.5
    out = cpu_fused_moe(x, q13, q2, weights, ids, scales=(s13, s2))
    w13 = q13.float() * s13.repeat_interleave(group13, -1)
    w2 = q2.float() * s2.repeat_interleave(group2, -1)
    _check(out, fused_moe_ref(x, w13, w2, weights, ids))


def _fast_on_interpreter(tokens: int, experts: int, top_k: int) -> bool:
    """The interpreter runs each program in Python: the shapes under half a second run in the suite (300
    tokens among them), the rest with `-m slow`."""
    return tokens * top_k * (experts // 8) <= 64 or (tokens, experts, top_k) == (300, 8, 2)


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k"),
    [
        pytest.param(t, e, k, marks=[] if _fast_on_interpreter(t, e, k) else [pytest.mark.slow])
        for t in (1, 3, 17, 64, 300)
        for e in (8, 64)
        for k in (1, 2, 8)
    ],
)
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_triton_fused_moe_matches_reference(gen, device, tokens, experts, top_k, dtype):
    from llmserve_kernels.triton.fused_moe import fused_moe

    problem = _problem(gen, tokens, experts, top_k, dtype, device)
    _check(fused_moe(*problem), fused_moe_ref(*problem))


def test_triton_pairs_are_sorted_and_block_aligned(device):
    from llmserve_kernels.triton._common import group_rows

    ids = torch.tensor([[3, 0], [3, 1], [0, 3]], device=device)
    sorted_pairs, block_expert = group_rows(ids, num_groups=4, block_m=2)
    pad = 6
    assert sorted_pairs.tolist() == [1, 4, 3, pad, 0, 2, 5, pad]  # experts 0, 1, 3; expert 2 owns no block
    assert block_expert.tolist() == [0, 1, 3, 3]
    # rows without a group (-1, LoRA's rows without an adapter) are left out
    rows, block_slot = group_rows(torch.tensor([1, -1, 1, 0], device=device), num_groups=2, block_m=2)
    assert rows.tolist() == [3, 4, 0, 2] and block_slot.tolist() == [0, 1]


_COMPILE = """
import torch
from llmserve_kernels.triton.compile_check import check
from llmserve_kernels.triton.fused_moe import fused_moe

def case(tokens, experts, top_k, hidden, inter, dtype):
    def launch():
        x = torch.randn(tokens, hidden).to(dtype)
        w13 = torch.empty(experts, 2 * inter, hidden, dtype=dtype)
        w2 = torch.empty(experts, hidden, inter, dtype=dtype)
        weights, ids = torch.rand(tokens, experts).topk(top_k)
        fused_moe(x, w13, w2, weights, ids)
    return launch

# Qwen3-30B-A3B's experts at decode and prefill sizes (both row blocks), and fp32
print("\\n".join(check([
    ("bf16 T=1", case(1, 128, 8, 2048, 768, torch.bfloat16)),
    ("bf16 T=4096", case(4096, 128, 8, 2048, 768, torch.bfloat16)),
    ("fp32 T=64", case(64, 8, 2, 1024, 512, torch.float32)),
])))
"""


def test_triton_fused_moe_compiles_for_sm90_without_spills():
    """The interpreter cannot tell whether the kernels compile for the GPU: `compile_check` compiles them
    through the launcher for sm_90 with Triton's bundled ptxas, in a process without TRITON_INTERPRET."""
    triton = pytest.importorskip("triton")
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (tools / "ptxas").exists() or not (tools / "cuobjdump").exists():
        pytest.skip("this Triton build bundles no CUDA ptxas / cuobjdump")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert len(lines) == 6 and all(line.startswith("ok") for line in lines), run.stdout
