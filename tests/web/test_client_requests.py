"""Acceptance: what real clients send is accepted. Each case replays, through the unmodified client, a request
the server used to refuse: the openai SDK (fields that change nothing here, ``null`` for optional fields, an
answer sent back as ``model_dump()``), vLLM's extras, the Agents SDK's default Responses model, LangChain,
litellm, instructor, pydantic-ai and llama-index's OpenAILike; plus the small endpoints clients probe, the
Files API's listing and deletion, CORS preflights and the prefix-cache counters. All against the session's
one stack (daphne, a real engine and Redis)."""

from __future__ import annotations

import http.client
import json
import os
import re
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.timeout(300)

ASK = [{"role": "user", "content": "Name a colour."}]
SHORT = {"max_tokens": 4, "temperature": 0}


class Colour(BaseModel):
    name: str = Field(max_length=12)


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0, timeout=120)


def _call(stack, method: str, path: str, body: Any = None, key: str | None = "", headers=None):
    """(status, headers, parsed JSON or text) of one request."""
    sent = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        sent["Authorization"] = f"Bearer {key or stack.api_key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(stack.base_url + path, data=data, method=method, headers=sent)
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            status, got, raw = reply.status, reply.headers, reply.read()
    except urllib.error.HTTPError as exc:
        status, got, raw = exc.code, exc.headers, exc.read()
    text = raw.decode()
    is_json = got.get("Content-Type", "").startswith("application/json")
    return status, got, json.loads(text) if is_json else text


# ------------------------------------------------------------------------------------------- openai SDK


def test_an_answer_sent_back_as_model_dump(client, stack) -> None:
    first = client.chat.completions.create(model=stack.model, messages=ASK, **SHORT)
    sent_back = first.choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= set(sent_back)
    again = client.chat.completions.create(
        model=stack.model, messages=[*ASK, sent_back, {"role": "user", "content": "Another."}], **SHORT
    )
    assert again.choices[0].message.content


def test_openai_fields_that_change_nothing_here(client, stack) -> None:
    answer = client.chat.completions.create(
        model=stack.model,
        messages=ASK,
        store=True,
        metadata={"team": "tests"},
        service_tier="auto",
        reasoning_effort="low",
        prompt_cache_key="colours",
        safety_identifier="user-1",
        modalities=["text"],
        prediction={"type": "content", "content": "Red"},
        verbosity="low",
        extra_body={"frobnicate": {"unknown": True}},  # unknown: ignored (and logged), as vLLM does
        **SHORT,
    )
    assert answer.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as refused:  # known fields are still checked
        client.chat.completions.create(model=stack.model, messages=ASK, metadata={"n": 1}, **SHORT)
    assert refused.value.body["param"] == "metadata.n"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=stack.model, messages=ASK, modalities=["audio"], **SHORT)
    assert refused.value.body["param"] == "modalities"


def test_null_for_optional_fields_and_empty_lists(client, stack) -> None:
    nulls = {"stream": None, "logprobs": None, "parallel_tool_calls": None, "store": None, "n": None}
    chat = client.chat.completions.create(
        model=stack.model, messages=ASK, tools=[], extra_body={**nulls, "stream_options": None}, **SHORT
    )
    assert chat.choices[0].message.content and chat.choices[0].logprobs is None
    completion = client.completions.create(
        model=stack.model, prompt="Red, green,", extra_body={"echo": None, "stream": None}, **SHORT
    )
    assert completion.choices[0].text
    status, _, body = _call(stack, "POST", "/v1/chat/completions", {"model": stack.model, "messages": None})
    assert status == 400 and body["error"]["param"] == "messages"  # a required field is still required


# ----------------------------------------------------------------------------------------- vLLM's extras


def test_prompt_logprobs_on_chat_and_completions(client, stack) -> None:
    chat = client.chat.completions.create(
        model=stack.model, messages=ASK, extra_body={"prompt_logprobs": 1}, **SHORT
    )
    positions = chat.model_extra["prompt_logprobs"]
    assert len(positions) == chat.usage.prompt_tokens and positions[0] is None
    assert all(-1e9 < lp["logprob"] <= 0 for p in positions[1:] for lp in p.values())
    completion = client.completions.create(
        model=stack.model, prompt="Red, green,", extra_body={"prompt_logprobs": 0}, **SHORT
    )
    positions = completion.choices[0].model_extra["prompt_logprobs"]
    assert len(positions) == completion.usage.prompt_tokens and positions[0] is None
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=stack.model, messages=ASK, stream=True, extra_body={"prompt_logprobs": 1}, **SHORT
        )


def test_continue_final_message_with_echo(client, stack) -> None:
    messages = [*ASK, {"role": "assistant", "content": "My favourite colour is"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False, "echo": True}
    answer = client.chat.completions.create(model=stack.model, messages=messages, extra_body=extra, **SHORT)
    content = answer.choices[0].message.content
    assert content.startswith("My favourite colour is") and len(content) > len("My favourite colour is")
    streamed = client.chat.completions.create(
        model=stack.model, messages=messages, extra_body=extra, stream=True, **SHORT
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == content
    # The open turn is one prompt token shorter than a closed one and the generation prompt
    fresh = client.chat.completions.create(model=stack.model, messages=messages, **SHORT)
    assert answer.usage.prompt_tokens < fresh.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=stack.model, messages=ASK, extra_body={"continue_final_message": True}, **SHORT
        )
    assert refused.value.body["param"] == "continue_final_message"


def test_a_key_may_ask_for_the_priorities_it_is_allowed(stack) -> None:
    """An API key's own min_priority (set in the admin) bounds its requests' priority instead of the
    LLMSERVE['MIN_PRIORITY'] default: more urgent within it, refused beyond it."""
    raw = stack.manage("llmserve_createkey", "urgent-tests").strip()
    stack.manage(
        "shell",
        "-c",
        "from llmserve.models import APIKey as K; K.objects.filter(name='urgent-tests')"
        ".update(min_priority=-5)",
    )
    urgent = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=raw, max_retries=0, timeout=120)
    extra = {"priority": -5}
    done = urgent.chat.completions.create(model=stack.model, messages=ASK, extra_body=extra, **SHORT)
    assert done.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as refused:
        urgent.completions.create(model=stack.model, prompt="Hi", extra_body={"priority": -6}, **SHORT)
    assert refused.value.body["param"] == "priority"


def test_template_options_truncation_priority_and_token_ids(client, stack) -> None:
    plain = client.chat.completions.create(model=stack.model, messages=ASK, **SHORT)
    no_prompt = client.chat.completions.create(
        model=stack.model,
        messages=ASK,
        extra_body={"add_generation_prompt": False, "chat_template_kwargs": {"enable_thinking": False}},
        **SHORT,
    )
    assert no_prompt.usage.prompt_tokens < plain.usage.prompt_tokens
    cut = client.completions.create(
        model=stack.model,
        prompt="One two three four five six seven eight nine ten eleven",
        **SHORT,
        extra_body={"truncate_prompt_tokens": 5, "priority": 3},
    )
    assert cut.usage.prompt_tokens == 5
    with pytest.raises(openai.BadRequestError) as refused:  # more urgent than a client may ask
        client.completions.create(model=stack.model, prompt="Hi", extra_body={"priority": -1}, **SHORT)
    assert refused.value.body["param"] == "priority"
    ids = client.chat.completions.create(
        model=stack.model,
        messages=ASK,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
        **SHORT,
    )
    tokens = ids.choices[0].logprobs.content
    assert all(re.fullmatch(r"token_id:\d+", t.token) for t in tokens)
    assert all(re.fullmatch(r"token_id:\d+", top.token) for t in tokens for top in t.top_logprobs)


def test_best_of_and_request_id(client, stack) -> None:
    best = client.completions.create(
        model=stack.model, prompt="Red, green,", n=1, best_of=3, max_tokens=4, temperature=1.0, seed=1
    )
    assert [c.index for c in best.choices] == [0] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens > 4  # every candidate was generated
    answer = client.chat.completions.create(
        model=stack.model, messages=ASK, extra_body={"request_id": "client-chosen-1"}, **SHORT
    )
    assert answer.id == "chatcmpl-client-chosen-1"
    with pytest.raises(openai.BadRequestError) as refused:  # a request id names one request only
        client.chat.completions.create(
            model=stack.model, messages=ASK, extra_body={"request_id": "client-chosen-1"}, **SHORT
        )
    assert "duplicate" in refused.value.body["message"]


# ------------------------------------------------------------------------------------------ Responses API


def test_responses_fields_the_agents_sdk_and_others_send(client, stack) -> None:
    response = client.responses.create(
        model=stack.model,
        input="Name a colour.",
        include=[],
        tools=[],
        truncation="disabled",
        reasoning={"effort": "low"},
        text={"verbosity": "medium"},
        top_logprobs=0,
        background=False,
        max_output_tokens=4,
        temperature=0,
    )
    assert response.output_text
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=stack.model, input="Hi", background=True, max_output_tokens=4)
    assert refused.value.body["param"] == "background"


def test_responses_input_items(client, stack) -> None:
    first = client.responses.create(model=stack.model, input="Name a colour.", max_output_tokens=4)
    second = client.responses.create(
        model=stack.model, input="Another.", previous_response_id=first.id, max_output_tokens=4
    )
    items = client.responses.input_items.list(second.id, order="asc")
    texts = [(i.role, i.content[0].text) for i in items.data]
    assert texts == [("user", "Name a colour."), ("assistant", first.output_text), ("user", "Another.")]
    newest = client.responses.input_items.list(second.id, limit=1)
    assert newest.has_more and newest.data[0].id == items.data[-1].id
    assert [i.id for i in client.responses.input_items.list(second.id, after=newest.data[0].id)] == [
        i.id for i in reversed(items.data[:-1])
    ]


def test_agents_sdk_default_responses_model(stack) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # tracing would export to OpenAI
    model = agents.OpenAIResponsesModel(
        model=stack.model,
        openai_client=openai.AsyncOpenAI(
            base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0
        ),
    )
    agent = agents.Agent(
        name="colours",
        instructions="Answer in one word.",
        model=model,
        model_settings=agents.ModelSettings(max_tokens=64, temperature=0),
    )
    result = agents.Runner.run_sync(agent, "Name a colour.")
    assert isinstance(result.final_output, str) and result.final_output


# ---------------------------------------------------------------------------------------- other clients


def test_langchain_sends_an_answer_back(stack) -> None:
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=stack.model, base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0, **SHORT
    )
    first = llm.invoke(ASK[0]["content"])
    again = llm.invoke([HumanMessage(ASK[0]["content"]), first, HumanMessage("Another.")])
    assert again.content
    responses = ChatOpenAI(
        model=stack.model,
        base_url=stack.base_url + "/v1",
        api_key=stack.api_key,
        max_retries=0,
        use_responses_api=True,
        **SHORT,
    )
    assert responses.invoke(ASK[0]["content"]).text


def test_litellm_chat(stack) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import
    import litellm

    reply = litellm.completion(
        model=f"openai/{stack.model}",
        api_base=stack.base_url + "/v1",
        api_key=stack.api_key,
        messages=ASK,
        **SHORT,
    )
    assert reply.choices[0].message.content


def test_instructor_structured_output(stack) -> None:
    instructor = pytest.importorskip("instructor")
    patched = instructor.from_openai(
        openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)
    )
    colour = patched.chat.completions.create(
        model=stack.model, messages=ASK, response_model=Colour, max_retries=0, max_tokens=40, temperature=0
    )
    assert isinstance(colour, Colour)


def test_pydantic_ai_text_and_structured_output(stack) -> None:
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=stack.base_url + "/v1", api_key=stack.api_key)
    model = OpenAIChatModel(stack.model, provider=provider)
    text = Agent(model).run_sync(ASK[0]["content"], model_settings={"max_tokens": 4, "temperature": 0})
    assert isinstance(text.output, str) and text.output
    colour = Agent(model, output_type=Colour, retries=0).run_sync(
        ASK[0]["content"], model_settings={"max_tokens": 40, "temperature": 0}
    )
    assert isinstance(colour.output, Colour)


def test_llama_index_openai_like(stack) -> None:
    openai_like = pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core.llms import ChatMessage

    llm = openai_like.OpenAILike(
        model=stack.model,
        api_base=stack.base_url + "/v1",
        api_key=stack.api_key,
        is_chat_model=True,
        max_tokens=4,
        temperature=0,
        max_retries=0,
    )
    assert llm.chat([ChatMessage(role="user", content=ASK[0]["content"])]).message.content
    assert llm.complete("Red, green,").text


# ----------------------------------------------------------------------------- endpoints clients probe


def test_version_ping_and_json_errors_everywhere(stack) -> None:
    status, _, body = _call(stack, "GET", "/version", key=None)
    assert status == 200 and isinstance(body["version"], str)
    for method in ("GET", "POST"):
        status, _, body = _call(stack, method, "/ping", key=None)
        assert status == 200 and body["status"] == "ok"
    for path in ("/score", "/rerank", "/v1/rerank", "/v2/rerank", "/pooling", "/v1/no/such/thing"):
        status, _, body = _call(stack, "POST", path, {"model": stack.model})
        assert status == 404 and body["error"]["code"] == "unknown_url", path
    status, _, body = _call(stack, "GET", "/version/latest")  # no route at all: the host's JSON 404
    assert status == 404 and body["error"]["code"] == "not_found"


def _upload(stack, key: str, chunked: bool = False) -> tuple[int, Any]:
    boundary = "llmserveboundary"
    line = {"custom_id": "a", "url": "/v1/completions", "body": {"model": stack.model, "prompt": "Hi"}}
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
        f"Content-Type: application/jsonl\r\n\r\n{json.dumps(line)}\n\r\n--{boundary}--\r\n"
    ).encode()
    connection = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=60)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": f"multipart/form-data; boundary={boundary}"}
    if chunked:
        connection.request("POST", "/v1/files", body=iter([body]), headers=headers, encode_chunked=True)
    else:
        connection.request("POST", "/v1/files", body=body, headers=headers)
    reply = connection.getresponse()
    status, parsed = reply.status, json.loads(reply.read())
    connection.close()
    return status, parsed


def test_files_list_and_delete_per_key(stack) -> None:
    other = stack.manage("llmserve_createkey", "other-files").strip()
    created = [_upload(stack, stack.api_key)[1]["id"] for _ in range(3)]
    theirs = _upload(stack, other)[1]["id"]
    status, _, listed = _call(stack, "GET", "/v1/files?purpose=batch")
    mine = [f["id"] for f in listed["data"]]
    assert status == 200 and set(created) <= set(mine) and theirs not in mine
    status, _, page = _call(stack, "GET", f"/v1/files?limit=1&after={mine[0]}")
    assert page["data"][0]["id"] == mine[1] and page["has_more"] == (len(mine) > 2)
    status, _, none = _call(stack, "GET", "/v1/files?purpose=batch_output")
    assert not set(created) & {f["id"] for f in none["data"]}
    status, _, body = _call(stack, "DELETE", f"/v1/files/{created[0]}", key=other)
    assert status == 404  # another key's file does not exist for it
    status, _, body = _call(stack, "DELETE", f"/v1/files/{created[0]}")
    assert status == 200 and body == {"id": created[0], "object": "file", "deleted": True}
    assert _call(stack, "GET", f"/v1/files/{created[0]}")[0] == 404
    status, _, body = _call(stack, "GET", "/v1/files", key=other)
    assert [f["id"] for f in body["data"]] == [theirs]
    status, body = _upload(stack, stack.api_key, chunked=True)  # no Content-Length
    assert status == 411 and body["error"]["code"] == "length_required"


def test_openai_sdk_files_list_and_delete(client, stack) -> None:
    line = {"custom_id": "a", "url": "/v1/completions", "body": {"model": stack.model, "prompt": "Hi"}}
    uploaded = client.files.create(file=("in.jsonl", json.dumps(line).encode()), purpose="batch")
    assert uploaded.id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.delete(uploaded.id).deleted


def test_cors_preflight_and_headers(stack) -> None:
    preflight = {
        "Origin": stack.cors_origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
    }
    status, headers, _ = _call(stack, "OPTIONS", "/v1/chat/completions", key=None, headers=preflight)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == stack.cors_origin
    allowed = headers["Access-Control-Allow-Headers"]
    assert "authorization" in allowed and "x-stainless-os" in allowed
    assert "POST" in headers["Access-Control-Allow-Methods"]
    status, headers, _ = _call(stack, "GET", "/v1/models", headers={"Origin": stack.cors_origin})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == stack.cors_origin
    stranger = {**preflight, "Origin": "http://127.0.0.1:1"}
    status, headers, _ = _call(stack, "OPTIONS", "/v1/chat/completions", key=None, headers=stranger)
    assert "Access-Control-Allow-Origin" not in headers


def test_prefix_cache_counters(client, stack) -> None:
    prompt = "The colours of the rainbow are red, orange, yellow, green, blue, indigo and violet. " * 3
    for _ in range(2):
        client.completions.create(model=stack.model, prompt=prompt, **SHORT)
    _, _, text = _call(stack, "GET", "/metrics", key=None)

    def value(name: str) -> float:
        match = re.search(rf'^{re.escape(name)}\{{model_name="{stack.model}"\}} (\S+)$', text, re.M)
        assert match, name
        return float(match.group(1))

    queries, hits = value("vllm:prefix_cache_queries_total"), value("vllm:prefix_cache_hits_total")
    assert queries >= hits > 0


# ------------------------------------------------------------------------------ unknown fields, in process


def test_unknown_fields_are_logged_once_or_refused_in_strict_mode(caplog, settings) -> None:
    from llmserve.api import errors, schema

    body = {"model": "m", "messages": [{"role": "user", "content": "Hi", "x_unknown_in_message": 1}]}
    with caplog.at_level("WARNING", logger="llmserve.api"):
        for _ in range(2):
            assert schema.parse("chat", body).messages == [{"role": "user", "content": "Hi"}]
    assert [r.getMessage() for r in caplog.records].count(
        "ignored the unknown request field 'x_unknown_in_message' (logged once per field name)"
    ) == 1
    settings.LLMSERVE = {**settings.LLMSERVE, "REJECT_UNKNOWN_FIELDS": True}
    with pytest.raises(errors.BadRequest) as refused:
        schema.parse("chat", body)
    assert (
        refused.value.param == "messages[0].x_unknown_in_message"
        and refused.value.code == "unknown_parameter"
    )
    with pytest.raises(errors.BadRequest) as refused:  # known fields are as strict as ever, in both modes
        schema.parse("chat", {**body, "messages": body["messages"][:1], "temperature": "0.5"})
    assert refused.value.param == "temperature"
