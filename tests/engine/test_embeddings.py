"""Embeddings (`LLM.embed`, runner "pooling") against transformers' hidden states on the bundled model's fp32
weights: LAST pooling alone and batched, MEAN pooling from a sentence-transformers folder (its prompts chunked
over several steps), Matryoshka dimensions, truncation, refusals, embeddings beside generation in one batch,
and KV blocks freed and never cached.

The folder here is written as sentence-transformers before version 6 saved one (`modules.json`,
`1_Pooling/config.json` with one `pooling_mode_*` flag set, an empty `2_Normalize`); folders written by the
installed sentence-transformers' own `save` are tested in test_embeddings_sentence_transformers.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
import torch

from inference_engine import LLM, AsyncLLM, PoolerConfig, PoolingParams
from inference_engine.errors import InvalidRequestError
from inference_engine.pooling import PoolingState, sentence_transformers_defaults

from .conftest import PROMPTS, SHARED, assert_all_blocks_free, greedy

TEXTS = [
    "The capital of France is Paris.",
    SHARED + "Summarise the change in one sentence:",
    "请用中文介绍一下大语言模型推理中的KV缓存。",
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr",
    " ".join(["The quick brown fox jumps over the lazy dog."] * 25) + " Count the foxes:",
]
KV_BYTES = 96 << 20  # ~2000 fp32 tokens: every text at once


def _cosine(a: list[float], b: torch.Tensor) -> float:
    a = torch.tensor(a, dtype=torch.float64)
    b = b.double()
    return float(a @ b / (a.norm() * b.norm()))


@pytest.fixture(scope="module")
def hidden_states(hf_folder, last_llm) -> dict[tuple[int, ...], torch.Tensor]:
    """transformers' final hidden states (after the final norm) of every text, by token ids, fp32."""
    import transformers

    tokenizer = last_llm.get_tokenizer()
    model = transformers.AutoModel.from_pretrained(str(hf_folder), dtype=torch.float32).eval()
    states = {}
    with torch.inference_mode():
        for text in TEXTS:
            ids = tokenizer.encode(text)
            states[tuple(ids)] = model(torch.tensor([ids])).last_hidden_state[0]
    return states


@pytest.fixture(scope="module")
def last_llm(hf_folder) -> LLM:
    return LLM(str(hf_folder), dtype="float32", runner="pooling", kv_cache_memory_bytes=KV_BYTES)


@pytest.fixture(scope="module")
def st_folder(hf_folder, tmp_path_factory) -> Path:
    """The bundled model as sentence-transformers saves a MEAN-pooling, normalising model, declaring
    Matryoshka dimensions 64 and 128 in its config.json."""
    folder = tmp_path_factory.mktemp("st-mean")
    for item in Path(hf_folder).iterdir():
        if item.name != "config.json":
            (folder / item.name).symlink_to(item)
    config = json.loads((Path(hf_folder) / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [64, 128]}))
    _write_st_modules(folder, "pooling_mode_mean_tokens", normalize=True)
    return folder


def _write_st_modules(folder: Path, mode: str, normalize: bool) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
        (folder / "2_Normalize").mkdir()
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "1_Pooling").mkdir()
    modes = (
        "pooling_mode_cls_token",
        "pooling_mode_mean_tokens",
        "pooling_mode_max_tokens",
        "pooling_mode_mean_sqrt_len_tokens",
        "pooling_mode_weightedmean_tokens",
        "pooling_mode_lasttoken",
    )
    pooling = {"word_embedding_dimension": 576, **{m: m == mode for m in modes}, "include_prompt": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=4))


@pytest.fixture(scope="module")
def mean_llm(st_folder) -> LLM:
    # 64-token steps: the long texts are pooled over several chunks, beside the others' chunks.
    return LLM(
        str(st_folder),
        dtype="float32",
        task="embed",  # vLLM's older spelling of runner="pooling"
        kv_cache_memory_bytes=KV_BYTES,
        max_num_batched_tokens=64,
    )


def test_last_token_pooling_matches_transformers_batched_and_alone(last_llm, hidden_states) -> None:
    assert last_llm.engine.pooler.config == PoolerConfig("LAST", True, None)
    lengths = [len(ids) for ids in hidden_states]
    assert min(lengths) >= 5 and max(lengths) <= 300, lengths
    batched = last_llm.embed(TEXTS, use_tqdm=False)
    alone = [last_llm.embed(text, use_tqdm=False)[0] for text in TEXTS]
    for out in batched + alone:
        hidden = hidden_states[tuple(out.prompt_token_ids)]
        assert len(out.outputs.embedding) == hidden.shape[1]
        assert abs(torch.tensor(out.outputs.embedding).norm() - 1) < 1e-5
        assert _cosine(out.outputs.embedding, hidden[-1]) >= 0.9999
    assert_all_blocks_free(last_llm)
    assert not last_llm.engine.block_manager.cached  # embeddings never enter the prefix cache


def test_mean_pooling_from_a_sentence_transformers_folder(mean_llm, hidden_states) -> None:
    assert mean_llm.engine.pooler.config == PoolerConfig("MEAN", True, None)
    outs = mean_llm.embed([{"prompt_token_ids": list(ids)} for ids in hidden_states], use_tqdm=False)
    for out in outs:
        hidden = hidden_states[tuple(out.prompt_token_ids)]
        assert _cosine(out.outputs.embedding, hidden.mean(0)) >= 0.9999
    assert_all_blocks_free(mean_llm)
    assert not mean_llm.engine.block_manager.cached


def test_matryoshka_dimensions(mean_llm, hidden_states) -> None:
    ids = next(iter(hidden_states))
    full = mean_llm.embed([list(ids)], use_tqdm=False)[0].outputs.embedding
    cut = mean_llm.embed([list(ids)], PoolingParams(dimensions=64), use_tqdm=False)[0].outputs.embedding
    assert len(cut) == 64 and abs(torch.tensor(cut).norm() - 1) < 1e-5
    assert _cosine(cut, torch.tensor(full[:64])) >= 0.99999
    with pytest.raises(InvalidRequestError, match=r"\[64, 128\]"):
        mean_llm.embed("hello there", PoolingParams(dimensions=32), use_tqdm=False)
    assert_all_blocks_free(mean_llm)


def test_refusals_and_truncation(last_llm, hidden_states) -> None:
    with pytest.raises(InvalidRequestError, match="matryoshka"):  # config.json declares no support
        last_llm.embed("hello there", PoolingParams(dimensions=64), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="does not generate"):
        last_llm.generate("hello there", use_tqdm=False)
    too_long = [1] * (last_llm.engine.max_model_len + 1)
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        last_llm.embed([too_long], use_tqdm=False)
    long_ids = max(hidden_states, key=len)
    out = last_llm.embed([list(long_ids)], truncate_prompt_tokens=20, use_tqdm=False)[0]
    assert out.prompt_token_ids == list(long_ids[-20:])
    truncated_alone = last_llm.embed([list(long_ids[-20:])], use_tqdm=False)[0]
    assert _cosine(out.outputs.embedding, torch.tensor(truncated_alone.outputs.embedding)) >= 0.99999
    assert_all_blocks_free(last_llm)


def test_embeddings_share_the_batch_with_generation(llm, hidden_states) -> None:
    """A generating engine embeds too: while it generates, embedding prompts join the same batches (64-token
    steps, so prompts and decodes mix over several steps); each vector equals transformers', the generation
    its greedy tokens alone, and no block stays taken."""
    params = greedy(24, ignore_eos=True)
    alone = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    llm.reset_prefix_cache()
    budget = llm.engine.scheduler.max_num_batched_tokens
    llm.engine.scheduler.max_num_batched_tokens = 64
    try:
        mixed: list = []
        generating = threading.Thread(
            target=lambda: mixed.extend(llm.generate(PROMPTS[:3], params, use_tqdm=False))
        )
        generating.start()
        outs = llm.embed([list(ids) for ids in hidden_states], use_tqdm=False)
        generating.join()
    finally:
        llm.engine.scheduler.max_num_batched_tokens = budget
    for out in outs:
        hidden = hidden_states[tuple(out.prompt_token_ids)]
        assert _cosine(out.outputs.embedding, hidden[-1]) >= 0.9999
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in alone]
    assert_all_blocks_free(llm)
    assert llm.reset_prefix_cache()


def test_sentence_transformers_defaults(tmp_path) -> None:
    assert sentence_transformers_defaults(tmp_path) == PoolerConfig()  # not a sentence-transformers folder
    _write_st_modules(tmp_path, "pooling_mode_cls_token", normalize=False)
    assert sentence_transformers_defaults(tmp_path) == PoolerConfig("CLS", False)
    # what --pooler-config sets wins; what it leaves out comes from the folder
    assert PoolerConfig.of('{"normalize": true}').resolve(tmp_path) == PoolerConfig("CLS", True)
    assert PoolerConfig.of({"pooling_type": "last"}).resolve(tmp_path) == PoolerConfig("LAST", False)
    assert PoolerConfig().resolve(None) == PoolerConfig("LAST", True)
    config = tmp_path / "1_Pooling" / "config.json"
    config.write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(InvalidRequestError, match="pooling 'max' is not supported"):
        sentence_transformers_defaults(tmp_path)
    # sentence-transformers 6 names the mode (or a list of modes)
    config.write_text(json.dumps({"embedding_dimension": 576, "pooling_mode": "lasttoken"}))
    assert sentence_transformers_defaults(tmp_path) == PoolerConfig("LAST", False)
    config.write_text(json.dumps({"pooling_mode": ["mean"]}))
    assert sentence_transformers_defaults(tmp_path) == PoolerConfig("MEAN", False)
    config.write_text(json.dumps({"pooling_mode": ["mean", "max"]}))
    with pytest.raises(InvalidRequestError, match="exactly one mode"):
        sentence_transformers_defaults(tmp_path)
    with pytest.raises(InvalidRequestError, match="pooling_type"):
        PoolerConfig.of({"pooling_type": "MAX"})


def test_pooling_state_over_chunks() -> None:
    """Chunks of 3 + 2 positions; a restart at position 0 (a preempted prompt recomputed) starts over."""
    hidden = torch.randn(5, 8)
    mean = PoolingState("MEAN", False, None, 5)
    for start, count in ((0, 3), (3, 2), (0, 3), (3, 2)):
        first, end = mean.rows(start, count)
        mean.add(hidden[start + first : start + end].sum(0), start)
    assert torch.allclose(torch.tensor(mean.embedding()), hidden.mean(0), atol=1e-6)
    cls, last = PoolingState("CLS", True, None, 5), PoolingState("LAST", True, 4, 5)
    assert cls.rows(3, 2) is None and last.rows(0, 3) is None
    cls.add(hidden[0], 0)
    last.add(hidden[4], 3)
    assert torch.allclose(torch.tensor(cls.embedding()), hidden[0] / hidden[0].norm(), atol=1e-6)
    assert torch.allclose(torch.tensor(last.embedding()), hidden[4, :4] / hidden[4, :4].norm(), atol=1e-6)


@pytest.mark.asyncio
async def test_async_llm_embed_and_encode(last_llm, hidden_states) -> None:
    """`AsyncLLM.embed` from concurrent tasks, and vLLM's `encode` stream (one finished output); one abandoned
    request aborted with its task, no block left taken."""
    engine = AsyncLLM.from_llm(last_llm)
    ids = [list(ids) for ids in hidden_states]
    outs = await asyncio.gather(*(engine.embed({"prompt_token_ids": one}) for one in ids))
    for out in outs:
        assert out.finished
        assert _cosine(out.outputs.embedding, hidden_states[tuple(out.prompt_token_ids)][-1]) >= 0.9999
    stream = [out async for out in engine.encode(TEXTS[0], PoolingParams(), "encode-0")]
    assert [(o.request_id, o.finished) for o in stream] == [("encode-0", True)]
    assert stream[0].outputs.embedding == pytest.approx(outs[0].outputs.embedding, abs=1e-4)
    with pytest.raises(InvalidRequestError, match="does not generate"):
        async for _ in engine.generate(TEXTS[0], greedy(4), "generate-0"):
            pass
    abandoned = asyncio.ensure_future(engine.embed(ids[-1] * 2, request_id="abandoned"))
    await asyncio.sleep(0)
    abandoned.cancel()
    with pytest.raises(asyncio.CancelledError):
        await abandoned
    await engine.reset_prefix_cache()  # a command on the loop thread: the abort ran before it
    assert_all_blocks_free(last_llm)
