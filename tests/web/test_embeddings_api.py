"""Acceptance: ``POST /v1/embeddings`` through the whole stack with the official openai client, unmodified: a
second engine process serves the bundled model's fp32 weights with ``--runner pooling`` (last-token pooling,
normalised) beside the stack's generating engine; its vectors are compared with transformers' last hidden
state at the last token."""

from __future__ import annotations

import base64
import json
import subprocess
import time
import urllib.request

import numpy as np
import openai
import pytest
import torch

pytestmark = pytest.mark.timeout(300)

MODEL = "smol-embed"
TEXTS = [
    "The capital of France is Paris.",
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr",
    "请用中文介绍一下大语言模型推理中的KV缓存。",
    " ".join(["The quick brown fox jumps over the lazy dog."] * 12) + " Count the foxes:",
]


def _served(stack) -> set[str]:
    with urllib.request.urlopen(stack.base_url + "/health", timeout=5) as reply:
        return set(json.load(reply).get("models", {}))


@pytest.fixture(scope="module")
def embed_engine(stack):
    """The pooling engine, on the stack's bus; stopped (and gone from /health) after the module."""
    proc = stack._spawn(
        "embed-engine",
        "-m",
        "inference_engine",
        "serve",
        "--served-model-name",
        MODEL,
        "--redis-url",
        stack.redis.url,
        "--runner",
        "pooling",
        *stack.engine_flags,
    )
    try:
        deadline = time.monotonic() + 240
        while MODEL not in _served(stack):
            assert proc.poll() is None, stack.log("embed-engine")
            assert time.monotonic() < deadline, stack.log("embed-engine")
            time.sleep(0.3)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        deadline = time.monotonic() + 30
        while MODEL in _served(stack) and time.monotonic() < deadline:
            time.sleep(0.3)


@pytest.fixture(scope="module")
def client(stack, embed_engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def token_ids(stack, embed_engine) -> list[list[int]]:
    """TEXTS as the pooling engine tokenises them (vLLM's /tokenize)."""
    ids = []
    for text in TEXTS:
        request = urllib.request.Request(
            stack.base_url + "/tokenize",
            data=json.dumps({"model": MODEL, "prompt": text}).encode(),
            headers={"Authorization": f"Bearer {stack.api_key}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as reply:
            ids.append(json.load(reply)["tokens"])
    return ids


@pytest.fixture(scope="module")
def reference(token_ids) -> list[torch.Tensor]:
    """transformers' last hidden state at the last token, normalised, on the same fp32 weights."""
    import transformers

    from tests.engine.quant_checkpoints import dense_folder

    model = transformers.AutoModel.from_pretrained(str(dense_folder()), dtype=torch.float32).eval()
    with torch.inference_mode():
        states = [model(torch.tensor([ids])).last_hidden_state[0, -1] for ids in token_ids]
    return [torch.nn.functional.normalize(s.double(), dim=0) for s in states]


def _cosines(vectors, reference: list[torch.Tensor]) -> list[float]:
    return [
        float(torch.tensor(np.asarray(v, dtype=np.float64)) @ r)
        for v, r in zip(vectors, reference, strict=True)
    ]


def test_float_and_base64_match_transformers(client, token_ids, reference) -> None:
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert floats.object == "list" and floats.model == MODEL
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, token_ids))
    assert min(_cosines([d.embedding for d in floats.data], reference)) >= 0.9999

    # Each request is batched anew (other inputs beside it, other chunks): equal up to rounding.
    raw = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    decoded = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in raw.data]
    assert [len(v) for v in decoded] == [len(d.embedding) for d in floats.data]
    assert min(_cosines(decoded, reference)) >= 0.9999

    # Without encoding_format the client asks for base64 and decodes it itself.
    default = client.embeddings.create(model=MODEL, input=TEXTS[0])
    assert min(_cosines([default.data[0].embedding], reference[:1])) >= 0.9999

    alone = [client.embeddings.create(model=MODEL, input=[ids]).data[0].embedding for ids in token_ids]
    assert min(_cosines(alone, reference)) >= 0.9999


def test_errors_and_runners(client, stack) -> None:
    with pytest.raises(openai.BadRequestError, match="matryoshka"):
        client.embeddings.create(model=MODEL, input="hello", dimensions=64)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.embeddings.create(model=MODEL, input=[[1] * 513])
    truncated = client.embeddings.create(
        model=MODEL, input=[[1] * 513], extra_body={"truncate_prompt_tokens": 8}
    )
    assert truncated.usage.prompt_tokens == 8
    with pytest.raises(openai.BadRequestError, match="does not generate"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
    # A generating engine embeds too (its prompts share the batch with its generations).
    assert len(client.embeddings.create(model=stack.model, input="hello").data[0].embedding) == 576
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="hello")


def test_sync_bus_client_embeds(stack, embed_engine, token_ids, reference) -> None:
    """`EngineClient.embed` (Celery tasks, scripts): the same vectors, and the engine's refusals typed."""
    from inference_engine.bus.client import EngineClient
    from inference_engine.errors import InvalidRequestError

    bus = EngineClient(stack.redis.url)
    try:
        answers = [bus.embed(MODEL, ids) for ids in token_ids[:2]]
        assert [a.count for a in answers] == [len(ids) for ids in token_ids[:2]]
        vectors = [np.frombuffer(base64.b64decode(a.embedding), dtype="<f4") for a in answers]
        assert min(_cosines(vectors, reference[:2])) >= 0.9999
        assert bus.embed(MODEL, TEXTS[0], {"truncate_prompt_tokens": 3}).count == 3
        with pytest.raises(InvalidRequestError, match="maximum context length"):
            bus.embed(MODEL, [1] * 513)
    finally:
        bus.close()
