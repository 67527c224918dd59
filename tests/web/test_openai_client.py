"""Acceptance: the official openai client, unmodified, against daphne serving the host project, a real engine
and a real Redis."""

from __future__ import annotations

import json
import time
import urllib.request

import openai
import pytest
import redis

from inference_engine.bus import protocol as P

pytestmark = pytest.mark.timeout(300)

MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    # No retries: a 429 or 5xx must surface as the matching exception, not be retried away.
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0, timeout=120)


def _streamed_chat(client: openai.OpenAI, **kwargs) -> tuple[dict[int, str], dict[int, str | None], list]:
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return texts, finish, chunks


def test_chat_stream_equals_non_stream_at_temperature_zero(client, stack) -> None:
    kwargs = {"model": stack.model, "messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    full = client.chat.completions.create(**kwargs)
    choice = full.choices[0]
    assert full.object == "chat.completion" and choice.message.role == "assistant" and choice.message.content
    texts, finish, chunks = _streamed_chat(client, stream_options={"include_usage": True}, **kwargs)
    assert texts[0] == choice.message.content
    assert finish[0] == choice.finish_reason
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens


def test_completion_stream_equals_non_stream(client, stack) -> None:
    kwargs = {"model": stack.model, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    full = client.completions.create(**kwargs)
    chunks = client.completions.create(stream=True, **kwargs)
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert full.object == "text_completion" and streamed == full.choices[0].text


def test_usage_counts(client, stack) -> None:
    prompt = "Once upon a time"
    full = client.completions.create(
        model=stack.model, prompt=prompt, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    # The engine's own tokenizer, through /tokenize, counts the prompt.
    request = urllib.request.Request(
        stack.base_url + "/tokenize",
        method="POST",
        data=json.dumps({"model": stack.model, "prompt": prompt}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {stack.api_key}"},
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        tokenized = json.load(reply)
    assert full.usage.prompt_tokens == tokenized["count"]
    assert full.usage.completion_tokens == 7 and full.choices[0].finish_reason == "length"
    assert full.usage.total_tokens == tokenized["count"] + 7


def test_n_greater_than_one(client, stack) -> None:
    full = client.chat.completions.create(
        model=stack.model, messages=MESSAGES, n=3, max_tokens=8, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in full.choices) == [0, 1, 2]
    assert all(c.message.content and c.finish_reason in ("stop", "length") for c in full.choices)
    assert 3 <= full.usage.completion_tokens <= 3 * 8
    texts, finish, _ = _streamed_chat(
        client, model=stack.model, messages=MESSAGES, n=2, max_tokens=8, temperature=1.0, seed=7
    )
    assert sorted(texts) == [0, 1] and sorted(finish) == [0, 1]


def test_seed_reproduces_a_sampled_answer(client, stack) -> None:
    kwargs = {"model": stack.model, "messages": MESSAGES, "max_tokens": 12, "temperature": 1.0, "seed": 1234}
    first = client.chat.completions.create(**kwargs).choices[0].message.content
    assert client.chat.completions.create(**kwargs).choices[0].message.content == first


def test_stop_string(client, stack) -> None:
    kwargs = {"model": stack.model, "prompt": "Count: 1, 2, 3,", "max_tokens": 16, "temperature": 0}
    text = client.completions.create(**kwargs).choices[0].text
    stop = text[len(text) // 2 :][:3]  # something the greedy answer is sure to reach
    assert stop.strip()
    stopped = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.index(stop)]


def test_logprobs(client, stack) -> None:
    chat = client.chat.completions.create(
        model=stack.model, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    text = client.completions.create(
        model=stack.model, prompt="Hello", max_tokens=5, temperature=0, logprobs=3
    )
    logprobs = text.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert all(len(top) == 3 for top in logprobs.top_logprobs)


def test_models_list_and_retrieve(client, stack) -> None:
    assert stack.model in [m.id for m in client.models.list()]
    model = client.models.retrieve(stack.model)
    assert model.id == stack.model and model.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_error_cases_raise_matching_exceptions(client, stack) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=stack.model, messages=MESSAGES, temperature=-1)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert missing.value.code == "model_not_found"
    wrong_key = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="sk-llm-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.chat.completions.create(model=stack.model, messages=MESSAGES)
    stack.manage(
        "shell",
        "-c",
        "from llmserve.models import ModelConfig; "
        "ModelConfig.objects.get_or_create(name='configured-but-down')",
    )
    with pytest.raises(openai.InternalServerError) as down:
        client.chat.completions.create(model="configured-but-down", messages=MESSAGES)
    assert down.value.status_code == 503


def test_rate_limit_gives_429_with_retry_after(stack) -> None:
    raw = stack.manage("llmserve_createkey", "limited", "--rate-limit", "2").strip()
    limited = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=raw, max_retries=0)
    for _ in range(2):
        limited.models.list()
    with pytest.raises(openai.RateLimitError) as info:
        limited.models.list()
    assert int(info.value.response.headers["Retry-After"]) >= 1
    assert info.value.code == "rate_limit_exceeded"


def test_overloaded_engine_gives_429_with_retry_after(client, stack) -> None:
    # A model whose request backlog is full: a live-looking replica and MAX_QUEUE entries nobody reads.
    keys, model = P.Keys(), "overloaded-model"
    r = redis.Redis.from_url(stack.redis.url)
    try:
        r.set(keys.replica("fake"), "{}", ex=60)
        r.sadd(keys.replicas(model), "fake")
        with r.pipeline(transaction=False) as pipe:
            for _ in range(1024):
                pipe.xadd(keys.requests(model), {"d": "{}"})
            pipe.execute()
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model=model, messages=MESSAGES)
        assert info.value.code == "engine_overloaded"
        assert info.value.response.headers["Retry-After"]
    finally:
        r.delete(keys.replica("fake"), keys.replicas(model), keys.requests(model))
        r.close()


def test_metrics_after_traffic(client, stack) -> None:
    client.chat.completions.create(model=stack.model, messages=MESSAGES, max_tokens=4)
    time.sleep(0.5)  # one heartbeat
    with urllib.request.urlopen(stack.base_url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    for name in (
        "llmserve_num_requests_running",
        "llmserve_num_requests_waiting",
        "llmserve_kv_cache_usage_perc",
        "llmserve_prompt_tokens_total",
        "llmserve_generation_tokens_total",
        "llmserve_num_preemptions_total",
        "llmserve_time_to_first_token_seconds_count",
        "llmserve_inter_token_latency_seconds_count",
        "llmserve_e2e_request_latency_seconds_count",
        "llmserve_request_queue_time_seconds_count",
    ):
        assert f'{name}{{model_name="{stack.model}"' in text, name
