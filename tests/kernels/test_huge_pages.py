"""`kernels.cpu.huge_pages`: packed weights copied into memory that asks Linux for 2 MiB pages."""

from pathlib import Path

import pytest
import torch

from kernels.cpu import huge_pages
from kernels.cpu.huge_pages import on_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here"
)


def huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping that holds `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header: start-end perms offset dev inode
            start, end = (int(x, 16) for x in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == "AnonHugePages:":
            return int(fields[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_a_copy_equal_contiguous_and_aligned(dtype):
    t = (torch.randn(300, 70) * 50).to(dtype).t()  # not contiguous
    placed = on_huge_pages(t)
    assert placed.shape == t.shape and placed.dtype == dtype and placed.is_contiguous()
    assert torch.equal(placed, t)
    assert placed.data_ptr() % 64 == 0
    placed.zero_()  # a copy: the original keeps its values
    assert t.abs().sum() > 0


def test_small_weights_share_a_mapping_and_large_ones_get_their_own():
    first, second = on_huge_pages(torch.ones(1000)), on_huge_pages(torch.ones(1000))
    assert 0 < second.data_ptr() - first.data_ptr() < 8192  # one after the other, from a cache line boundary
    large = on_huge_pages(torch.ones(huge_pages._CHUNK // 4 + 1))
    assert large.data_ptr() % (2 << 20) == 0
    after = on_huge_pages(torch.ones(1000))
    assert 0 < after.data_ptr() - second.data_ptr() < 8192  # the large one did not take the chunk's place


@needs_thp
def test_the_memory_is_backed_by_huge_pages():
    placed = on_huge_pages(torch.ones(8 << 20))  # 32 MiB, touched by the copy
    assert huge_bytes_at(placed.data_ptr()) >= 16 << 20
