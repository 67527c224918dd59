"""Acceptance: the examples of ../shared/seeds/001 (sections 6.1, 7.1 and 7.3), with host and model changed.

The seed starts vLLM's server as `--served-model-name my-llm` (section 5.4); here the engine serves the
bundled model and the clients name it `stack.model`. The seed's `api_key="token-abc123"` becomes a real key,
since this deployment requires one. Token limits are lowered to keep the test short on a CPU.
"""

from __future__ import annotations

import contextlib
import io
import json
import urllib.request

import openai
import pytest

pytestmark = pytest.mark.timeout(300)


def test_curl_chat_completion_has_the_documented_shape(stack) -> None:
    # curl http://localhost:8000/v1/chat/completions -H "Content-Type: application/json" -d '{...}'
    body = {
        "model": stack.model,
        "messages": [{"role": "user", "content": "请用中文介绍 vLLM 的核心优势"}],
        "max_tokens": 32,
        "temperature": 0.7,
    }
    request = urllib.request.Request(
        stack.base_url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {stack.api_key}"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.status == 200 and reply.headers["Content-Type"] == "application/json"
        answer = json.load(reply)
    assert answer["id"].startswith("chatcmpl-") and answer["object"] == "chat.completion"
    assert isinstance(answer["created"], int) and answer["model"] == stack.model
    choice = answer["choices"][0]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    usage = answer["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0


def test_python_client_example_prints_text(stack) -> None:
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        response = client.chat.completions.create(
            model=stack.model,
            messages=[
                {"role": "system", "content": "你是一个有帮助的助手"},
                {"role": "user", "content": "如何优化深度学习模型的推理速度？"},
            ],
            max_tokens=30,
            temperature=0.5,
        )
        print(response.choices[0].message.content)
    assert out.getvalue().strip()


def test_streaming_example_prints_text(stack) -> None:
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key)
    out = io.StringIO()
    pieces = 0
    with contextlib.redirect_stdout(out):
        stream_response = client.chat.completions.create(
            model=stack.model,
            messages=[{"role": "user", "content": "详细说明 vLLM 的 PagedAttention 原理"}],
            max_tokens=30,
            temperature=0.7,
            stream=True,
        )
        for chunk in stream_response:
            if chunk.choices[0].delta.content is not None:
                print(chunk.choices[0].delta.content, end="", flush=True)
                pieces += 1
    assert out.getvalue().strip() and pieces > 2
