"""LoRA adapters registered in the admin, through a real engine (issue 59): an engine started with the flags
its model entry gives (`ModelConfig.engine_args`, as the supervisor and `manage.py llmserve_engine` start
engines) serves the enabled adapters and not the disabled one; an API key limited to one adapter sees and uses
only it (REST and the chat's WebSocket, whose model picker lists adapters with their base); a bulk job and a
Batch API batch on an adapter run on it (the same tokens as the bus gives for that adapter); and the admin's
changes reach the running engine at once (disable: model_not_found; enable, upload: served).
In-process parts (pytest-django): tests/web/test_lora_admin.py."""

from __future__ import annotations

import asyncio
import io
import json
import zipfile
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from django.test import override_settings
from django.urls import reverse

from inference_engine.bus.sync_client import EngineClient
from inference_engine.config import engine_flags
from llmserve.bulk import services
from llmserve.bulk.batches import create_batch
from llmserve.bulk.models import BatchFile, BulkItem, BulkJob
from llmserve.bulk.runner import JobRunner
from llmserve.models import LoRAAdapter, ModelConfig
from tests.chat.wsclient import ChatSocket
from tests.engine.quant_checkpoints import dense_folder
from tests.engine.test_lora import ADAPTERS, write_adapter
from tests.web import stack as web_stack
from tests.web.stack import Stack

pytestmark = pytest.mark.timeout(300)

BASE = "smol-base"
TEXT = "The three most useful things to pack for a long hike are"
PARAMS = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    specs = {"customer-a": "qv-r4", "customer-b": "all-r16", "customer-c": "mlp-o-r8"}
    return {
        name: write_adapter(root / name, *ADAPTERS[spec], seed=i)
        for i, (name, spec) in enumerate(specs.items())
    }


@pytest.fixture(scope="module")
def lora_stack(folders, django_db_setup, django_db_blocker) -> Iterator[Stack]:
    """The model entry and its adapters stay in the test database for the module (tests roll back their own
    changes); the engine's flags are the entry's, the tests' small-engine flags after them."""
    with django_db_blocker.unblock():
        base = ModelConfig.objects.create(
            name=BASE, source="hf", path=str(dense_folder()), max_loras=2, max_lora_rank=16
        )
        for name, enabled in (("customer-a", True), ("customer-b", True), ("customer-c", False)):
            LoRAAdapter.objects.create(name=name, base_model=base, path=str(folders[name]), enabled=enabled)
        flags = [*engine_flags(base.engine_args()), *web_stack.engine_flags(), "--model", base.path]
    stack = Stack(model=BASE, engine_flags=flags).start()
    try:
        with override_settings(LLMSERVE={"REDIS_URL": stack.redis.url, "LOOKUP_CACHE_SECONDS": 0}):
            yield stack
    finally:
        stack.stop()
        with django_db_blocker.unblock():
            ModelConfig.objects.filter(name=BASE).delete()


@pytest.fixture(scope="module")
def bus(lora_stack) -> Iterator[EngineClient]:
    client = EngineClient(lora_stack.redis.url, ack_timeout=120, stream_timeout=60)
    yield client
    client.close()


def _tokens(bus: EngineClient, lora_name: str | None) -> str:
    return bus.generate(BASE, TEXT, PARAMS, lora_name=lora_name).result().outputs[0].text


def _limited_key(stack: Stack, allowed: list[str]) -> str:
    code = (
        "from llmserve.models import APIKey; "
        f"print(APIKey.objects.create_key('limited', allowed_models={allowed!r})[1])"
    )
    return stack.manage("shell", "--no-imports", "-c", code).strip()


def _openai(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=key, max_retries=0)


def _complete(client: openai.OpenAI, model: str) -> openai.types.Completion:
    return client.completions.create(
        model=model, prompt=TEXT, temperature=0.0, max_tokens=6, extra_body={"ignore_eos": True}
    )


def test_the_engine_serves_the_enabled_adapters_of_its_model_entry(lora_stack, bus) -> None:
    listed = {m.id: m.parent for m in _openai(lora_stack, lora_stack.api_key).models.list().data}
    assert listed == {BASE: None, "customer-a": BASE, "customer-b": BASE}  # customer-c is disabled
    outputs = {name: _tokens(bus, name) for name in (None, "customer-a", "customer-b")}
    assert len(set(outputs.values())) == 3  # each adapter changes the answer


def test_a_key_limited_to_one_adapter(lora_stack) -> None:
    client = _openai(lora_stack, _limited_key(lora_stack, ["customer-a"]))
    assert [m.id for m in client.models.list().data] == ["customer-a"]
    reply = _complete(client, "customer-a")
    assert reply.model == "customer-a" and reply.usage.completion_tokens == 6
    for model in (BASE, "customer-b"):
        with pytest.raises(openai.NotFoundError) as caught:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": TEXT}])
        assert caught.value.code == "model_not_found"


def test_the_chat_picker_lists_adapters_with_their_base(lora_stack) -> None:
    limited = _limited_key(lora_stack, ["customer-b"])

    async def ready(key: str) -> list[dict]:
        socket = await ChatSocket.open(
            lora_stack.base_url.replace("http", "ws") + "/ws/chat/",
            origin=lora_stack.base_url,
            protocols=["llmserve.chat", f"llmserve.key.{key}"],
        )
        try:
            message = await socket.receive()
            assert message["type"] == "ready", message
            chat = {
                "type": "chat",
                "id": 1,
                "model": "customer-a",
                "messages": [{"role": "user", "content": "hi"}],
            }
            socket.send({**chat, "params": {"max_tokens": 1}})
            refused = await socket.receive()
            return message["models"], refused
        finally:
            socket.close()

    models, answer = asyncio.run(ready(lora_stack.api_key))
    assert [(m["id"], m.get("parent")) for m in models] == [
        (BASE, None),
        ("customer-a", BASE),
        ("customer-b", BASE),
    ]
    assert answer["type"] == "start"
    models, refused = asyncio.run(ready(limited))
    assert [m["id"] for m in models] == ["customer-b"]
    assert (refused["type"], refused["code"]) == ("error", "model_not_found")


def _run(job: BulkJob) -> BulkJob:
    while JobRunner(job.pk, f"task-{job.pk}").run():
        pass
    return BulkJob.objects.get(pk=job.pk)


@pytest.mark.django_db
def test_a_bulk_job_and_a_batch_on_an_adapter_run_on_it(lora_stack, bus) -> None:
    want = _tokens(bus, "customer-b")
    assert want != _tokens(bus, None)
    job = services.create_job(
        "customer-b", "{text}", [{"text": TEXT}] * 2, PARAMS, kind="completion", start=False
    )
    job = _run(job)
    assert (job.status, job.done, job.failed) == (BulkJob.Status.COMPLETED, 2, 0)
    assert [item.output for item in job.items.order_by("index")] == [want, want]

    line = {
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "customer-b", "prompt": TEXT, **PARAMS},
    }
    content = "\n".join(json.dumps({**line, "custom_id": f"r{i}"}) for i in range(2)).encode()
    upload = BatchFile.objects.create(purpose="batch", filename="in.jsonl", content=content)
    job = _run(create_batch(upload, "/v1/completions").job)
    assert (job.status, job.done) == (BulkJob.Status.COMPLETED, 2)
    for item in BulkItem.objects.filter(job=job):
        assert item.response["model"] == "customer-b"
        assert item.response["choices"][0]["text"] == want


def _zip(folder: Path) -> io.BytesIO:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for file in folder.iterdir():
            archive.write(file, f"{folder.name}/{file.name}")
    buffer.seek(0)
    buffer.name = "adapter.zip"
    return buffer


@pytest.mark.django_db
def test_admin_changes_reach_the_running_engine(lora_stack, bus, admin_client, folders, tmp_path) -> None:
    """Disable, enable and upload in the admin: the engine stops or starts serving the adapter at once (the
    bus's run-time LoRA updates); the engine is not restarted (the base model serves throughout)."""
    client = _openai(lora_stack, lora_stack.api_key)
    changelist = reverse("admin:llmserve_loraadapter_changelist")
    pks = {a.name: a.pk for a in LoRAAdapter.objects.all()}
    before = _tokens(bus, "customer-a")
    with override_settings(LLMSERVE={"REDIS_URL": lora_stack.redis.url, "LORA_DIR": str(tmp_path / "store")}):
        response = admin_client.post(
            changelist, {"action": "disable_adapters", "_selected_action": [pks["customer-a"]]}, follow=True
        )
        said = [str(m) for m in response.context["messages"]]
        assert f"{BASE}'s engines stopped serving customer-a." in said, said
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="customer-a", prompt=TEXT, max_tokens=2)

        response = admin_client.post(
            changelist, {"action": "enable_adapters", "_selected_action": [pks["customer-c"]]}, follow=True
        )
        said = [str(m) for m in response.context["messages"]]
        assert f"customer-c loaded by 1 engine(s) of {BASE}." in said, said
        served_c = _complete(client, "customer-c").choices[0].text
        assert served_c != _tokens(bus, None)

        form = {
            "name": "customer-z",
            "base_model": ModelConfig.objects.get(name=BASE).pk,
            "path": "",
            "enabled": "on",
        }
        response = admin_client.post(
            reverse("admin:llmserve_loraadapter_add"),
            {**form, "archive": _zip(folders["customer-a"])},
            follow=True,
        )
        said = [str(m) for m in response.context["messages"]]
        assert f"customer-z loaded by 1 engine(s) of {BASE}." in said, said
        uploaded = _complete(client, "customer-z").choices[0].text
        assert uploaded == before  # customer-a's files, under another name, from the extracted folder
        # back as the module started (the test database rolls back; the engine does not)
        admin_client.post(changelist, {"action": "enable_adapters", "_selected_action": [pks["customer-a"]]})
        admin_client.post(changelist, {"action": "disable_adapters", "_selected_action": [pks["customer-c"]]})
        admin_client.post(
            reverse(
                "admin:llmserve_loraadapter_delete", args=[LoRAAdapter.objects.get(name="customer-z").pk]
            ),
            {"post": "yes"},
        )
    listed = {m.id for m in client.models.list().data}
    assert listed == {BASE, "customer-a", "customer-b"}


def test_an_adapter_disabled_in_the_admin_is_refused_while_an_engine_serves_it(lora_stack) -> None:
    """As a disabled model entry is: the engine still serves customer-b (e.g. a supervisor restarted it with
    its old flags), the API neither lists nor runs it."""
    client = _openai(lora_stack, lora_stack.api_key)

    def entries(code: str) -> None:
        lora_stack.manage(
            "shell", "--no-imports", "-c", f"from llmserve.models import LoRAAdapter, ModelConfig; {code}"
        )

    entries(
        f"b = ModelConfig.objects.create(name={BASE!r}); "
        "LoRAAdapter.objects.create(name='customer-b', base_model=b, path='/x', enabled=False)"
    )
    try:
        assert {m.id for m in client.models.list().data} == {BASE, "customer-a"}
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("customer-b")
        with pytest.raises(openai.NotFoundError):
            _complete(client, "customer-b")
        assert _complete(client, "customer-a").usage.completion_tokens == 6
    finally:
        entries(f"ModelConfig.objects.filter(name={BASE!r}).delete()")
    assert _complete(client, "customer-b").usage.completion_tokens == 6
