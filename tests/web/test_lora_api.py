"""LoRA adapters through the whole stack (issue 59): `serve --enable-lora --lora-modules` (both of vLLM's
forms), `/v1/models` lists each adapter with its base model as `parent`, and the openai client with
`model=<adapter>` gets the greedy tokens the offline engine gives with that adapter, streamed and not.
Adapters loaded and unloaded at run time (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`) and vLLM's
`vllm:lora_requests_info` in /metrics."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from django.test import AsyncClient, override_settings
from prometheus_client.parser import text_string_to_metric_families

from inference_engine.bus.sync_client import EngineClient
from inference_engine.errors import InvalidRequestError, ModelNotFoundError
from inference_engine.lora.modules import lora_requests, parse_lora_module
from inference_engine.lora.request import LoRARequest
from tests.engine.quant_checkpoints import dense_folder
from tests.engine.test_lora import ADAPTERS, write_adapter
from tests.web.stack import Stack, engine_flags

pytestmark = pytest.mark.timeout(300)

BASE = "smol-base"
MAX_TOKENS = 12
TEXT = "The three most useful things to pack for a long hike are"


@pytest.fixture(scope="module")
def adapter_paths(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "customer-a": write_adapter(root / "a", *ADAPTERS["all-r16"], seed=11),
        "customer-b": write_adapter(root / "b", *ADAPTERS["qv-r4"], seed=12),
    }


class RuntimeLoRAStack(Stack):
    """The stack with LLMSERVE["ALLOW_RUNTIME_LORA_UPDATING"] on (hostproject reads it from its
    environment)."""

    @property
    def env(self) -> dict[str, str]:
        return {**super().env, "LLMSERVE_ALLOW_RUNTIME_LORA_UPDATING": "1"}


@pytest.fixture(scope="module")
def lora_stack(adapter_paths) -> Iterator[Stack]:
    json_form = {"name": "customer-b", "path": str(adapter_paths["customer-b"]), "base_model_name": BASE}
    flags = [
        *engine_flags(),
        "--model",
        str(dense_folder()),
        "--enable-lora",
        "--max-lora-rank",
        "16",
        "--lora-modules",
        f"customer-a={adapter_paths['customer-a']}",
        json.dumps(json_form),
    ]
    stack = RuntimeLoRAStack(model=BASE, engine_flags=flags).start()
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def offline(adapter_paths) -> dict[str | None, list[int]]:
    """The offline engine's greedy tokens for TEXT under the base model and each adapter."""
    from inference_engine import LLM, SamplingParams

    llm = LLM(
        str(dense_folder()),
        dtype="float32",
        seed=0,
        max_model_len=512,
        kv_cache_memory_bytes=128 * 2**20,
        enable_lora=True,
        max_lora_rank=16,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    names = [None, *adapter_paths]
    requests = [None] + [LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(adapter_paths.items())]
    outputs = llm.generate([TEXT] * len(names), params, lora_request=requests, use_tqdm=False)
    tokens = {name: list(out.outputs[0].token_ids) for name, out in zip(names, outputs, strict=True)}
    assert tokens["customer-a"] != tokens[None] and tokens["customer-b"] != tokens[None]
    return tokens


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)


def _ids(tokens: list[str]) -> list[int]:
    return [int(re.fullmatch(r"token_id:(\d+)", t)[1]) for t in tokens]


EXTRA = {"ignore_eos": True, "return_tokens_as_token_ids": True}


@pytest.mark.parametrize("model", [BASE, "customer-a", "customer-b"])
def test_adapter_by_model_name_gives_the_offline_tokens(lora_stack, offline, model):
    client = _client(lora_stack)
    reply = client.completions.create(
        model=model, prompt=TEXT, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1, extra_body=EXTRA
    )
    assert reply.model == model
    want = offline[None if model == BASE else model]
    assert _ids(reply.choices[0].logprobs.tokens) == want
    streamed: list[str] = []
    for chunk in client.completions.create(
        model=model,
        prompt=TEXT,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        logprobs=1,
        stream=True,
        extra_body=EXTRA,
    ):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.tokens
    assert _ids(streamed) == want


def test_chat_with_an_adapter_runs_the_adapter(lora_stack):
    """Chat requests resolve an adapter's name as completions do: the adapter changes the answer."""
    client = _client(lora_stack)

    def answer(model: str) -> str:
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": TEXT}],
            max_tokens=8,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert reply.model == model
        return reply.choices[0].message.content

    assert answer("customer-a") != answer(BASE)


def test_models_list_adapters_with_their_base_as_parent(lora_stack):
    client = _client(lora_stack)
    listed = {m.id: m for m in client.models.list().data}
    assert listed[BASE].parent is None
    for name in ("customer-a", "customer-b"):
        assert listed[name].parent == BASE
        assert listed[name].root == name
        assert client.models.retrieve(name).parent == BASE


def test_an_unknown_adapter_is_a_model_not_found_error(lora_stack):
    with pytest.raises(openai.NotFoundError) as caught:
        _client(lora_stack).completions.create(model="customer-z", prompt=TEXT, max_tokens=2)
    assert "customer-z" in caught.value.message
    # an engine asked directly for an adapter it does not serve refuses it and keeps serving
    client = EngineClient(lora_stack.redis.url)
    try:
        with pytest.raises(ModelNotFoundError, match="customer-z"):
            client.generate(BASE, TEXT, {"max_tokens": 2}, lora_name="customer-z")
        served = client.generate(BASE, TEXT, {"max_tokens": 2, "ignore_eos": True}, lora_name="customer-a")
        assert len(served.result().outputs[0].token_ids) == 2
    finally:
        client.close()


def test_lora_modules_flag_forms():
    assert parse_lora_module("a=/x/y") == ("a", "/x/y")
    assert parse_lora_module('{"name": "b", "path": "/p", "base_model_name": "m"}') == ("b", "/p")
    for bad in ("no-equals", "=/p", "a=", '{"name": "b"}', "{not json"):
        with pytest.raises(InvalidRequestError, match="--lora-modules"):
            parse_lora_module(bad)
    assert lora_requests([("a", "/x"), ("b", "/y")]) == {
        "a": LoRARequest("a", 1, "/x"),
        "b": LoRARequest("b", 2, "/y"),
    }
    with pytest.raises(InvalidRequestError, match="twice"):
        lora_requests([("a", "/x"), ("a", "/y")])


def test_serve_refuses_a_bad_adapter_at_start(tmp_path):
    """A bad --lora-modules adapter ends `serve` with an error naming it, before it takes any request."""
    broken = write_adapter(tmp_path / "wide", 32, 32, ["q_proj"], {}, seed=3)
    command = [sys.executable, "-m", "inference_engine", "serve", "--redis-url", "redis://127.0.0.1:9"]
    command += ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", str(32 * 2**20)]
    command += ["--enable-lora", "--max-lora-rank", "16", "--lora-modules", f"too-wide={broken}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--lora-modules too-wide" in done.stderr and "above max_lora_rank 16" in done.stderr
    done = subprocess.run(
        [*command[:4], "--lora-modules", "a=/x"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and "--lora-modules needs --enable-lora" in done.stderr


def _post(stack: Stack, path: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    return httpx.post(stack.base_url + path, json=body, headers=headers, timeout=60)


def _lora_info(stack: Stack) -> list[dict[str, str]]:
    """The label sets of vllm:lora_requests_info in /metrics."""
    text = httpx.get(stack.base_url + "/metrics", timeout=10).text
    return [
        sample.labels
        for family in text_string_to_metric_families(text)
        if family.name == "vllm:lora_requests_info"
        for sample in family.samples
    ]


def _wait_lora_info(stack: Stack, **labels: str) -> None:
    deadline = time.monotonic() + 10
    while not any(all(info.get(k) == v for k, v in labels.items()) for info in _lora_info(stack)):
        assert time.monotonic() < deadline, f"no lora_requests_info with {labels}: {_lora_info(stack)}"
        time.sleep(0.1)


def test_runtime_load_and_unload_of_an_adapter_in_use(lora_stack, adapter_paths, offline, tmp_path):
    """Issue 59: unload of an adapter in use lets the running request finish (with the adapter's tokens)
    and gives new requests a 404 model error. Before that: bad adapters are a 400 naming the problem and the
    engine keeps serving; a loaded adapter is listed under its base and runs as the offline engine runs it;
    /metrics shows it among the running adapters while its request runs."""
    client = _client(lora_stack)
    too_big = write_adapter(tmp_path / "big", 32, 32, ["q_proj"], {}, seed=3)
    for path, reason in [(too_big, "above max_lora_rank 16"), (tmp_path / "nowhere", "no such folder")]:
        reply = _post(lora_stack, "/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": str(path)})
        assert reply.status_code == 400 and reason in reply.json()["error"]["message"], reply.text
    reply = _post(lora_stack, "/v1/load_lora_adapter", {"lora_name": "runtime-b"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "lora_path"

    path = str(adapter_paths["customer-b"])  # the offline engine's tokens for it are known
    reply = _post(lora_stack, "/v1/load_lora_adapter", {"lora_name": "runtime-b", "lora_path": path})
    assert reply.status_code == 200, reply.text
    assert reply.text == "Success: LoRA adapter 'runtime-b' added successfully."
    assert client.models.retrieve("runtime-b").parent == BASE
    _wait_lora_info(lora_stack, model_name=BASE, max_lora="1")

    long = 64  # long enough to be running while the unload goes out
    stream = client.completions.create(
        model="runtime-b",
        prompt=TEXT,
        max_tokens=long,
        temperature=0.0,
        logprobs=1,
        stream=True,
        extra_body=EXTRA,
    )
    tokens: list[str] = []
    at_unload = None  # tokens received when the unload was answered
    finish = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            if at_unload is None:  # the request runs: unload its adapter
                _wait_lora_info(lora_stack, model_name=BASE, running_lora_adapters="runtime-b")
                reply = _post(lora_stack, "/v1/unload_lora_adapter", {"lora_name": "runtime-b"})
                assert reply.status_code == 200, reply.text
                assert reply.text == "Success: LoRA adapter 'runtime-b' removed successfully."
                at_unload = len(tokens)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert finish == "length" and len(tokens) == long and at_unload < long  # it ran on after the unload
    assert _ids(tokens)[:MAX_TOKENS] == offline["customer-b"]  # with its adapter to the end

    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="runtime-b", prompt=TEXT, max_tokens=2)
    assert caught.value.code == "model_not_found" and "runtime-b" in caught.value.message
    assert "runtime-b" not in {m.id for m in client.models.list().data}
    reply = _post(lora_stack, "/v1/unload_lora_adapter", {"lora_name": "runtime-b"})
    assert reply.status_code == 404 and "'runtime-b' cannot be found" in reply.json()["error"]["message"]
    _wait_lora_info(lora_stack, model_name=BASE, running_lora_adapters="", waiting_lora_adapters="")
    served = client.completions.create(
        model="customer-b", prompt=TEXT, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1, extra_body=EXTRA
    )
    assert _ids(served.choices[0].logprobs.tokens) == offline["customer-b"]


@pytest.mark.django_db(transaction=True)
def test_runtime_lora_updating_is_off_by_default():
    """Without LLMSERVE["ALLOW_RUNTIME_LORA_UPDATING"] both endpoints are a 404 that says how to turn them on
    (and the OpenAPI document lists them); with it, an anonymous caller of an open deployment is refused."""
    from llmserve.api.openapi import document

    async def post(path: str) -> tuple[int, dict]:
        body = json.dumps({"lora_name": "x", "lora_path": "/x"})
        reply = await AsyncClient().post(path, body, content_type="application/json")
        return reply.status_code, json.loads(reply.content)

    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert "post" in document()["paths"][path]
        with override_settings(LLMSERVE={"OPEN_ACCESS": True, "DEFAULT_RATE_LIMIT": 0}):
            status, body = asyncio.run(post(path))
        assert status == 404 and "ALLOW_RUNTIME_LORA_UPDATING" in body["error"]["message"]
        on = {"OPEN_ACCESS": True, "DEFAULT_RATE_LIMIT": 0, "ALLOW_RUNTIME_LORA_UPDATING": True}
        with override_settings(LLMSERVE=on):
            status, body = asyncio.run(post(path))
        assert status == 401 and "needs an API key" in body["error"]["message"]


def test_lora_requests_info_sums_the_replicas_heartbeats():
    """vLLM's gauge per model: the adapters with running / waiting requests on any replica, `max_lora`, the
    newest heartbeat's time; requests per adapter summed; nothing for a model without adapters."""
    from inference_engine.bus.protocol import ModelInfo, ReplicaInfo
    from llmserve.metrics import render

    def replica(name: str, model: str, when: float, stats: dict) -> ReplicaInfo:
        return ReplicaInfo(name, model, {"time": when, "stats": stats})

    served = ModelInfo(
        "m",
        [
            replica("r1", "m", 5.0, {"lora_running": {"a": 2}, "lora_waiting": {"b": 1}, "max_lora": 4}),
            replica("r2", "m", 7.0, {"lora_running": {"a": 1, "c": 1}, "lora_waiting": {}, "max_lora": 4}),
        ],
    )
    plain = ModelInfo("plain", [replica("r3", "plain", 6.0, {"num_running": 0})])
    families = {f.name: f for f in text_string_to_metric_families(render([served, plain]).decode())}
    (info,) = families["vllm:lora_requests_info"].samples
    assert info.value == 7.0
    assert info.labels == {
        "model_name": "m",
        "running_lora_adapters": "a,c",
        "waiting_lora_adapters": "b",
        "max_lora": "4",
    }
    running = {s.labels["lora_name"]: s.value for s in families["llmserve_lora_num_requests_running"].samples}
    waiting = {s.labels["lora_name"]: s.value for s in families["llmserve_lora_num_requests_waiting"].samples}
    assert running == {"a": 3, "c": 1} and waiting == {"b": 1}
