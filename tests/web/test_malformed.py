"""Acceptance: malformed input always gets a 4xx OpenAI-style error, never a 5xx, and the engine keeps
serving.

Raw HTTP (http.client), so that the bodies can be anything a client could send.
"""

from __future__ import annotations

import http.client
import json

import pytest

pytestmark = pytest.mark.timeout(300)

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def _chat(**fields) -> bytes:
    return json.dumps({"model": "smol", "messages": USER, "max_tokens": 4, **fields}).encode()


def _raw_chat(field: str) -> bytes:
    """A chat body with one field written as raw JSON text (for literals json.dumps would not write)."""
    return _chat()[:-1] + b", " + field.encode() + b"}"


# (name, path, body, content type, expected status, expected param or None)
CASES = [
    ("bad json", CHAT, b'{"model": "smol", "messages": [', "application/json", 400, None),
    ("not an object", CHAT, b"[1, 2]", "application/json", 400, None),
    ("invalid utf-8", CHAT, b'{"model": "\xff\xfe"}', "application/json", 400, None),
    ("deep nesting", CHAT, b"[" * 100_000 + b"]" * 100_000, "application/json", 400, None),
    ("empty body", CHAT, b"", "application/json", 400, None),
    ("missing model", CHAT, json.dumps({"messages": USER}).encode(), "application/json", 400, "model"),
    ("model not a string", CHAT, _chat(model=5), "application/json", 400, "model"),
    ("temperature string", CHAT, _chat(temperature="hot"), "application/json", 400, "temperature"),
    ("max_tokens string", CHAT, _chat(max_tokens="5"), "application/json", 400, "max_tokens"),
    ("n boolean", CHAT, _chat(n=True), "application/json", 400, "n"),
    ("stream string", CHAT, _chat(stream="yes"), "application/json", 400, "stream"),
    ("stop number", CHAT, _chat(stop=5), "application/json", 400, "stop"),
    ("messages string", CHAT, _chat(messages="hi"), "application/json", 400, "messages"),
    ("message not object", CHAT, _chat(messages=["hi"]), "application/json", 400, "messages[0]"),
    (
        "bad role",
        CHAT,
        _chat(messages=[{"role": "robot", "content": "x"}]),
        "application/json",
        400,
        "messages[0].role",
    ),
    (
        "image part",
        CHAT,
        _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
        "application/json",
        400,
        "messages[0].content",
    ),
    ("empty messages", CHAT, _chat(messages=[]), "application/json", 400, "messages"),
    ("negative temperature", CHAT, _chat(temperature=-1), "application/json", 400, "temperature"),
    ("top_p above 1", CHAT, _chat(top_p=2), "application/json", 400, "top_p"),
    ("n zero", CHAT, _chat(n=0), "application/json", 400, "n"),
    ("max_tokens zero", CHAT, _chat(max_tokens=0), "application/json", 400, "max_tokens"),
    (
        "top_logprobs too many",
        CHAT,
        _chat(logprobs=True, top_logprobs=50),
        "application/json",
        400,
        "top_logprobs",
    ),
    ("presence penalty", CHAT, _chat(presence_penalty=5), "application/json", 400, "presence_penalty"),
    ("logit bias range", CHAT, _chat(logit_bias={"1": 1000}), "application/json", 400, "logit_bias"),
    ("logit bias key", CHAT, _chat(logit_bias={"x": 1}), "application/json", 400, "logit_bias"),
    ("unknown parameter", CHAT, _chat(modalities=["audio"]), "application/json", 400, "modalities"),
    ("unknown model", CHAT, _chat(model="no-such-model"), "application/json", 404, "model"),
    (
        "prompt beyond max_model_len",
        COMPLETIONS,
        json.dumps({"model": "smol", "prompt": "hello " * 2000, "max_tokens": 4}).encode(),
        "application/json",
        400,
        None,
    ),
    ("max_tokens beyond context", CHAT, _chat(max_tokens=100_000), "application/json", 400, None),
    (
        "token id out of vocabulary",
        COMPLETIONS,
        json.dumps({"model": "smol", "prompt": [10**9], "max_tokens": 4}).encode(),
        "application/json",
        400,
        None,
    ),
    (
        "prompts of two kinds",
        COMPLETIONS,
        json.dumps({"model": "smol", "prompt": ["a", [1, 2]]}).encode(),
        "application/json",
        400,
        "prompt",
    ),
    # Python's json module reads NaN and Infinity (and 1e999 as infinity); no sampling field takes them.
    ("temperature NaN", CHAT, _raw_chat('"temperature": NaN'), "application/json", 400, "temperature"),
    ("top_p Infinity", CHAT, _raw_chat('"top_p": Infinity'), "application/json", 400, "top_p"),
    (
        "presence_penalty -Infinity",
        CHAT,
        _raw_chat('"presence_penalty": -Infinity'),
        "application/json",
        400,
        "presence_penalty",
    ),
    ("min_p overflowing", CHAT, _raw_chat('"min_p": 1e999'), "application/json", 400, "min_p"),
    ("logit bias NaN", CHAT, _raw_chat('"logit_bias": {"1": NaN}'), "application/json", 400, "logit_bias"),
    (
        "responses temperature NaN",
        "/v1/responses",
        b'{"model": "smol", "input": "hi", "temperature": NaN}',
        "application/json",
        400,
        "temperature",
    ),
    (
        "max_tokens 0 without echo",
        COMPLETIONS,
        json.dumps({"model": "smol", "prompt": "a", "max_tokens": 0}).encode(),
        "application/json",
        400,
        "max_tokens",
    ),
    (
        "suffix without fill-in-the-middle",
        COMPLETIONS,
        json.dumps({"model": "smol", "prompt": "a", "suffix": "b", "max_tokens": 2}).encode(),
        "application/json",
        400,
        "suffix",
    ),
    (
        "prompt over the character limit",
        COMPLETIONS,
        json.dumps({"model": "smol", "prompt": "x" * 300_000}).encode(),
        "application/json",
        400,
        "prompt",
    ),
    ("wrong content type", CHAT, _chat(), "text/plain", 415, None),
    ("form encoded", CHAT, b"model=smol", "application/x-www-form-urlencoded", 415, None),
    ("oversized body", CHAT, _chat(pad="x" * (3 * 2**20)), "application/json", 413, None),
]


def _request(
    stack, method: str, path: str, body: bytes | None, content_type: str | None, auth: bool = True
) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=120)
    headers = {"Content-Type": content_type} if content_type else {}
    if auth:
        headers["Authorization"] = f"Bearer {stack.api_key}"
    try:
        conn.request(method, path, body=body, headers=headers)
        reply = conn.getresponse()
        raw = reply.read()
        return reply.status, dict(reply.getheaders()), json.loads(raw) if raw else {}
    finally:
        conn.close()


def _assert_openai_error(status: int, headers: dict, body: dict) -> dict:
    assert headers.get("Content-Type") == "application/json", headers
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize(
    ("name", "path", "body", "content_type", "status", "param"), CASES, ids=[c[0] for c in CASES]
)
def test_malformed_input_gets_an_openai_error(stack, name, path, body, content_type, status, param) -> None:
    got, headers, answer = _request(stack, "POST", path, body, content_type)
    assert got == status, answer
    error = _assert_openai_error(got, headers, answer)
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize(
    "method, path, auth, status",
    [
        ("GET", CHAT, True, 405),
        ("PUT", "/v1/models", True, 405),
        ("GET", "/v1/models", False, 401),
        ("POST", "/tokenize", True, 415),
    ],
)
def test_other_request_errors(stack, method, path, auth, status) -> None:
    got, headers, answer = _request(stack, method, path, None, None, auth=auth)
    assert got == status
    _assert_openai_error(got, headers, answer)


def test_engine_keeps_serving_after_the_matrix(stack) -> None:
    for case in CASES:  # once more, back to back, then a normal request
        _request(stack, "POST", case[1], case[2], case[3])
    got, _, answer = _request(stack, "POST", CHAT, _chat(temperature=0), "application/json")
    assert got == 200 and answer["choices"][0]["message"]["content"]
    assert stack.engine.poll() is None
