"""kernels/cpu/huge_pages.py: packed weights copied into memory that asks Linux for 2 MiB pages, and the KV
cache allocated there."""

from pathlib import Path

import pytest
import torch

from llmserve_kernels.cpu import huge_pages
from llmserve_kernels.cpu.huge_pages import on_huge_pages, zeros_on_huge_pages

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_zeros_of_the_shape_in_a_mapping_of_their_own(dtype):
    shape = (2, 3, 40, 16, 3, 64)
    cache = zeros_on_huge_pages(shape, dtype)
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    assert cache.data_ptr() % (2 << 20) == 0
    assert not cache.any()
    other = zeros_on_huge_pages(shape, dtype)
    cache[1, 2, 39] = 7  # the last block: the whole shape is writable, and no one else's
    assert cache[1, 2, 39].eq(7).all() and not other.any()


@needs_thp
def test_the_engine_keeps_its_kv_cache_on_huge_pages():
    from inference_engine import LLM, SamplingParams

    llm = LLM(kv_cache_memory_bytes=64 << 20)
    cache = llm.llm_engine.runner.kv_cache
    assert cache.data_ptr() % (2 << 20) == 0
    # Its memory is taken at the start, in huge pages, not page by page while serving.
    assert huge_bytes_at(cache.data_ptr()) >= cache.numel() * cache.element_size() // 2
    out = llm.generate(["The sea"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
