"""The client against a real redis-server, with no engine or with the session's real engine (SmolLM2-135M)
served in a thread."""

import asyncio
import json
import time

import pytest

from inference_engine.bus import protocol as P
from inference_engine.bus.async_client import _OutputReader
from inference_engine.bus.client import AsyncEngineClient, AsyncGenerationStream
from inference_engine.bus.redis_server import RedisServer
from inference_engine.errors import (
    EngineOverloadedError,
    EngineUnavailableError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestAbortedError,
)
from inference_engine.sampling_params import SamplingParams

from .conftest import MODEL, assert_idle, generate_offline, wait_idle

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
    with pytest.raises(EngineUnavailableError, match="within") as refused:
        client.generate("m", "hi", request_id="r1")
    assert "r1" not in str(refused.value)  # internal ids stay out of messages that reach API clients
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


def test_streaming_equals_offline_generation(client, engine, serve):
    prompt = "hello"
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=5, ignore_eos=True)
    expected = generate_offline(engine, prompt, params)
    serve()
    stream = client.generate(MODEL, prompt, params)
    assert stream.prompt_tokens == len(engine.tokenizer.encode(prompt)) == len(expected.prompt_token_ids)
    deltas = list(stream)
    assert deltas[-1].finished and deltas[-1].usage.completion_tokens == 10
    assert all(not d.finished for d in deltas[:-1])
    for index, want in enumerate(expected.outputs):
        text = "".join(o.text for d in deltas for o in d.outputs if o.index == index)
        token_ids = [t for d in deltas for o in d.outputs if o.index == index for t in o.token_ids]
        assert (text, token_ids) == (want.text, want.token_ids)
    assert expected.outputs[0].token_ids != expected.outputs[1].token_ids  # two samples, not one twice
    assert [o.finish_reason for o in deltas[-1].outputs] == ["length", "length"]


def test_chat_tokenize_detokenize(client, engine, serve):
    messages = [{"role": "user", "content": "hi"}]
    rendered = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    rendered_ids = engine.tokenizer.encode(rendered)
    expected = generate_offline(engine, rendered, {"max_tokens": 3, "temperature": 0})
    serve()
    result = client.generate(MODEL, messages=messages, params={"max_tokens": 3, "temperature": 0}).result()
    assert result.prompt_tokens == len(rendered_ids)
    assert result.outputs[0].text == expected.outputs[0].text
    assert result.outputs[0].token_ids == expected.outputs[0].token_ids
    tokens = client.tokenize(MODEL, messages=messages)
    assert tokens.token_ids == rendered_ids and tokens.max_model_len == engine.max_model_len
    assert client.detokenize(MODEL, tokens.token_ids) == rendered  # special tokens included, as in vLLM
    text = "Tokenizers split words like unbelievable."
    assert client.tokenize(MODEL, text).token_ids == engine.tokenizer.encode(text)
    assert client.detokenize(MODEL, client.tokenize(MODEL, text).token_ids) == text


def test_engine_errors_arrive_before_any_delta(client, engine, serve):
    serve()
    too_long = "hello " * engine.max_model_len
    assert len(engine.tokenizer.encode(too_long)) > engine.max_model_len
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        client.generate(MODEL, too_long)
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        client.generate(MODEL, "hi", {"max_tokens": engine.max_model_len})
    limit, engine.config.max_pending_requests = engine.config.max_pending_requests, 0
    try:
        with pytest.raises(EngineOverloadedError):
            client.generate(MODEL, "x")
    finally:
        engine.config.max_pending_requests = limit
    result = client.generate(MODEL, "x", {"max_tokens": 2, "ignore_eos": True}).result()
    assert result.usage.completion_tokens == 2


def test_leaving_early_aborts_in_the_engine(client, engine, serve):
    serve()
    before = engine.generation_tokens_total
    for delta in client.generate(MODEL, "abc", {"max_tokens": 200, "ignore_eos": True}):
        assert delta.outputs
        break
    wait_idle(engine)  # aborted, and its KV blocks are free again
    assert engine.generation_tokens_total - before < 200  # cut short, not run to the end
    result = client.generate(MODEL, "abc", {"max_tokens": 2, "ignore_eos": True}).result()
    assert result.outputs[0].finish_reason == "length"


def test_list_models(client, engine, serve):
    serve()
    [model] = client.list_models()
    assert model.name == MODEL and model.max_model_len == engine.max_model_len == 512
    [replica] = model.replicas
    assert replica.num_blocks == replica.num_free_blocks == engine.block_manager.num_blocks


async def _settled(engine) -> None:
    """Waits (up to 5 s) for the serving thread to drop the engine's last request, then checks it is idle."""
    for _ in range(250):
        if not engine.has_unfinished_requests():
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.05)  # let the serving thread finish the iteration that emptied the engine
    assert_idle(engine)


def test_async_client_streams_and_cancels(redis_server, prefix, engine, serve):
    params = {"max_tokens": 4, "temperature": 0}
    expected = generate_offline(engine, "hey", params).outputs[0].text
    serve()

    async def main():
        client = AsyncEngineClient(redis_server.url, prefix=prefix, ack_timeout=5, stream_timeout=5)
        try:
            stream = await client.generate(MODEL, "hey", params)
            text = "".join([o.text async for d in stream for o in d.outputs])
            assert text == expected
            assert (await client.tokenize(MODEL, "ab")).token_ids == engine.tokenizer.encode("ab")

            before = engine.generation_tokens_total
            stream = await client.generate(MODEL, "slow", {"max_tokens": 500, "ignore_eos": True})

            async def consume():
                async for _ in stream:
                    pass

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await _settled(engine)
            assert engine.generation_tokens_total - before < 500
        finally:
            await client.close()

    asyncio.run(main())


def test_a_dropped_stream_aborts_its_request(redis_server, prefix, engine, serve):
    """A generation dropped unread and unaborted, as by a Django view cancelled (its client gone) after it
    returned a streaming response whose iterator never started, is aborted in the engine."""
    serve()

    async def main():
        client = AsyncEngineClient(redis_server.url, prefix=prefix, ack_timeout=5, stream_timeout=5)
        try:
            before = engine.generation_tokens_total
            stream = await client.generate(MODEL, "slow", {"max_tokens": 500, "ignore_eos": True})
            del stream
            await _settled(engine)
            assert engine.generation_tokens_total - before < 500
            # an answered tokenize is not a generation: dropping it sends nothing more
            assert (await client.tokenize(MODEL, "ab")).token_ids == engine.tokenizer.encode("ab")
            assert not client._dropped
        finally:
            await client.close()

    asyncio.run(main())


def test_a_generate_cancelled_during_its_submission_aborts_the_request(redis_server, prefix, engine, serve):
    """Cancelled after the request reached Redis but before the reply did (a loaded event loop), `generate`
    still aborts it: nobody else knows its id."""
    serve()

    async def main():
        client = AsyncEngineClient(redis_server.url, prefix=prefix, ack_timeout=5, stream_timeout=5)
        run, late = client._run, []

        async def late_reply(op):
            result = await run(op)
            if not late:  # the submission's reply only
                late.append(True)
                await asyncio.sleep(30)
            return result

        client._run = late_reply
        try:
            before = engine.generation_tokens_total
            params = {"max_tokens": 500, "ignore_eos": True}
            task = asyncio.create_task(client.generate(MODEL, "slow", params))
            for _ in range(100):  # until the engine runs it
                if engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.02)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await _settled(engine)
            assert engine.generation_tokens_total - before < 500
        finally:
            await client.close()

    asyncio.run(main())


def test_async_cancellation_is_never_swallowed(redis_server, prefix, engine, serve):
    """Consumers cancelled at staggered moments all stop with CancelledError and abort their requests:
    redis-py drops a cancellation that lands while a blocking read times out, so the client checks."""
    serve()

    async def main():
        client = AsyncEngineClient(redis_server.url, prefix=prefix, ack_timeout=5, stream_timeout=5)
        try:
            params = {"max_tokens": 400, "ignore_eos": True}
            streams = [await client.generate(MODEL, f"count to {i}", params) for i in range(8)]

            async def consume(stream):
                async for _ in stream:
                    pass

            tasks = [asyncio.create_task(consume(stream)) for stream in streams]
            for task in tasks:
                await asyncio.sleep(0.07)
                task.cancel()
            for task in tasks:
                with pytest.raises(asyncio.CancelledError):
                    await task
            await _settled(engine)
        finally:
            await client.close()

    asyncio.run(main())


def test_attach_reads_a_request_another_client_submitted(redis_server, prefix, engine, serve):
    """`attach` reads a request from its first entry, as a bulk task that took over another's items does,
    and refuses one that was aborted (an engine that finds it aborted in the queue drops it silently)."""
    params = {"max_tokens": 4, "temperature": 0}
    expected = generate_offline(engine, "hey", params).outputs[0].text
    serve()

    async def main():
        options = {"prefix": prefix, "ack_timeout": 5, "stream_timeout": 5}
        submitter, reader = (AsyncEngineClient(redis_server.url, **options) for _ in range(2))
        try:
            async with await submitter.generate(MODEL, "hey", params, request_id="shared") as stream:
                submitted = await stream.result()
            async with await reader.attach(MODEL, "shared") as attached:
                assert (await attached.result()).outputs[0].text == submitted.outputs[0].text == expected

            stream = await submitter.generate(MODEL, "long", {"max_tokens": 400, "ignore_eos": True})
            await stream.abort()
            with pytest.raises(RequestAbortedError):
                await reader.attach(MODEL, stream.request_id)
            await _settled(engine)
        finally:
            await submitter.close()
            await reader.close()

    asyncio.run(main())


def test_list_models_skips_models_without_live_replicas(client, raw_redis, prefix):
    """A model whose replicas all died (heartbeats expired or withdrawn) is listed by nobody, and the others
    still are."""
    _fake_heartbeat(raw_redis, prefix, model="alive")
    keys = P.Keys(prefix)
    raw_redis.sadd(keys.models, "dead", "gone")
    raw_redis.sadd(keys.replicas("dead"), "expired-replica")  # its heartbeat key is gone
    assert [(m.name, [r.replica_id for r in m.replicas]) for m in client.list_models()] == [
        ("alive", ["ghost"])
    ]


def test_a_full_connection_pool_makes_calls_wait_then_refuses_as_overloaded(redis_server, prefix):
    async def main() -> None:
        client = AsyncEngineClient(redis_server.url, prefix=prefix, max_connections=1, pool_timeout=0.3)
        try:
            hold = asyncio.create_task(client.redis.blpop(["nothing"], timeout=1))  # the only connection
            await asyncio.sleep(0.1)
            start = time.monotonic()
            with pytest.raises(EngineOverloadedError, match="waiting for the request bus"):
                await client.list_models()
            assert time.monotonic() - start >= 0.25  # it waited for the pool before giving up
            await hold
            assert await client.list_models() == []  # the connection is back: calls go through again
        finally:
            await client.close()

    asyncio.run(main())


def test_pooled_connections_survive_a_redis_restart(prefix):
    """After Redis restarts, every pooled connection is stale: the client's retry reconnects it rather than
    failing the call. (The async pool once had the synchronous Retry, which never retried: each stale
    connection failed one request with 503, long after Redis was back.)"""
    with RedisServer() as server:

        async def main() -> None:
            client = AsyncEngineClient(server.url, prefix=prefix)
            try:
                await asyncio.gather(*(client.redis.blpop(["nothing"], timeout=0.2) for _ in range(6)))
                server.restart()  # same port; the six pooled connections now point at a closed server
                assert await asyncio.gather(*(client.list_models() for _ in range(6))) == [[]] * 6
                assert await client.list_models() == []
            finally:
                await client.close()

        asyncio.run(main())


def test_waiting_requests_hold_no_redis_connection(serve, redis_server, prefix):
    """Three times more requests than the engine's batch, on a client with two Redis connections: the
    queued ones wait on the client's one shared reader, and every request completes."""
    serve()

    async def one(client: AsyncEngineClient, i: int) -> int:
        stream = await client.generate(MODEL, f"Count to {i}.", {"max_tokens": 3, "ignore_eos": True})
        return (await stream.result()).usage.completion_tokens

    async def main() -> list[int]:
        client = AsyncEngineClient(
            redis_server.url, prefix=prefix, max_connections=2, pool_timeout=30, ack_timeout=60
        )
        try:
            return await asyncio.gather(*(one(client, i) for i in range(24)))
        finally:
            await client.close()

    assert asyncio.run(main()) == [3] * 24


def test_a_new_request_is_not_held_up_by_a_read_in_progress(redis_server, raw_redis, prefix, monkeypatch):
    """The async client reads every request's output with one blocking XREAD; a request that starts while
    that read waits on the others' streams wakes it, instead of waiting for it to time out."""
    monkeypatch.setattr(_OutputReader, "BLOCK_MS", 5_000)  # under the socket timeout

    async def main():
        client = AsyncEngineClient(redis_server.url, prefix=prefix)
        try:
            quiet = AsyncGenerationStream(client, MODEL, "quiet")  # its read blocks: no engine writes to it
            await asyncio.sleep(0.2)
            newcomer = AsyncGenerationStream(client, MODEL, "newcomer")
            raw_redis.xadd(P.Keys(prefix).output("newcomer"), P.encode(P.Ack(3, "replica")))
            (_, message), *_ = await asyncio.wait_for(newcomer._queue.get(), 2)
            assert isinstance(message, P.Ack) and message.prompt_tokens == 3
            assert quiet._queue.empty()
            for stream in (quiet, newcomer):  # the reader ends at its next read, which this entry ends
                stream._unsubscribe()
            raw_redis.xadd(P.Keys(prefix).output("quiet"), P.encode(P.Ack(1, "replica")))
        finally:
            await client.close()

    asyncio.run(main())
