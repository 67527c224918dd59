"""Priority-aware intake: interactive requests (priority 0) and bulk ones (priority > 0) on two streams, so a
replica saturated with bulk work still takes an interactive request at once; the session's real engine."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from inference_engine.bus import protocol as P
from inference_engine.bus.client import EngineClient
from inference_engine.errors import EngineOverloadedError, EngineUnavailableError
from inference_engine.sampling_params import SamplingParams

from .conftest import MODEL, ThreadedServer, assert_idle, generate_offline, wait_idle
from .test_client import _fake_heartbeat

pytestmark = pytest.mark.timeout(180)

BULK = 10  # the priority llmserve.bulk sends
CHAT = "Give me one tip about tidy desks."


def test_streams_and_admission_bounds(client, raw_redis, prefix):
    """Priority > 0 goes to the low-priority stream. `max_queue` bounds an interactive request by the
    interactive stream alone (a bulk backlog never refuses it) and a bulk one by both streams together."""
    keys = P.Keys(prefix)
    _fake_heartbeat(raw_redis, prefix)
    client.settings.ack_timeout = 0.1  # nobody serves "m": each request stays queued

    def submit(priority):
        with pytest.raises(EngineUnavailableError, match="within"):
            client.generate("m", "hi", priority=priority)

    submit(BULK)
    assert (raw_redis.xlen(keys.requests("m")), raw_redis.xlen(keys.low_priority_requests("m"))) == (0, 1)
    client.settings.max_queue = 1
    with pytest.raises(EngineOverloadedError):  # the bulk backlog counts against bulk...
        client.generate("m", "hi", priority=BULK)
    submit(0)  # ...but not against interactive requests
    assert (raw_redis.xlen(keys.requests("m")), raw_redis.xlen(keys.low_priority_requests("m"))) == (1, 1)
    with pytest.raises(EngineOverloadedError):
        client.generate("m", "hi", priority=0)


def test_dead_consumers_low_priority_entries_are_recovered(redis_server, raw_redis, prefix, engine):
    params = {"max_tokens": 3, "temperature": 0}
    expected = generate_offline(engine, "abc", params)
    keys, low = P.Keys(prefix), P.Keys(prefix).low_priority_requests(MODEL)
    raw_redis.xgroup_create(low, P.GROUP, id="0", mkstream=True)
    raw_redis.set(keys.request_id("bulk"), MODEL)
    raw_redis.xadd(
        low, P.encode({"type": P.GENERATE, "id": "bulk", "prompt": "abc", "params": params, "priority": BULK})
    )
    raw_redis.xreadgroup(P.GROUP, "ghost", {low: ">"}, count=10)  # took it, then died (no heartbeat)
    server = ThreadedServer(engine, redis_server.url, prefix).start()
    try:
        deadline = time.monotonic() + 10
        while raw_redis.xlen(low) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert raw_redis.xlen(low) == 0
    finally:
        server.stop()
    outputs = [P.decode(f) for _, f in raw_redis.xrange(keys.output("bulk"))]
    assert outputs[-1]["type"] == P.FINAL
    tokens = [t for o in outputs if o["type"] == P.DELTA for c in o["outputs"] for t in c["token_ids"]]
    assert tokens == expected.outputs[0].token_ids


class StepLog:
    """Wraps `engine.step` (served in another thread) to count steps and note, per request, the step of its
    first token and of its end."""

    def __init__(self, engine) -> None:
        self._step = engine.step
        self.steps = 0
        self.first: dict[str, int] = {}
        self.finished: dict[str, int] = {}
        self.lock = threading.Lock()

    def __call__(self):
        outputs = self._step()
        with self.lock:
            self.steps += 1
            for output in outputs:
                if output.request_id not in self.first and any(c.token_ids for c in output.outputs):
                    self.first[output.request_id] = self.steps
                if output.finished:
                    self.finished[output.request_id] = self.steps
        return outputs

    def steps_to_first_token(
        self, client: EngineClient, prompt: str, params: SamplingParams
    ) -> tuple[int, str, list[int]]:
        """Submits an interactive request and waits for its end: (engine steps from its submission to its
        first token, its id, its token ids)."""
        with self.lock:
            submitted = self.steps
        result = client.generate(MODEL, prompt, params, priority=0).result()
        return self.first[result.request_id] - submitted, result.request_id, result.outputs[0].token_ids


def _offline_batch(engine, prompts, params):
    """Greedy outputs of `prompts` batched on the engine itself (no bus), as the bus batches them."""
    assert_idle(engine)
    ids = [f"offline-{uuid.uuid4().hex}" for _ in prompts]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0].token_ids
    assert_idle(engine)
    return [done[rid] for rid in ids]


def test_interactive_request_overtakes_a_saturating_bulk_load(client, engine, serve):
    bulk_params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    chat_params = SamplingParams(temperature=0, max_tokens=4)
    slots = engine.config.max_num_seqs  # = the server's max_inflight
    bulk_prompts = [f"Summarise report {i}: the north gate was repaired on day {i}." for i in range(slots)]
    expected_bulk = _offline_batch(engine, bulk_prompts, bulk_params)
    expected_chat = generate_offline(engine, CHAT, chat_params)
    log = StepLog(engine)
    engine.step = log  # the serving thread calls self.engine.step()
    try:
        serve()
        idle_steps, _, idle_tokens = log.steps_to_first_token(client, CHAT, chat_params)
        assert idle_tokens == expected_chat.outputs[0].token_ids

        # Bulk requests fill every in-flight slot of the replica (and of the engine) for many steps.
        results: dict[int, list[int]] = {}

        def bulk(i: int) -> None:
            stream = client.generate(MODEL, bulk_prompts[i], bulk_params, priority=BULK)
            results[i] = stream.result().outputs[0].token_ids

        threads = [threading.Thread(target=bulk, args=(i,)) for i in range(slots)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(log.first) < slots + 1:  # every bulk request has produced a token: all are running
            assert time.monotonic() < deadline, "the bulk requests did not all start"
            time.sleep(0.01)
        bulk_ids = set(log.first) - set(log.finished)
        assert len(bulk_ids) == slots

        busy_steps, chat_id, busy_tokens = log.steps_to_first_token(client, CHAT, chat_params)
        for t in threads:
            t.join(60)
        # The interactive request did not wait for a bulk one to finish: it got its first token within a
        # couple of steps of its idle-engine latency (the bus reads it at the next iteration, the scheduler
        # preempts a bulk sequence for it), and before any bulk request had finished.
        assert busy_steps <= idle_steps + 2, (idle_steps, busy_steps)
        assert log.first[chat_id] < min(log.finished[rid] for rid in bulk_ids)
        assert busy_tokens == expected_chat.outputs[0].token_ids
        # The bulk work, preempted or not, completed with the same outputs as offline.
        assert [results[i] for i in range(slots)] == expected_bulk
        wait_idle(engine)
    finally:
        del engine.step
