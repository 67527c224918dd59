"""Acceptance: LangChain's `OpenAIEmbeddings` (with ``check_embedding_ctx_length=False``, which sends texts
rather than its own tiktoken ids) and litellm's `embedding()` work unmodified against ``/v1/embeddings`` of
the session's stack (daphne, Redis and its engine, which embeds beside its generations). Their vectors are the
official openai client's, up to the rounding of another batch."""

from __future__ import annotations

import os

import numpy as np
import openai
import pytest

pytestmark = pytest.mark.timeout(300)

TEXTS = ["Paris is the capital of France.", "def add(a, b):\n    return a + b", "KV 缓存"]


@pytest.fixture(scope="module")
def expected(stack) -> np.ndarray:
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0, timeout=120)
    answer = client.embeddings.create(model=stack.model, input=TEXTS, encoding_format="float")
    return np.array([d.embedding for d in answer.data])


def _assert_same(vectors, expected: np.ndarray) -> None:
    got = np.asarray(vectors, dtype=np.float64)
    assert got.shape == expected.shape
    cosines = (got * expected).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(expected, axis=-1))
    assert cosines.min() >= 0.9999, cosines


def test_langchain_openai_embeddings(stack, expected) -> None:
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(
        model=stack.model,
        base_url=stack.base_url + "/v1",
        api_key=stack.api_key,
        check_embedding_ctx_length=False,
        max_retries=0,
    )
    _assert_same(embeddings.embed_documents(TEXTS), expected)
    _assert_same([embeddings.embed_query(TEXTS[0])], expected[:1])


@pytest.mark.asyncio
async def test_langchain_openai_embeddings_async(stack, expected) -> None:
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(
        model=stack.model,
        base_url=stack.base_url + "/v1",
        api_key=stack.api_key,
        check_embedding_ctx_length=False,
        max_retries=0,
    )
    _assert_same(await embeddings.aembed_documents(TEXTS), expected)


def test_litellm_embedding(stack, expected) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import
    import litellm

    answer = litellm.embedding(
        model=f"openai/{stack.model}", api_base=stack.base_url + "/v1", api_key=stack.api_key, input=TEXTS
    )
    assert [item["index"] for item in answer.data] == [0, 1, 2]
    _assert_same([item["embedding"] for item in answer.data], expected)
    assert answer.usage.prompt_tokens > 0
    with pytest.raises(litellm.BadRequestError, match="maximum context length"):
        litellm.embedding(
            model=f"openai/{stack.model}",
            api_base=stack.base_url + "/v1",
            api_key=stack.api_key,
            input=["word " * 600],
        )
