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
from tests.rate_window import early_in_a_rate_window

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
    early_in_a_rate_window(10)
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


def _metrics(stack) -> dict[str, float]:
    """Every sample of /metrics for the stack's model, by name (labels other than the model summed)."""
    with urllib.request.urlopen(stack.base_url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or f'model_name="{stack.model}"' not in line:
            continue
        name, value = line.split("{", 1)[0], float(line.rsplit(" ", 1)[1])
        values[name] = values.get(name, 0.0) + value
    return values


def _settled_metrics(stack) -> dict[str, float]:
    """/metrics once the engine heartbeats have caught up (both token totals stopped moving). Reads are
    0.6 s apart: the engine publishes every 0.25 s, but only between its idle waits on Redis (0.1 s), so two
    reads closer than that could both see the heartbeat from before the last request finished."""
    previous = None
    for _ in range(40):
        current = _metrics(stack)
        if previous is not None and all(
            current.get(k) == previous.get(k)
            for k in ("llmserve_prompt_tokens_total", "llmserve_generation_tokens_total")
        ):
            return current
        previous = current
        time.sleep(0.6)
    return current


def test_metrics_agree_with_each_other(client, stack) -> None:
    before = _settled_metrics(stack)
    client.chat.completions.create(model=stack.model, messages=MESSAGES, max_tokens=4)
    client.chat.completions.create(model=stack.model, messages=MESSAGES, max_tokens=5, n=2, seed=1)
    list(client.completions.create(model=stack.model, prompt=["a", "b", "c"], max_tokens=3, stream=True))
    client.completions.create(model=stack.model, prompt="Hello", echo=True, logprobs=1, max_tokens=0)
    after = _settled_metrics(stack)
    change = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    samples = 1 + 2 + 3 + 1  # engine requests x n
    for name in (
        "llmserve_request_success_total",
        "llmserve_time_to_first_token_seconds_count",
        "llmserve_e2e_request_latency_seconds_count",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_count",
    ):
        assert change[name] == samples, name
    assert change["llmserve_request_queue_time_seconds_count"] == 6  # engine requests
    # What the web side saw of each request adds up to what the engines counted.
    assert change["llmserve_request_prompt_tokens_sum"] == change["llmserve_prompt_tokens_total"] > 0
    assert change["llmserve_request_generation_tokens_sum"] == change["llmserve_generation_tokens_total"] > 0
    assert change["vllm:prompt_tokens_total"] == change["llmserve_prompt_tokens_total"]
    for name in (
        "llmserve_num_requests_running",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:time_per_output_token_seconds_count",
        "vllm:request_queue_time_seconds_count",
    ):
        assert name in after, name


def _post(stack, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        stack.base_url + path,
        method="POST",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {stack.api_key}"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.load(reply)


def test_completions_with_a_list_of_prompts(client, stack) -> None:
    prompts = ["The capital of France is", "1, 2, 3,", "Once upon a time"]
    kwargs = {"model": stack.model, "max_tokens": 6, "temperature": 0}
    alone = [client.completions.create(prompt=p, **kwargs) for p in prompts]
    together = client.completions.create(prompt=prompts, **kwargs)
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert [c.text for c in together.choices] == [a.choices[0].text for a in alone]
    assert together.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert together.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    # As token ids, with n samples each: choices numbered prompt * n + sample.
    ids = [_post(stack, "/tokenize", {"prompt": p})["tokens"] for p in prompts[:2]]
    sampled = client.completions.create(prompt=ids, n=2, model=stack.model, max_tokens=3, seed=3)
    assert sorted(c.index for c in sampled.choices) == [0, 1, 2, 3]
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(prompt=prompts, stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(3)] == [c.text for c in together.choices]


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_completion_echo_with_logprobs(client, stack, max_tokens) -> None:
    prompt = "The quick brown fox jumps over the lazy dog"
    tokens = _post(stack, "/tokenize", {"prompt": prompt})["tokens"]
    kwargs = {"model": stack.model, "echo": True, "logprobs": 1, "max_tokens": max_tokens, "temperature": 0}
    as_text, as_ids = (client.completions.create(prompt=p, **kwargs) for p in (prompt, [tokens]))
    for choice in as_text.choices + as_ids.choices:
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(tokens) + max_tokens
        assert "".join(logprobs.tokens[: len(tokens)]) == prompt
        assert choice.text.startswith(prompt) and (max_tokens or choice.text == prompt)
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
        for token, lp, top in zip(
            logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], strict=True
        ):
            assert top[token] == lp and max(top.values()) >= lp and 1 <= len(top) <= 2
        assert logprobs.text_offset == [
            sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))
        ]
    assert as_text.choices[0].logprobs == as_ids.choices[0].logprobs  # the text and its ids: one prompt
    assert as_text.usage.completion_tokens == max_tokens


def test_no_sixteen_token_default(client, stack) -> None:
    # Without max_tokens the model counts on until the stop string, well past 16 tokens.
    reply = client.completions.create(
        model=stack.model, prompt="1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", stop=["20,"], temperature=0
    )
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens > 16
    assert reply.choices[0].text.strip().startswith("11, 12, 13")


def test_developer_role_is_system(client, stack) -> None:
    def ask(role: str | None) -> tuple[str, int]:
        messages = [{"role": "user", "content": "Say hello."}]
        if role:
            messages.insert(0, {"role": role, "content": "You answer in French."})
        reply = client.chat.completions.create(
            model=stack.model, messages=messages, max_tokens=8, temperature=0
        )
        return reply.choices[0].message.content, reply.usage.prompt_tokens

    developer, system, neither = ask("developer"), ask("system"), ask(None)
    assert developer == system
    assert neither[1] != system[1]  # without one, the template adds its default system prompt


def test_unknown_v1_paths_get_a_json_404(client, stack) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.moderations.create(model=stack.model, input="hello")
    assert info.value.code == "unknown_url"
    assert set(info.value.body) == {"message", "type", "param", "code"}


def test_tokenizer_endpoints_without_model(stack) -> None:
    with urllib.request.urlopen(
        urllib.request.Request(
            stack.base_url + "/tokenizer_info", headers={"Authorization": f"Bearer {stack.api_key}"}
        ),
        timeout=30,
    ) as reply:
        info = json.load(reply)
    assert info["eos_token"] and "{%" in info["chat_template"] and info["model_max_length"] == 512
    eos = _post(stack, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})["tokens"]
    assert len(eos) == 1  # a special token's text is that token
    tokenized = _post(stack, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert len(tokenized["token_strs"]) == tokenized["count"] == len(tokenized["tokens"])
    assert _post(stack, "/detokenize", {"tokens": tokenized["tokens"]})["prompt"] == "Hello world"


def test_responses_create_retrieve_and_chain(client, stack) -> None:
    first = client.responses.create(
        model=stack.model,
        input="My name is Ada.",
        instructions="Answer briefly.",
        max_output_tokens=12,
        temperature=0,
    )
    assert first.object == "response" and first.status in ("completed", "incomplete") and first.output_text
    assert first.usage.output_tokens <= 12
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(
        model=stack.model,
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=8,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    # The second response saw the whole conversation (the first one's instructions are not carried over).
    conversation = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.usage.input_tokens == _post(stack, "/tokenize", {"messages": conversation})["count"]
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=stack.model, input="hi", previous_response_id=second.id)
    assert info.value.body["param"] == "previous_response_id"


def test_responses_stream(client, stack) -> None:
    kwargs = {
        "model": stack.model,
        "input": [{"role": "user", "content": "Name a colour."}],
        "temperature": 0,
    }
    plain = client.responses.create(max_output_tokens=10, **kwargs)
    events = list(client.responses.create(stream=True, max_output_tokens=10, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    assert text == done.output_text == plain.output_text
    assert client.responses.retrieve(done.id).output_text == text
