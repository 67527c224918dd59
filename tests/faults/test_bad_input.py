"""Bad input that never reaches the API's request validation, against the launcher's real stack: each answer
is a clean 4xx (JSON on API paths), and secrets stay out of the logs."""

from __future__ import annotations

import http.client
import json
import time

import pytest
from django.test import AsyncClient

from .stack import LauncherStack

pytestmark = pytest.mark.timeout(420)


def request(
    stack: LauncherStack, method: str, path: str, body: bytes = b"", headers: dict | None = None
) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=30)
    try:
        connection.request(method, path, body, headers or {})
        reply = connection.getresponse()
        return reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read()
    finally:
        connection.close()


def api_error(status: int, headers: dict[str, str], body: bytes) -> dict:
    assert headers.get("content-type") == "application/json", (status, headers, body)
    error = json.loads(body)["error"]
    assert error["message"] and error["type"], error
    return error


def test_static_path_traversal_is_not_found(launched: LauncherStack) -> None:
    status, _, body = request(launched, "GET", "/static/%2e%2e/%2e%2e/hostproject/settings.py")
    assert status == 404 and b"SECRET_KEY" not in body
    assert request(launched, "GET", "/static/llmserve/chat.js")[0] == 200


def test_multipart_upload_without_boundary_gets_a_json_error(launched: LauncherStack) -> None:
    """Twisted used to answer this itself, with an empty 400 that no client can explain."""
    auth = {"Authorization": f"Bearer {launched.api_key}"}
    status, headers, body = request(
        launched, "POST", "/v1/files", b"purpose=batch", {**auth, "Content-Type": "multipart/form-data"}
    )
    assert 400 <= status < 500
    api_error(status, headers, body)


def test_foreign_host_gets_json_on_api_paths(launched: LauncherStack) -> None:
    status, headers, body = request(launched, "GET", "/v1/models", headers={"Host": "evil.example"})
    assert status == 400
    api_error(status, headers, body)
    status, headers, _ = request(launched, "GET", "/chat/", headers={"Host": "evil.example"})
    assert status == 400 and headers["content-type"].startswith("text/html")  # people get the page
    status, headers, body = request(launched, "GET", "/v1/no-such-endpoint")
    assert status == 404 and api_error(status, headers, body)["code"] == "unknown_url"


def test_api_key_in_the_query_string_stays_out_of_the_access_log(launched: LauncherStack) -> None:
    secret = "sk-llm-query-string-secret"
    for _ in range(2):  # two web workers: either may log it
        request(launched, "GET", f"/v1/models?api_key={secret}&limit=1")
    deadline = time.monotonic() + 5
    logs = ""
    while "api_key=***&limit=1" not in logs and time.monotonic() < deadline:
        time.sleep(0.2)
        logs = "".join(launched.log(f"web-{n}") for n in (1, 2))
    assert "api_key=***&limit=1" in logs
    assert secret not in logs


@pytest.mark.django_db
@pytest.mark.asyncio
async def test_errors_do_not_show_the_redis_address(settings) -> None:
    """With the bus unreachable, /health and the API say so without naming where Redis lives (in process:
    no stack needed)."""
    settings.LLMSERVE = {"REDIS_URL": "redis://127.0.0.1:9/0", "OPEN_ACCESS": True}
    client = AsyncClient()
    health = await client.get("/health")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    completion = await client.post("/v1/chat/completions", body, content_type="application/json")
    for reply in (health, completion):
        assert reply.status_code == 503, reply.content
        assert b"127.0.0.1" not in reply.content and b":9" not in reply.content, reply.content
    assert json.loads(completion.content)["error"]["code"] == "engine_unavailable"
