"""In-process tests of the app (pytest-django, a test database): API keys, admin, rate limit, settings,
system checks, migrations and request validation."""

from __future__ import annotations

import asyncio
import datetime

import pytest
from asgiref.sync import sync_to_async
from django.core import checks
from django.core.management import ManagementUtility, call_command
from django.db import connections
from django.test import override_settings
from django.urls import reverse

from inference_engine.bus.redis_server import free_port
from llmserve import conf, lookups
from llmserve.api import schema
from llmserve.api.errors import BadRequest
from llmserve.auth import AuthenticationFailed, Principal, aauthenticate
from llmserve.management.commands.llmserve_engine import serve_command
from llmserve.models import APIKey, ModelConfig, hash_key


@pytest.mark.django_db
def test_api_key_is_stored_only_as_hash() -> None:
    key, raw = APIKey.objects.create_key("ci")
    assert raw.startswith("sk-llm-") and len(raw) > 40
    key.refresh_from_db()
    assert key.hashed_key == hash_key(raw) and raw not in (key.hashed_key, key.prefix, key.name)
    assert raw.startswith(key.prefix)
    assert APIKey.objects.get_usable(raw) == key
    key.revoke()
    assert APIKey.objects.get_usable(raw) is None


@pytest.mark.django_db(transaction=True)
def test_authentication() -> None:
    key, raw = APIKey.objects.create_key("ci", rate_limit=7)

    async def run() -> None:
        try:
            principal = await aauthenticate(f"Bearer {raw}")
            assert principal.key.pk == key.pk and principal.rate_limit == 7
            for header in (None, "Bearer", "Basic abc", "Bearer sk-llm-wrong"):
                with pytest.raises(AuthenticationFailed):
                    await aauthenticate(header)
            with override_settings(LLMSERVE={"OPEN_ACCESS": True}):
                anonymous = await aauthenticate(None, "10.0.0.1")
                assert anonymous.key is None and anonymous.identity == "addr:10.0.0.1"
        finally:
            # The queries ran on asgiref's thread for sync code, whose connection would outlive the test
            # (and keep pytest-django from dropping a PostgreSQL test database).
            await sync_to_async(connections.close_all)()

    asyncio.run(run())
    key.refresh_from_db()
    assert key.last_used_at is not None


@pytest.mark.django_db(transaction=True)
def test_keys_and_model_entries_are_read_once_a_few_seconds() -> None:
    """A change made elsewhere (here: `update()`, which sends no signal, as another process's save would not
    reach this one) shows after LOOKUP_CACHE_SECONDS; one saved in this process at once."""
    key, raw = APIKey.objects.create_key("ci")
    model = ModelConfig.objects.create(name="cached")

    async def run() -> None:
        try:
            assert (await lookups.api_key(raw)).pk == key.pk
            assert (await lookups.model_config("cached")).enabled
            assert await lookups.model_config("not-configured") is None
            await APIKey.objects.filter(pk=key.pk).aupdate(revoked=True)
            await ModelConfig.objects.filter(pk=model.pk).aupdate(enabled=False)
            await ModelConfig.objects.abulk_create([ModelConfig(name="not-configured")])  # no signal either
            assert (await lookups.api_key(raw)).pk == key.pk  # remembered
            assert (await lookups.model_config("cached")).enabled
            assert await lookups.model_config("not-configured") is None
            with override_settings(LLMSERVE={"LOOKUP_CACHE_SECONDS": 0}):  # read every time
                assert await lookups.api_key(raw) is None
                assert not (await lookups.model_config("cached")).enabled
                assert await lookups.model_config("not-configured") is not None
            with override_settings(LLMSERVE={"LOOKUP_CACHE_SECONDS": 0.2}):
                await APIKey.objects.filter(pk=key.pk).aupdate(revoked=False)
                assert (await lookups.api_key(raw)).pk == key.pk
                await APIKey.objects.filter(pk=key.pk).aupdate(revoked=True)
                assert (await lookups.api_key(raw)).pk == key.pk
                await asyncio.sleep(0.3)
                assert await lookups.api_key(raw) is None  # expired, read again
                await APIKey.objects.filter(pk=key.pk).aupdate(revoked=False)
                assert (await lookups.api_key(raw)).pk == key.pk
                await sync_to_async(key.revoke)()  # a save in this process: seen at once
                assert await lookups.api_key(raw) is None
                with pytest.raises(AuthenticationFailed):
                    await aauthenticate(f"Bearer {raw}")
        finally:
            await sync_to_async(connections.close_all)()

    asyncio.run(run())


@pytest.mark.django_db(transaction=True)
def test_a_generation_request_holds_no_database_connection_once_admitted() -> None:
    """It goes on to wait on the engine, often for seconds: whichever of its queries ran and whichever the
    cache spared, the connection of its thread is given back (on PostgreSQL a held one counts against the
    server's connection limit)."""
    if connections["default"].vendor == "sqlite":
        pytest.skip("Django never closes SQLite's in-memory test database")
    key, raw = APIKey.objects.create_key("ci")
    ModelConfig.objects.create(name="cached")

    async def holds_a_connection() -> bool:
        return await sync_to_async(lambda: connections["default"].connection is not None)()

    async def admitted() -> Principal:  # what a REST request reads before it submits
        principal = await aauthenticate(f"Bearer {raw}")
        assert (await lookups.model_config("cached")).enabled
        return principal

    async def run() -> None:
        try:
            with override_settings(LLMSERVE={"LOOKUP_CACHE_SECONDS": 60}):
                await lookups.model_config("cached")  # an earlier request left the entry in the cache
                principal = await admitted()  # the key read, and its first use written
                assert not await holds_a_connection()
                principal.key.last_used_at -= datetime.timedelta(minutes=5)
                await admitted()  # the key from the cache, its last use written again
                assert not await holds_a_connection()
            await sync_to_async(key.refresh_from_db)()
            assert key.last_used_at == principal.key.last_used_at  # the second write landed
        finally:
            await sync_to_async(connections.close_all)()

    asyncio.run(run())


def test_a_read_that_started_before_a_change_is_not_kept() -> None:
    """Otherwise a request reading a key while the admin revokes it would keep the old row for seconds."""
    reads = []

    async def read(name: str) -> str:
        reads.append(name)
        if len(reads) == 1:
            lookups.forget()  # the change lands while the first read is under way
        return f"row {len(reads)}"

    async def run() -> None:
        with override_settings(LLMSERVE={"LOOKUP_CACHE_SECONDS": 60}):
            assert await lookups._recent(("t", "x"), read, "x", keep_none=True) == "row 1"
            assert await lookups._recent(("t", "x"), read, "x", keep_none=True) == "row 2"
            assert await lookups._recent(("t", "x"), read, "x", keep_none=True) == "row 2"

    asyncio.run(run())


def test_unknown_keys_are_not_remembered() -> None:
    reads = []

    async def read(name: str) -> None:
        reads.append(name)

    async def run() -> None:
        with override_settings(LLMSERVE={"LOOKUP_CACHE_SECONDS": 60}):
            for _ in range(3):
                assert await lookups._recent(("key", "guess"), read, "guess", keep_none=False) is None

    asyncio.run(run())
    assert len(reads) == 3


@pytest.mark.django_db
def test_admin_shows_a_new_key_once(admin_client) -> None:
    response = admin_client.post(reverse("admin:llmserve_apikey_add"), {"name": "laptop", "rate_limit": "5"})
    assert response.status_code == 200
    raw = response.context["raw_key"]
    assert raw in response.content.decode() and "no-store" in response["Cache-Control"]
    key = APIKey.objects.get(name="laptop")
    assert key.hashed_key == hash_key(raw) and key.rate_limit == 5
    change = admin_client.get(reverse("admin:llmserve_apikey_change", args=[key.pk]))
    assert raw not in change.content.decode()
    before = lookups._generation
    admin_client.post(
        reverse("admin:llmserve_apikey_changelist"), {"action": "revoke_keys", "_selected_action": [key.pk]}
    )
    key.refresh_from_db()
    assert key.revoked
    assert lookups._generation > before  # the bulk update, which sends no signal, emptied the cache


@pytest.mark.django_db(transaction=True)
def test_createkey_needs_no_bus(capsys) -> None:
    """Creating a key only writes the database, so `manage.py llmserve_createkey` works before Redis is
    set up or while it is down, as Django's own changepassword does; other commands stop at llmserve.E001."""
    with override_settings(LLMSERVE={"REDIS_URL": None}):
        assert any(m.id == "llmserve.E001" for m in checks.run_checks(tags=["llmserve"]))
        ManagementUtility(["manage.py", "llmserve_createkey", "ops"]).execute()
    raw = capsys.readouterr().out.strip()
    assert APIKey.objects.get_usable(raw).name == "ops"


@pytest.mark.django_db
def test_admin_model_list_renders_without_engines(admin_client) -> None:
    ModelConfig.objects.create(name="smol")
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    with override_settings(LLMSERVE={"REDIS_URL": unreachable}):
        response = admin_client.get(reverse("admin:llmserve_modelconfig_changelist"))
    assert response.status_code == 200
    assert "down" in response.content.decode()


@pytest.mark.django_db
def test_engine_command_line_from_model_config() -> None:
    model = ModelConfig.objects.create(
        name="tiny",
        source="gguf",
        path="/models/tiny.gguf",
        dtype="float32",
        max_model_len=2048,
        enable_prefix_caching=False,
        runner="pooling",
    )
    with override_settings(LLMSERVE={"REDIS_URL": "redis://127.0.0.1:7000/0", "ENGINE_THREADS": 1}):
        cmd = serve_command(model)
    joined = " ".join(cmd)
    for part in (
        "serve --served-model-name tiny",
        "--redis-url redis://127.0.0.1:7000/0",
        "--model /models/tiny.gguf",
        "--threads 1",
        "--dtype float32",
        "--max-model-len 2048",
        "--no-enable-prefix-caching",
        "--runner pooling",
    ):
        assert part in joined


@pytest.mark.django_db
def test_quantization_and_decode_steps_chosen_in_the_admin_reach_the_serve_command_line(admin_client) -> None:
    from io import StringIO

    from inference_engine.__main__ import build_parser

    form = {
        "name": "smol-awq",
        "enabled": "on",
        "source": "hf",
        "path": "/models/smol-awq",
        "revision": "",
        "dtype": "bfloat16",
        "quantization": "awq",
        "runner": "generate",
        "tensor_parallel_size": "1",
        "speculative_config": "null",
        "max_model_len": "",
        "block_size": "16",
        "max_num_seqs": "64",
        "kv_cache_memory_bytes": "",
        "gpu_memory_utilization": "0.9",
        "enable_prefix_caching": "on",
        "num_scheduler_steps": "8",
        "max_loras": "4",
        "max_lora_rank": "16",
    }
    response = admin_client.post(reverse("admin:llmserve_modelconfig_add"), form)
    assert response.status_code == 302, response.content.decode()[:2000]
    assert ModelConfig.objects.get(name="smol-awq").quantization == "awq"
    out = StringIO()
    with override_settings(LLMSERVE={"REDIS_URL": "redis://127.0.0.1:7000/0"}):
        call_command("llmserve_engine", "smol-awq", "--print", stdout=out)
    cmd = out.getvalue().split()
    assert "--quantization awq" in " ".join(cmd) and "--num-scheduler-steps 8" in " ".join(cmd)
    args = build_parser().parse_args(cmd[cmd.index("serve") :])
    assert (args.model, args.quantization, args.num_scheduler_steps) == ("/models/smol-awq", "awq", 8)


def test_settings_accessor_follows_override_settings() -> None:
    assert conf.get("OPEN_ACCESS") is False
    with override_settings(LLMSERVE={"OPEN_ACCESS": True, "MAX_QUEUE": 3}):
        assert conf.get("OPEN_ACCESS") is True and conf.get("MAX_QUEUE") == 3
    assert conf.get("MAX_QUEUE") == conf.DEFAULTS["MAX_QUEUE"]
    with pytest.raises(conf.UnknownSettingError):
        conf.get("MAX_QEUE")


def _ids(messages: list[checks.CheckMessage]) -> set[str]:
    return {m.id for m in messages}


def test_checks_catch_missing_and_unreachable_redis(monkeypatch) -> None:
    monkeypatch.delenv(conf.REDIS_URL_ENV, raising=False)
    with override_settings(LLMSERVE={"REDIS_URL": None}):
        assert "llmserve.E001" in _ids(checks.run_checks())
    with override_settings(LLMSERVE={"REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}):
        assert "llmserve.E002" in _ids(checks.run_checks())


def test_checks_pass_with_a_live_redis(stack) -> None:
    with override_settings(LLMSERVE={"REDIS_URL": stack.redis.url}):
        assert not {i for i in _ids(checks.run_checks()) if i.startswith("llmserve.")}


def test_checks_catch_bad_settings() -> None:
    with override_settings(
        LLMSERVE={"REDIS_URL": "redis://x", "MAX_QEUE": 3, "MAX_BODY_BYTES": -1, "OPEN_ACCESS": "yes"}
    ):
        messages = checks.run_checks(tags=["compatibility"])
    assert {"llmserve.E003", "llmserve.E004"} <= _ids(messages)
    for bad in ({"REJECT_UNKNOWN_FIELDS": 1}, {"MIN_PRIORITY": "0"}):
        with override_settings(LLMSERVE={"REDIS_URL": "redis://x", **bad}):
            found = [m.msg for m in checks.run_checks(tags=["compatibility"]) if m.id == "llmserve.E004"]
        assert found and next(iter(bad)) in found[0], bad


@pytest.mark.django_db
def test_no_missing_migrations() -> None:
    call_command("makemigrations", "--check", "--dry-run", verbosity=0)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": 101}},
            "logit_bias",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": True}, "n"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 2}, "top_p"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": {}},
            "stream_options",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "tools[0].type"),
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": None, "messages": [{"role": "user", "content": "x"}]}, "model"),
    ],
)
def test_chat_body_validation(body: dict, param: str) -> None:
    with pytest.raises(BadRequest) as info:
        schema.parse("chat", body)
    assert info.value.param == param


def test_chat_body_maps_to_sampling_params() -> None:
    request = schema.parse(
        "chat",
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 9,
            "logprobs": True,
            "top_logprobs": 3,
            "stop": "\n",
            "seed": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logit_bias": {"42": -100},
            "user": "u",
        },
    )
    assert request.messages == [{"role": "user", "content": "hi"}]
    params = request.params
    assert (params.max_tokens, params.logprobs, params.stop, params.seed) == (9, 3, ["\n"], 4)
    assert params.logit_bias == {42: -100.0} and request.include_usage and request.logprobs


def test_completion_prompts() -> None:
    assert schema.parse("completion", {"model": "m", "prompt": ["only one"]}).prompt == "only one"
    assert schema.parse("completion", {"model": "m", "prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    for prompt in ("", [], ["a", "b"], [True], 5):
        with pytest.raises(BadRequest):
            schema.parse("completion", {"model": "m", "prompt": prompt})


@pytest.mark.django_db
def test_chat_sign_in_is_not_the_admin_login(client, django_user_model) -> None:
    response = client.get("/chat/")
    assert response.status_code == 302 and response["Location"] == "/accounts/login/?next=/chat/"
    page = client.get(response["Location"]).content.decode()
    assert "Sign in to llmserve chat" in page and "Django administration" not in page
    django_user_model.objects.create_user("reader", password="a long passphrase")
    signed_in = client.post(
        "/accounts/login/", {"username": "reader", "password": "a long passphrase", "next": "/chat/"}
    )
    assert signed_in.status_code == 302 and signed_in["Location"] == "/chat/"
    assert client.get("/chat/").status_code == 200


@pytest.mark.django_db
def test_admin_is_branded(admin_client) -> None:
    page = admin_client.get("/admin/").content.decode()
    assert "llmserve administration" in page and "Django administration" not in page


def test_openapi_document_and_docs_page(client) -> None:
    from django.contrib.staticfiles import finders

    document = client.get("/openapi.json").json()
    assert document["openapi"].startswith("3.1")
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/tokenizer_info"):
        assert path in document["paths"], path
    schemas = document["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest", "ChatMessage"):
        # As OpenAI's: any field may come (unknown ones are ignored), optional ones may be null.
        assert "additionalProperties" not in schemas[name], name
        assert {"type": "null"} in schemas[name]["properties"][
            "content" if name == "ChatMessage" else "stream"
        ]["anyOf"]
    temperature = schemas["ChatCompletionRequest"]["properties"]["temperature"]["anyOf"][0]
    assert temperature == {"minimum": 0, "type": "number"}
    page = client.get("/docs").content.decode()
    bundle = "drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js"
    assert f"/static/{bundle}" in page and "cdn" not in page.lower()
    assert finders.find(bundle) and finders.find("llmserve/docs.js")


def test_completion_bodies() -> None:
    request = schema.parse(
        "completion",
        {"model": "m", "prompt": [[1, 2], [3]], "echo": True, "logprobs": 2, "max_tokens": 0},
        several_prompts=True,
    )
    assert request.prompts == [[1, 2], [3]] and request.prompt_only and request.echo
    assert (request.params.max_tokens, request.params.prompt_logprobs, request.params.logprobs) == (1, 2, 2)
    assert schema.parse("completion", {"model": "m", "prompt": "x"}).params.max_tokens is None
    chat = schema.parse("chat", {"model": "m", "messages": [{"role": "developer", "content": "be brief"}]})
    assert chat.messages == [{"role": "system", "content": "be brief"}]
    for body, param in (
        ({"model": "m", "prompt": "x", "temperature": float("nan")}, "temperature"),
        ({"model": "m", "prompt": "x", "top_p": float("inf")}, "top_p"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "prompt": ["a", "b"]}, "prompt"),  # one prompt unless the caller takes several
        ({"model": "m", "prompt": "x", "suffix": "y"}, "suffix"),
    ):
        with pytest.raises(BadRequest) as info:
            schema.parse("completion", body)
        assert info.value.param == param
