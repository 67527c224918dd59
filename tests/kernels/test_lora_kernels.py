"""The batched LoRA kernels (native CPU, Triton) against `lora_ref`, on fresh random inputs: ranks 1, 8 and
64 (slots of smaller ranks padded with zeros to the largest), rows 1 to 300, 1 to 8 adapters in a step, rows
in random order of adapters and some with none (slot -1). Slots no row uses hold NaN, so a kernel that reads
them fails; `y` is a column slice of a wider output whose other columns must stay as they were."""

import pytest
import torch

from llmserve_kernels.cpu import available
from llmserve_kernels.cpu.lora import lora_add_ as cpu_lora_add_
from llmserve_kernels.reference import lora_ref

F32, BF16 = torch.float32, torch.bfloat16
IN, OUT = 72, 40  # not multiples of the Triton tiles: their masks are exercised
TOLERANCE = {F32: {"atol": 1e-4, "rtol": 1e-4}, BF16: {"atol": 2e-2, "rtol": 2e-2}}
MAX_SLOTS = 8


def _problem(gen, rows, adapters, rank, dtype, device="cpu", in_features=IN, out_features=OUT):
    """(y_wide, x, lora_a, lora_b, slots, scales): `adapters` of MAX_SLOTS slots in use, each of its own rank
    up to `rank`; about one row in five without an adapter."""
    used = torch.randperm(MAX_SLOTS, generator=gen)[:adapters]
    a = torch.full((MAX_SLOTS, rank, in_features), float("nan"))
    b = torch.full((MAX_SLOTS, out_features, rank), float("nan"))
    for i, s in enumerate(used.tolist()):
        r = rank if i == 0 else int(torch.randint(1, rank + 1, (1,), generator=gen))
        a[s], b[s] = 0.0, 0.0
        a[s, :r] = torch.randn(r, in_features, generator=gen) * in_features**-0.5
        b[s, :, :r] = torch.randn(out_features, r, generator=gen) * r**-0.5
    slots = used[torch.randint(0, adapters, (rows,), generator=gen)]
    slots[torch.rand(rows, generator=gen) < 0.2] = -1
    x = torch.randn(rows, in_features, generator=gen)
    y_wide = torch.randn(rows, out_features + 24, generator=gen)
    scales = torch.rand(MAX_SLOTS, generator=gen) * 2
    tensors = (y_wide.to(dtype), x.to(dtype), a.to(dtype), b.to(dtype), slots.to(torch.int32), scales)
    return [t.to(device) for t in tensors]


def _run_and_check(kernel, problem):
    y_wide, x, a, b, slots, scales = problem
    ref_wide = y_wide.clone()
    lora_ref(ref_wide[:, 8 : 8 + OUT], x, a, b, slots, scales)
    assert not ref_wide.isnan().any()
    out_wide = y_wide.clone()
    kernel(out_wide[:, 8 : 8 + OUT], x, a, b, slots, scales)
    assert not out_wide.isnan().any()
    torch.testing.assert_close(out_wide.float().cpu(), ref_wide.float().cpu(), **TOLERANCE[y_wide.dtype])
    assert torch.equal(out_wide[:, :8], y_wide[:, :8]) and torch.equal(
        out_wide[:, 8 + OUT :], y_wide[:, 8 + OUT :]
    )
    with_adapter = slots >= 0
    assert torch.equal(out_wide[~with_adapter], y_wide[~with_adapter]), "a row without an adapter changed"


def test_reference_is_the_merged_weight(gen):
    """lora_ref's update is the one of the merged weight W + scale * B @ A, row by row."""
    _, x, a, b, slots, scales = _problem(gen, 7, 3, 8, F32)
    out = torch.randn(7, OUT, generator=gen)
    expected = out.clone()
    for t in range(7):
        s = int(slots[t])
        if s >= 0:
            expected[t] += x[t] @ (scales[s] * b[s] @ a[s]).T
    lora_ref(out, x, a, b, slots, scales)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not available(), reason="no C compiler for the CPU kernels")
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("rank", [1, 8, 64])
@pytest.mark.parametrize("adapters", [1, 3, 8])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_cpu_lora_matches_reference(gen, rows, adapters, rank, dtype):
    _run_and_check(cpu_lora_add_, _problem(gen, rows, adapters, rank, dtype))


@pytest.mark.skipif(not available(), reason="no C compiler for the CPU kernels")
def test_cpu_lora_no_row_has_an_adapter(gen):
    y, x, a, b, slots, scales = _problem(gen, 5, 2, 8, BF16)
    before = y.clone()
    assert cpu_lora_add_(y[:, :OUT], x, a, b, torch.full_like(slots, -1), scales)
    assert torch.equal(y, before)


def _fast_on_interpreter(rows: int, adapters: int, rank: int) -> bool:
    """The interpreter runs each program in Python: small shapes (and one of 300 rows) run in the suite, the
    rest with `-m slow`."""
    return rows <= 7 or (rows, adapters, rank) == (300, 8, 8)


TRITON_CASES = [
    pytest.param(
        rows, adapters, rank, marks=() if _fast_on_interpreter(rows, adapters, rank) else pytest.mark.slow
    )
    for rows in (1, 7, 300)
    for adapters in (1, 3, 8)
    for rank in (1, 8, 64)
]


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize(("rows", "adapters", "rank"), TRITON_CASES)
def test_triton_lora_matches_reference(gen, device, rows, adapters, rank, dtype):
    from llmserve_kernels.triton.lora import lora_add_

    _run_and_check(lora_add_, _problem(gen, rows, adapters, rank, dtype, device))


def test_triton_lora_no_row_has_an_adapter(gen, device):
    from llmserve_kernels.triton.lora import lora_add_

    y, x, a, b, slots, scales = _problem(gen, 5, 2, 8, F32, device)
    before = y.clone()
    lora_add_(y[:, :OUT], x, a, b, torch.full_like(slots, -1), scales)
    assert torch.equal(y, before)
