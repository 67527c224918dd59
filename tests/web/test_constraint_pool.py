"""Output constraints are checked off the web tier's event loop, in a bounded pool, within a time budget per
request and a concurrency and time budget per API key (`llmserve.api.validation`)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from django.test import AsyncClient, override_settings

from llmserve.api import schema, validation
from llmserve.api.errors import BadRequest, TooManyRequests

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
CHAT = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
OPEN = {"OPEN_ACCESS": True, "DEFAULT_RATE_LIMIT": 0}


@pytest.mark.parametrize(
    ("fields", "constrained"),
    [
        ({}, False),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, False),
        ({"tool_choice": "none", "response_format": None}, False),
        ({"response_format": {"type": "json_object"}}, True),
        ({"guided_choice": ["a", "b"]}, True),
        ({"structured_outputs": {"regex": "a+"}}, True),
        ({"tool_choice": "required"}, True),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, True),
        ({"function_call": {"name": "f"}}, True),
        ({"text": {"format": {"type": "json_schema", "schema": SCHEMA}}}, True),
    ],
)
def test_which_bodies_go_to_the_pool(fields, constrained) -> None:
    assert validation.names_constraint({**CHAT, **fields}) is constrained


class Gate:
    """A check that runs until the test opens it, recording the thread it ran on."""

    def __init__(self) -> None:
        self.opened, self.threads = threading.Event(), []

    def __call__(self, value: str) -> str:
        self.threads.append(threading.current_thread().name)
        assert self.opened.wait(10)
        return value


def test_a_key_holds_at_most_its_share_of_the_pool() -> None:
    async def run() -> None:
        pool, gate = validation.ConstraintPool(workers=3), Gate()
        with override_settings(LLMSERVE={"GRAMMAR_PER_KEY": 2, "GRAMMAR_SECONDS_PER_MINUTE": 0}):
            first = asyncio.create_task(pool.run("key:a", gate, "a1"))
            second = asyncio.create_task(pool.run("key:a", gate, "a2"))
            await asyncio.sleep(0.05)
            with pytest.raises(TooManyRequests) as refused:
                await pool.run("key:a", gate, "a3")
            assert refused.value.status == 429 and refused.value.retry_after == 1
            other = asyncio.create_task(pool.run("key:b", gate, "b1"))  # another key is not held up
            await asyncio.sleep(0.05)
            gate.opened.set()
            assert await asyncio.gather(first, second, other) == ["a1", "a2", "b1"]
            assert await pool.run("key:a", gate, "a4") == "a4"  # the slots are back
        assert all(name.startswith("llmserve-grammar") for name in gate.threads), gate.threads
        pool.executor.shutdown()

    asyncio.run(run())


def test_a_slow_check_is_a_400_and_keeps_its_slot_until_it_ends() -> None:
    async def run() -> None:
        pool, gate = validation.ConstraintPool(workers=2), Gate()
        settings = {"GRAMMAR_TIMEOUT": 0.05, "GRAMMAR_PER_KEY": 1, "GRAMMAR_SECONDS_PER_MINUTE": 0}
        with override_settings(LLMSERVE=settings):
            with pytest.raises(BadRequest) as refused:
                await pool.run("key:a", gate, "slow")
            assert refused.value.code == "constraint_too_complex" and "0.05 s" in refused.value.message
            # Its thread still runs: the key's one slot stays taken until it ends.
            with pytest.raises(TooManyRequests):
                await pool.run("key:a", gate, "next")
            gate.opened.set()
            for _ in range(100):
                if pool._budgets["key:a"].running == 0:
                    break
                await asyncio.sleep(0.01)
            assert await pool.run("key:a", gate, "next") == "next"
        pool.executor.shutdown()

    asyncio.run(run())


def test_a_key_that_spent_its_seconds_waits_for_the_next_minute() -> None:
    async def run() -> None:
        pool = validation.ConstraintPool(workers=1)
        with override_settings(LLMSERVE={"GRAMMAR_SECONDS_PER_MINUTE": 0.02}):
            await pool.run("key:a", lambda: threading.Event().wait(0.05))
            with pytest.raises(TooManyRequests) as refused:
                await pool.run("key:a", str, "again")
            assert 0 < refused.value.retry_after <= validation.WINDOW
            assert "0.02 s a minute" in refused.value.message
            assert await pool.run("key:b", str, "other") == "other"
        pool.executor.shutdown()

    asyncio.run(run())


def _post(body: dict) -> tuple[int, dict]:
    async def run():
        response = await AsyncClient().post(
            "/v1/chat/completions", json.dumps(body), content_type="application/json"
        )
        return response.status_code, json.loads(response.content)

    return asyncio.run(run())


@pytest.mark.django_db(transaction=True)
def test_the_api_checks_constraints_on_the_pool_and_answers_its_budgets(monkeypatch) -> None:
    threads: list[str] = []
    real_parse = schema.parse

    def recording_parse(*args, **kwargs):
        threads.append(threading.current_thread().name)
        real_parse(*args, **kwargs)
        raise BadRequest("stop here: the test needs no engine", param="model")

    monkeypatch.setattr(schema, "parse", recording_parse)
    with override_settings(LLMSERVE=OPEN):
        constrained = {
            **CHAT,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
        }
        assert _post(constrained)[0] == 400
        assert _post(CHAT)[0] == 400
    assert threads[0].startswith("llmserve-grammar"), threads
    assert not threads[1].startswith("llmserve-grammar"), threads  # no constraint: checked inline

    def slow_parse(*args, **kwargs):  # a check that outlasts its budget
        time.sleep(0.5)
        return real_parse(*args, **kwargs)

    monkeypatch.setattr(schema, "parse", slow_parse)
    with override_settings(LLMSERVE={**OPEN, "GRAMMAR_TIMEOUT": 0.05}):
        status, body = _post({**CHAT, "guided_json": SCHEMA})
    assert status == 400, body
    assert body["error"]["code"] == "constraint_too_complex", body
    assert body["error"]["type"] == "invalid_request_error"
