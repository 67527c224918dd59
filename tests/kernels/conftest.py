"""Shared fixtures for the kernel tests: the device to run on and a random paged KV-cache builder.

Triton kernels run natively on CUDA or, on CPU, under Triton's interpreter, which must be switched on by
exporting ``TRITON_INTERPRET=1`` before Python starts (it is read when triton is imported).
"""

import os
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch

TOLERANCES = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """The test machines are small and shared; more threads only make the interpreter slower.

    Scoped to these tests (and restored) so that other test folders keep their own thread settings.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def device() -> str:
    """``cpu`` under the interpreter, else ``cuda``; skips when Triton has nowhere to run."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("Triton kernels need CUDA, or TRITON_INTERPRET=1 exported before Python starts")


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A generator seeded from the test id: reproducible, yet different data for every case."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@dataclass
class PagedKV:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [batch, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [batch]


def build_paged_kv(
    gen: torch.Generator,
    seq_lens: Sequence[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    pad: int | None = None,
) -> PagedKV:
    """Random K/V for each sequence, scattered over shuffled physical blocks.

    Every cache position that belongs to no sequence holds NaN, and the block tables are padded with
    ``pad`` or, when ``pad`` is None, with an all-NaN block: a kernel that reads past a sequence's end
    produces NaN and fails the comparison.
    """
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 2  # one all-NaN padding block and one never referenced
    perm = torch.randperm(num_blocks, generator=gen)
    pad_value = int(perm[-1]) if pad is None else pad
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.full(shape, float("nan")), torch.full(shape, float("nan"))]
    block_tables = torch.full((len(seq_lens), max(blocks) + 2), pad_value, dtype=torch.int32)
    first = 0
    for b, (length, n) in enumerate(zip(seq_lens, blocks, strict=True)):
        ids = perm[first : first + n]
        first += n
        block_tables[b, :n] = ids.to(torch.int32)
        for cache in caches:
            values = torch.randn(n * block_size, num_kv_heads, head_dim, generator=gen)
            values[length:] = float("nan")
            cache[ids] = values.view(n, block_size, num_kv_heads, head_dim)
    return PagedKV(
        k_cache=caches[0].to(dtype=dtype, device=device),
        v_cache=caches[1].to(dtype=dtype, device=device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
    )


@pytest.fixture
def paged_kv(gen: torch.Generator, device: str) -> Callable[..., PagedKV]:
    """Factory for :func:`build_paged_kv` bound to this test's generator and device."""

    def make(*args, **kwargs) -> PagedKV:
        return build_paged_kv(gen, *args, device=device, **kwargs)

    return make


@pytest.fixture
def rand(gen: torch.Generator, device: str) -> Callable[..., torch.Tensor]:
    """``rand(*shape, dtype=...)``: standard normal values from this test's generator, on its device."""

    def make(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    return make


def assert_attention_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Every element written (outputs start as NaN) and within the interpreter-safe tolerance of ``ref``."""
    assert not ref.isnan().any(), "the reference itself read poisoned cache entries"
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements unwritten or poisoned"
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), **TOLERANCES[out.dtype])


@pytest.fixture
def assert_close() -> Callable[[torch.Tensor, torch.Tensor], None]:
    """:func:`assert_attention_close`, as a fixture so test modules need not import conftest."""
    return assert_attention_close


def blocks_outside_window_poisoned(kv: PagedKV, first_keys: Sequence[int]) -> PagedKV:
    """``kv`` with every block that lies wholly before sequence b's ``first_keys[b]`` (the earliest key
    any of its queries sees through a sliding window) set to NaN: a kernel that reads a block outside the
    window produces NaN and fails the comparison. The reference runs on ``kv`` itself."""
    k_cache, v_cache = kv.k_cache.clone(), kv.v_cache.clone()
    block_size = k_cache.shape[1]
    for b, first in enumerate(first_keys):
        dead = kv.block_tables[b, : max(0, first) // block_size].long()
        k_cache[dead] = float("nan")
        v_cache[dead] = float("nan")
    return PagedKV(k_cache, v_cache, kv.block_tables, kv.seq_lens)


@pytest.fixture
def outside_window_poisoned() -> Callable[[PagedKV, Sequence[int]], PagedKV]:
    """:func:`blocks_outside_window_poisoned`, as a fixture so test modules need not import conftest."""
    return blocks_outside_window_poisoned
