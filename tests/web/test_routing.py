"""`llmserve.routing.APIRouter` in the host project, served by daphne: the API's requests skip the host's
middleware, every other request passes through it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from llmserve.routing import _serves_api


@pytest.mark.parametrize(
    ("path", "api"),
    [
        ("/v1/chat/completions", True),
        ("/v1/models/SmolLM2-135M-Instruct", True),
        ("/v1/unknown/endpoint", True),  # the API's JSON 404
        ("/health", True),
        ("/chat/", False),
        ("/admin/", False),
        ("/nowhere", False),
    ],
)
def test_api_views_are_told_apart_by_url(path: str, api: bool) -> None:
    assert _serves_api(path) is api


def _get(url: str, key: str | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_api_requests_skip_the_host_middleware_and_pages_do_not(stack) -> None:
    # XFrameOptionsMiddleware marks every response that passes through the host's middleware.
    status, headers, body = _get(f"{stack.base_url}/v1/models", stack.api_key)
    assert status == 200 and "X-Frame-Options" not in headers
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert json.loads(body)["object"] == "list"
    status, headers, body = _get(f"{stack.base_url}/v1/unknown/endpoint", stack.api_key)
    assert status == 404 and json.loads(body)["error"]["code"] == "unknown_url"
    status, headers, _ = _get(f"{stack.base_url}/v1/models")  # no key: the API's own 401, still JSON
    assert status == 401 and headers["Content-Type"] == "application/json"
    status, headers, _ = _get(f"{stack.base_url}/accounts/login/")
    assert status == 200 and headers["X-Frame-Options"] == "DENY"
