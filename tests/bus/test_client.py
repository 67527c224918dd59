"""The client against a real redis-server, with no engine or with a fake engine served in a thread."""

import asyncio
import json
import time

import pytest

from inference_engine.bus import protocol as P
from inference_engine.bus.client import AsyncEngineClient
from inference_engine.errors import (
    EngineOverloadedError,
    EngineUnavailableError,
    InvalidRequestError,
    ModelNotFoundError,
)
from inference_engine.sampling_params import SamplingParams

from .fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(60)


def _fake_heartbeat(raw_redis, prefix, model="m", ttl_ms=10_000):
    keys = P.Keys(prefix)
    raw_redis.set(keys.replica("ghost"), json.dumps({"stats": {}}), px=ttl_ms)
    raw_redis.sadd(keys.replicas(model), "ghost")
    raw_redis.sadd(keys.models, model)


def test_unknown_model_raises_before_anything(client):
    with pytest.raises(ModelNotFoundError):
        client.generate("nope", "hi")


def test_no_answer_times_out_and_aborts(client, raw_redis, prefix):
    _fake_heartbeat(raw_redis, prefix)
    client.settings.ack_timeout = 0.5
    start = time.monotonic()
    with pytest.raises(EngineUnavailableError, match="within"):
        client.generate("m", "hi", request_id="r1")
    assert time.monotonic() - start < 2
    assert raw_redis.exists(P.Keys(prefix).abort("r1"))


def test_dead_engine_is_noticed_before_the_timeout(client, raw_redis, prefix):
    _fake_heartbeat(raw_redis, prefix, ttl_ms=300)
    start = time.monotonic()
    with pytest.raises(EngineUnavailableError, match="no live engine"):
        client.generate("m", "hi")
    assert time.monotonic() - start < 2


def test_duplicate_ids_and_full_queue(client, raw_redis, prefix):
    _fake_heartbeat(raw_redis, prefix)
    client.settings.ack_timeout = 0.1
    with pytest.raises(EngineUnavailableError):
        client.generate("m", "hi", request_id="same")
    with pytest.raises(InvalidRequestError, match="duplicate"):
        client.generate("m", "hi", request_id="same")
    client.settings.max_queue = 1  # the first request is still in the stream: backlog is full
    with pytest.raises(EngineOverloadedError):
        client.generate("m", "hi")


def test_invalid_params_fail_in_the_client(client):
    with pytest.raises(InvalidRequestError):
        client.generate("m", "hi", {"temperature": -1})
    with pytest.raises(InvalidRequestError):
        client.generate("m", prompt="a", messages=[{"role": "user", "content": "b"}])


def test_streaming_through_a_fake_engine(client, fake_server):
    prompt = "hello"
    stream = client.generate("fake", prompt, SamplingParams(n=2, max_tokens=5))
    assert stream.prompt_tokens == len(prompt)
    deltas = list(stream)
    assert deltas[-1].finished and deltas[-1].usage.completion_tokens == 10
    ids = [ord(c) for c in prompt]
    for index in (0, 1):
        text = "".join(o.text for d in deltas for o in d.outputs if o.index == index)
        assert text == FakeEngine.expected_text(ids, index, 5)
    assert [o.finish_reason for o in deltas[-1].outputs] == ["length", "length"]


def test_chat_tokenize_detokenize(client, fake_server):
    messages = [{"role": "user", "content": "hi"}]
    result = client.generate("fake", messages=messages, params={"max_tokens": 3}).result()
    rendered = "<user>hi<assistant>"
    assert result.prompt_tokens == len(rendered)
    assert result.outputs[0].text == FakeEngine.expected_text([ord(c) for c in rendered], 0, 3)
    tokens = client.tokenize("fake", messages=messages)
    assert tokens.token_ids == [ord(c) for c in rendered] and tokens.max_model_len == 64
    assert client.detokenize("fake", tokens.token_ids) == rendered


def test_engine_errors_arrive_before_any_delta(client, fake_server):
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        client.generate("fake", "x" * 100)
    fake_server.engine.config.max_pending_requests = 0
    with pytest.raises(EngineOverloadedError):
        client.generate("fake", "x")


def test_leaving_early_aborts_in_the_engine(client, fake_server):
    fake_server.engine.step_delay = 0.02
    for delta in client.generate("fake", "abc", {"max_tokens": 200}):
        assert delta.outputs
        break
    deadline = time.monotonic() + 2
    while fake_server.engine.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not fake_server.engine.requests
    assert client.generate("fake", "abc", {"max_tokens": 2}).result().outputs[0].finish_reason == "length"


def test_list_models(client, fake_server):
    [model] = client.list_models()
    assert model.name == "fake" and model.max_model_len == 64
    assert model.replicas[0].num_blocks == 100


def test_async_client_streams_and_cancels(redis_server, prefix, fake_server):
    async def main():
        client = AsyncEngineClient(redis_server.url, prefix=prefix, ack_timeout=5, stream_timeout=5)
        try:
            stream = await client.generate("fake", "hey", {"max_tokens": 4})
            text = "".join([o.text async for d in stream for o in d.outputs])
            assert text == FakeEngine.expected_text([ord(c) for c in "hey"], 0, 4)
            assert (await client.tokenize("fake", "ab")).token_ids == [97, 98]

            fake_server.engine.step_delay = 0.02
            stream = await client.generate("fake", "slow", {"max_tokens": 500})

            async def consume():
                async for _ in stream:
                    pass

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(100):
                if not fake_server.engine.requests:
                    break
                await asyncio.sleep(0.02)
            assert not fake_server.engine.requests
        finally:
            await client.close()

    asyncio.run(main())
