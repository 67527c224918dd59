"""The native CPU decode kernel, and the PyTorch decode path it replaces, against the per-sequence
reference of kernels/reference.py on fresh random inputs."""

import itertools
import math
import os
import random
import subprocess
import sys

import pytest
import torch

import llmserve_kernels.cpu
from inference_engine.attention.torch_backend import EVERY_LENGTH, NATIVE_QUERY_MIN, decode_reference
from llmserve_kernels.cpu import attention as cpu_attention
from llmserve_kernels.reference import paged_decode_attention_ref

F32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture
def device() -> str:
    """These kernels are the CPU's own: no Triton, no interpreter needed."""
    return "cpu"


@pytest.fixture(params=["amx", "vector"])
def routine(request):
    """The kernel's AMX routine (where the CPU has it) and its vector one."""
    amx = request.param == "amx"
    if cpu_attention.decode_through_amx(amx) != amx:
        pytest.skip("no AMX here")
    yield request.param
    cpu_attention.decode_through_amx(True)


def test_kernel_builds_here():
    """The suite's machine has a C compiler, so the engine tests run the native kernel, not the fallback."""
    assert llmserve_kernels.cpu.available()


# (seq_lens, block_size, head_dim, num_heads, num_kv_heads, dtype). Lengths cover 1, exact block ends
# and one past them; GQA groups of 1, 3, 4, 8 (specialised for AVX512-BF16 in bf16) and 12 (generic);
# head dims 64 and 128 (specialised) and 80 (generic loop).
CASES = [
    ([1], 16, 64, 9, 3, BF16),
    ([16, 17, 1, 33], 16, 64, 9, 3, BF16),
    ([8, 9, 7, 64, 65], 8, 128, 8, 2, F32),
    ([32, 31, 97], 32, 128, 4, 4, BF16),
    ([200, 1, 129], 16, 64, 12, 3, F32),
    ([130, 17, 2], 16, 128, 32, 4, BF16),
    ([45, 3], 8, 80, 16, 2, BF16),
    ([20, 33], 16, 64, 24, 2, BF16),
    ([61, 5], 32, 80, 6, 2, F32),
    ([600, 1000], 16, 64, 9, 3, BF16),
    ([2050, 30], 16, 128, 8, 2, BF16),
    (random.Random(2).choices(range(1, 400), k=24), 16, 64, 9, 3, BF16),
    (random.Random(3).choices(range(1, 300), k=7), 32, 128, 28, 4, F32),
]


@pytest.mark.parametrize(("seq_lens", "block_size", "head_dim", "num_heads", "num_kv_heads", "dtype"), CASES)
def test_matches_pytorch_decode(
    paged_kv, rand, assert_close, routine, seq_lens, block_size, head_dim, num_heads, num_kv_heads, dtype
):
    kv = paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype)
    # Queries as the model hands them over: a view into a wider per-token row (the fused qkv output).
    rows = rand(len(seq_lens), num_heads + 2 * num_kv_heads, head_dim, dtype=dtype)
    q = rows[:, :num_heads]
    scale = 1 / math.sqrt(head_dim)
    ref = paged_decode_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale)
    # Unowned slots are NaN: a kernel that reads past a sequence's end fails.
    out = cpu_attention.paged_decode(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale)
    assert out is not None
    assert_close(out, ref)
    # The PyTorch path reads the padding of its gathered batch (masked out, but NaN * 0 is NaN): run it
    # on a cache whose unowned slots hold finite stale values, as the engine's (zero-initialised) cache does.
    k_cache, v_cache = kv.k_cache.nan_to_num(7.0), kv.v_cache.nan_to_num(-7.0)
    fallback = decode_reference(q, k_cache, v_cache, kv.block_tables, kv.seq_lens, scale)
    assert_close(fallback, ref)


@pytest.mark.parametrize("threads", [1, 2])
def test_result_does_not_depend_on_thread_count(paged_kv, rand, routine, threads):
    kv = paged_kv([50, 7, 300, 16], 16, 3, 64, BF16)
    q = rand(4, 9, 64, dtype=BF16)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_attention.paged_decode(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)
        torch.set_num_threads(threads)
        many = cpu_attention.paged_decode(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, many)


def step_metadata(seq_lens, query_lens, block_tables, slots=None):
    """One step's metadata as the model runner builds it: `query_lens[b]` new tokens ending each sequence."""
    from inference_engine.attention import AttentionMetadata

    starts = [0, *itertools.accumulate(query_lens)]
    return AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64) if slots is None else torch.tensor(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.as_tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        query_lens=query_lens,
        context_lens=[s - n for s, n in zip(seq_lens, query_lens, strict=True)],
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


# (query_lens, seq_lens, block_size, head_dim, num_heads, num_kv_heads, dtype): one step's tokens, each a
# one-token query of its own, as `per_token` hands them over; a sequence's consecutive tokens (drafts, short
# prefill chunks) starting and ending inside blocks and across their ends.
RUNS = [
    ([5], [451], 16, 64, 9, 3, BF16),
    ([5], [258], 16, 64, 9, 3, BF16),  # two below the AMX routine's 256 keys, three within
    ([5], [2050], 16, 64, 9, 3, BF16),  # three within the AMX routine's 2048 keys, two past
    ([5], [20], 16, 64, 9, 3, BF16),
    ([3, 1, 9], [33, 40, 18], 16, 64, 9, 3, BF16),
    ([17], [17], 16, 128, 8, 2, BF16),
    ([2, 3], [300, 280], 16, 64, 16, 2, BF16),  # 8 query heads a KV head: a token's 8 rows, two tokens' 16
    ([2, 4], [300, 65], 32, 128, 28, 4, BF16),
    ([4, 1], [70, 9], 8, 80, 16, 2, BF16),
    ([6, 2], [100, 15], 16, 64, 9, 3, F32),
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "block_size", "head_dim", "heads", "kv_heads", "dtype"), RUNS
)
def test_tokens_of_one_sequence_get_the_bits_they_get_alone(
    paged_kv, rand, routine, threads, query_lens, seq_lens, block_size, head_dim, heads, kv_heads, dtype
):
    """A sequence's tokens in one step (speculative drafts, short prefill chunks) each get exactly the bits
    they get as a step's only query, whatever shares the step and the threads: drafts verify as decoding
    decides."""
    kv = paged_kv(seq_lens, block_size, kv_heads, head_dim, dtype)
    tables, lens = step_metadata(seq_lens, query_lens, kv.block_tables).per_token()
    tokens = sum(query_lens)
    q = rand(tokens, heads + 2 * kv_heads, head_dim, dtype=dtype)[:, :heads]
    caches = (kv.k_cache, kv.v_cache)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        together = cpu_attention.paged_decode(q, *caches, tables, lens, 0.125)
        alone = []
        for t in range(tokens):
            one = slice(t, t + 1)
            alone.append(cpu_attention.paged_decode(q[one], *caches, tables[one], lens[one], 0.125))
    finally:
        torch.set_num_threads(previous)
    assert not together.isnan().any()
    assert torch.equal(together, torch.cat(alone))


@pytest.mark.parametrize(("heads", "tokens"), [(10, 3), (16, 2), (6, 4)])
def test_strips_of_any_row_count_give_a_row_the_same_bits(routine, heads, tokens):
    """A lone token's rows and a run's share one strip or several, whatever their count (the AMX routine packs
    the softmax of up to 4 or 8 rows several keys a vector): each row's bits stay those it gets alone. A
    difference is a last-bit rounding in a few of these contexts, so many are tried."""
    gen = torch.Generator().manual_seed(0)
    for length in range(260, 300):
        blocks = length // 16 + 2
        k, v = (torch.randn(blocks, 16, 2, 64, generator=gen).to(BF16) for _ in range(2))
        tables = torch.arange(blocks, dtype=torch.int32).repeat(tokens, 1)
        lens = torch.arange(length - tokens + 1, length + 1, dtype=torch.int32)
        q = torch.randn(tokens, heads, 64, generator=gen).to(BF16)
        together = cpu_attention.paged_decode(q, k, v, tables, lens, 0.125)
        alone = [
            cpu_attention.paged_decode(q[t : t + 1], k, v, tables[t : t + 1], lens[t : t + 1], 0.125)
            for t in range(tokens)
        ]
        assert torch.equal(together, torch.cat(alone)), length


def test_declines_what_it_cannot_run(paged_kv, rand):
    """fp16 caches and blocks larger than the kernel's fixed limit go to the PyTorch path (None here)."""
    kv = paged_kv([20], 16, 3, 64, torch.float16)
    q = rand(1, 9, 64, dtype=torch.float16)
    assert cpu_attention.paged_decode(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.1) is None
    kv = paged_kv([200], 128, 3, 64, BF16)
    q = rand(1, 9, 64, dtype=BF16)
    assert cpu_attention.paged_decode(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.1) is None


def test_can_be_switched_off():
    code = "import llmserve_kernels.cpu; print(llmserve_kernels.cpu.available())"
    env = {**os.environ, "LLMSERVE_CPU_KERNELS": "0"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


# (seq_lens, query_lens, block_size, dtype): decodes (1), whole prompts (query = seq) and chunks on top of
# a cached prefix, mixed in one step as the scheduler builds them.
MIXED = [
    ([40, 17, 1, 64], [40, 1, 1, 30], 16, BF16),
    ([40, 17, 1, 64], [1, 1, 1, 1], 16, BF16),  # decodes only
    ([5, 300, 33], [5, 120, 1], 8, F32),
    ([129, 2], [129, 2], 32, BF16),
    (random.Random(4).choices(range(50, 200), k=6), [1, 50, 7, 1, 49, 16], 16, BF16),
    # Chunks longer than the native limit go through SDPA while the rest of the step stays native.
    ([140, 40, 300], [60, 40, 1], 16, BF16),
    ([130, 200], [130, 1], 32, F32),
]


@pytest.mark.parametrize("limit", [NATIVE_QUERY_MIN, 1024], ids=["no-extend", "limit1024"])
@pytest.mark.parametrize("native", ["extend", "per-token", "pytorch"])
@pytest.mark.parametrize(("seq_lens", "query_lens", "block_size", "dtype"), MIXED)
def test_backend_matches_extend_reference(
    paged_kv, rand, assert_close, monkeypatch, native, limit, seq_lens, query_lens, block_size, dtype
):
    """The CPU backend on a whole step against the per-sequence causal reference: each token of a chunk of
    up to `NATIVE_QUERY_MIN` tokens run as a query of the decode kernel, longer ones up to `limit` tokens
    through the extend kernel (bf16 only; `per-token`: without it, as queries of the decode kernel too), the
    rest (or, without native kernels, every chunk) through SDPA. The limit is pinned, as CPUs measure it:
    no longer than the decode kernel's chunks (no extend kernel), or far longer."""
    from inference_engine.attention import torch_backend
    from llmserve_kernels.reference import paged_extend_attention_ref

    monkeypatch.setattr(torch_backend, "native_query_max", lambda *args: limit)
    if native != "extend":
        monkeypatch.setattr(cpu_attention, "paged_extend", lambda *args, **options: False)
    if native == "pytorch":
        monkeypatch.setattr(cpu_attention, "paged_decode", lambda *args, **options: None)
    kv = paged_kv(seq_lens, block_size, 3, 64, dtype)
    # The new tokens' K/V are already in the cache here; the backend stores them again (same values).
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    k_new, v_new, slots = [], [], []
    for b, (length, n) in enumerate(zip(seq_lens, query_lens, strict=True)):
        for pos in range(length - n, length):
            block = int(kv.block_tables[b, pos // block_size])
            k_new.append(kv.k_cache[block, pos % block_size])
            v_new.append(kv.v_cache[block, pos % block_size])
            slots.append(block * block_size + pos % block_size)
    q = rand(starts[-1], 9, 64, dtype=dtype)
    meta = step_metadata(seq_lens, query_lens, kv.block_tables, slots)
    ref = paged_extend_attention_ref(
        q, kv.k_cache, kv.v_cache, kv.block_tables, meta.query_start_loc, kv.seq_lens, 0.125, max(query_lens)
    )
    if native == "pytorch":  # the PyTorch path reads padding (see above): give unowned slots finite values
        kv.k_cache.nan_to_num_(7.0)
        kv.v_cache.nan_to_num_(-7.0)
    k, v = torch.stack(k_new), torch.stack(v_new)
    out = torch_backend.forward(q, k, v, kv.k_cache, kv.v_cache, meta, 0.125)
    assert_close(out, ref)


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [3, 1, 2]], ids=["decodes", "mixed"])
def test_every_query_token_attends_to_its_prefix(query_lens):
    """`per_token`: each query token as a decode of its own, its sequence's block table and its position + 1
    as its length (decode-only steps take a shortcut to the same answer)."""
    seq_lens, tables = [5, 9, 2], torch.tensor([[3, 0], [1, 4], [2, 0]], dtype=torch.int32)
    meta = step_metadata(seq_lens, query_lens, tables)
    per_token_tables, lens = meta.per_token()
    owners = [b for b, n in enumerate(query_lens) for _ in range(n)]
    positions = [s - n + i for s, n in zip(seq_lens, query_lens, strict=True) for i in range(n)]
    assert per_token_tables.tolist() == [tables[b].tolist() for b in owners]
    assert lens.tolist() == [p + 1 for p in positions]


@pytest.mark.parametrize(
    ("native_cost", "expected", "timed_lengths"),
    [
        # quadratic native against linear SDPA: they cross at 200 tokens
        (lambda n: n * n * 5e-7, 128, [64, 128, 256]),
        # native faster at every length timed: at every length
        (lambda n: 1e-9, EVERY_LENGTH, [64, 128, 256, 512, 1024]),
        # never faster: only the chunks that always run native
        (lambda n: 1.0, NATIVE_QUERY_MIN, [64]),
    ],
)
def test_longest_faster_stops_at_the_crossover(native_cost, expected, timed_lengths):
    from inference_engine.attention.torch_backend import longest_faster

    timed = []
    result = longest_faster(lambda n: timed.append(n) or native_cost(n), lambda n: n * 1e-4)
    assert result == expected
    assert timed == timed_lengths


def test_native_query_max_is_measured_per_shape(monkeypatch):
    from inference_engine.attention import torch_backend

    measured = torch_backend.native_query_max(9, 3, 64, BF16, 2)
    assert measured in (NATIVE_QUERY_MIN, 128, 256, 512, 1024, EVERY_LENGTH)
    torch_backend.native_query_max.cache_clear()
    monkeypatch.setattr(cpu_attention, "paged_extend", lambda *args, **options: False)
    monkeypatch.setattr(cpu_attention, "paged_decode", lambda *args, **options: None)
    assert (
        torch_backend.native_query_max(9, 3, 64, BF16, 2) == NATIVE_QUERY_MIN
    )  # no kernel: long chunks to SDPA
    torch_backend.native_query_max.cache_clear()


def test_unwritable_cache_falls_back_to_pytorch(tmp_path):
    """A home without a writable cache (a locked-down service account) costs speed, never the engine."""
    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache folder should be")
    code = (
        "import torch; from llmserve_kernels.cpu import available, fused; "
        "x = torch.ones(2, 8, dtype=torch.bfloat16); print(available(), fused.add_rms_norm(x, x, x[0], 1e-5))"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(blocked)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "None"]
    assert "CPU kernels unavailable" in result.stderr
