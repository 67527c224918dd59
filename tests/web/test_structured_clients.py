"""Acceptance: structured output and tool calling through unmodified clients (openai, LangChain, litellm) and
the WebSocket chat, against daphne serving the host project, a real engine and a real Redis."""

from __future__ import annotations

import asyncio
import json
import os

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.chat.wsclient import ChatSocket

pytestmark = pytest.mark.timeout(300)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
# "auto" leaves the choice to the model, which this small one rarely makes: a regex holds it to a Hermes call
# here, so that the server's parser of the model's own format is what turns the text into a call.
HERMES_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,9}", "unit": "celsius"\}\}'
    r"\n</tool_call>"
)


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0, timeout=120)


def _arguments(call, tool: dict) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def test_response_format_json_object_and_json_schema(client, stack) -> None:
    reply = client.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": 'Reply {"ok": true} as JSON.'}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=60,
    )
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    reply = client.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": "Describe a French person as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
        temperature=0.7,
        seed=1,
        n=2,
        max_tokens=80,
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_completions_take_vllm_guided_fields(client, stack) -> None:
    reply = client.completions.create(
        model=stack.model,
        prompt="A colour in hex:",
        max_tokens=10,
        temperature=0,
        extra_body={"guided_regex": "#[0-9a-f]{6}"},
    )
    assert len(reply.choices[0].text) == 7 and reply.choices[0].text.startswith("#")
    reply = client.completions.create(
        model=stack.model,
        prompt="Is water wet? Answer:",
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert reply.choices[0].text in ("yes", "no")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named(client, stack, stream) -> None:
    for choice, tool in (("required", None), ({"type": "function", "function": {"name": "get_time"}}, TIME)):
        kwargs = {
            "model": stack.model,
            "messages": ASK,
            "tools": TOOLS,
            "tool_choice": choice,
            "max_tokens": 80,
        }
        if stream:
            message, finish = _reassembled(
                client.chat.completions.create(stream=True, temperature=0, **kwargs)
            )
        else:
            reply = client.chat.completions.create(temperature=0, **kwargs)
            message, finish = reply.choices[0].message, reply.choices[0].finish_reason
        assert finish == "tool_calls" and message.content is None and len(message.tool_calls) == 1
        call = message.tool_calls[0]
        _arguments(
            call,
            tool
            or {
                "function": next(t for t in TOOLS if t["function"]["name"] == call.function.name)["function"]
            },
        )


class _Call:
    def __init__(self) -> None:
        self.id, self.type, self.name, self.arguments = None, None, None, ""

    @property
    def function(self):
        return self


class _Message:
    def __init__(self) -> None:
        self.content, self.tool_calls = None, []


def _reassembled(chunks) -> tuple[_Message, str | None]:
    """A streamed answer put together as OpenAI's streaming guide does: calls by index, arguments appended."""
    message, calls, finish = _Message(), {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                message.content = (message.content or "") + delta.content
            for piece in delta.tool_calls or []:
                call = calls.setdefault(piece.index, _Call())
                if piece.id:
                    assert call.id is None, "a call's id comes once"
                    call.id, call.type, call.name = piece.id, piece.type, piece.function.name
                call.arguments += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    message.tool_calls = [calls[i] for i in sorted(calls)]
    return message, finish


def test_auto_tool_calls_are_parsed_whole_and_streamed(client, stack) -> None:
    kwargs = {
        "model": stack.model,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "auto",
        "temperature": 0,
        "max_tokens": 80,
        "extra_body": {"structured_outputs": {"regex": HERMES_CALL}},
    }
    reply = client.chat.completions.create(**kwargs)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    arguments = _arguments(message.tool_calls[0], WEATHER)
    streamed, finish = _reassembled(client.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls" and streamed.content is None and len(streamed.tool_calls) == 1
    assert (
        streamed.tool_calls[0].name == "get_weather"
        and json.loads(streamed.tool_calls[0].arguments) == arguments
    )


def test_tool_choice_none_and_a_conversation_with_tool_results(client, stack) -> None:
    reply = client.chat.completions.create(
        model=stack.model, messages=ASK, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=8
    )
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason in (
        "stop",
        "length",
    )
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    conversation = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"},
    ]
    reply = client.chat.completions.create(
        model=stack.model, messages=conversation, tools=TOOLS, temperature=0, max_tokens=10
    )
    assert reply.choices[0].message.content


def test_legacy_functions(client, stack) -> None:
    reply = client.chat.completions.create(
        model=stack.model,
        messages=ASK,
        functions=[WEATHER["function"]],
        function_call={"name": "get_weather"},
        temperature=0,
        max_tokens=60,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.function_call.name == "get_weather"
    jsonschema.validate(json.loads(choice.message.function_call.arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strin"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"extra": {"guided_regex": "[a-"}}, "guided_regex"),
        ({"extra": {"structured_outputs": {"grammar": "start: nope"}}}, "structured_outputs.grammar"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}, "extra": {"guided_json": {}}}, "guided_json"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(client, stack, body, param) -> None:
    body = dict(body)
    extra = body.pop("extra", {})
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=stack.model, messages=ASK, max_tokens=5, extra_body=extra, **body
        )
    assert refused.value.body["param"] == param, refused.value.body


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)


def test_langchain_structured_output_and_bind_tools(stack) -> None:
    from langchain_core.messages import AIMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=stack.model,
        base_url=stack.base_url + "/v1",
        api_key=stack.api_key,
        temperature=0,
        max_tokens=80,
        max_retries=0,
    )
    for method in ("json_schema", "function_calling"):
        person = llm.with_structured_output(Person, method=method).invoke("Invent a person.")
        assert isinstance(person, Person), method

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "sunny"

    answer = llm.bind_tools([get_weather]).invoke("What is the weather in Paris?", max_tokens=16)
    assert isinstance(answer, AIMessage)
    forced = llm.bind_tools([get_weather], tool_choice="any").invoke("What is the weather in Paris?")
    assert forced.tool_calls and forced.tool_calls[0]["name"] == "get_weather"
    assert isinstance(forced.tool_calls[0]["args"]["city"], str)


def test_litellm_tools(stack) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import
    import litellm

    reply = litellm.completion(
        model=f"openai/{stack.model}",
        api_base=stack.base_url + "/v1",
        api_key=stack.api_key,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=80,
    )
    call = reply.choices[0].message.tool_calls[0]
    assert reply.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(
        json.loads(call.function.arguments),
        next(t for t in TOOLS if t["function"]["name"] == call.function.name)["function"]["parameters"],
    )


def test_responses_api_tools_and_text_format(client, stack) -> None:
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    response = client.responses.create(
        model=stack.model,
        input="What is the weather in Paris?",
        tools=tools,
        tool_choice="required",
        temperature=0,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].call_id.startswith("call_")
    follow_up = client.responses.create(
        model=stack.model,
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
        tools=tools,
        temperature=0,
        max_output_tokens=10,
    )
    assert follow_up.status in ("completed", "incomplete")
    events = list(
        client.responses.create(
            model=stack.model,
            input="Describe a French person.",
            text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
            temperature=0,
            max_output_tokens=80,
            stream=True,
        )
    )
    done = events[-1].response
    assert done.status == "completed"
    jsonschema.validate(json.loads(done.output_text), PERSON)
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == done.output_text
    streamed_call = list(
        client.responses.create(
            model=stack.model,
            input="Weather in Rome?",
            tools=tools,
            tool_choice={"type": "function", "name": "get_weather"},
            temperature=0,
            stream=True,
        )
    )
    arguments = "".join(e.delta for e in streamed_call if e.type == "response.function_call_arguments.delta")
    final = streamed_call[-1].response.output[0]
    assert final.type == "function_call" and final.name == "get_weather" and final.arguments == arguments
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


@pytest.mark.asyncio
async def test_websocket_chat_takes_response_format_and_tools(stack) -> None:
    ws = await ChatSocket.open(
        stack.base_url.replace("http", "ws") + "/ws/chat/",
        origin=stack.base_url,
        protocols=["llmserve.chat", f"llmserve.key.{stack.api_key}"],
    )
    try:
        assert (await ws.receive())["type"] == "ready"
        answers = []
        for request_id, params in (
            (
                1,
                {
                    "temperature": 0,
                    "max_tokens": 80,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "p", "schema": PERSON},
                    },
                },
            ),
            (2, {"temperature": 0, "max_tokens": 80, "tools": TOOLS, "tool_choice": "required"}),
        ):
            ws.send(
                {"type": "chat", "id": request_id, "model": stack.model, "messages": ASK, "params": params}
            )
            text, calls = "", []
            while (message := await asyncio.wait_for(ws.receive(), 120))["type"] in ("start", "delta"):
                text += message.get("text", "")
                calls += message.get("tool_calls", [])
            answers.append((text, calls, message))
        (text, _, end), (_, calls, end_calls) = answers
        assert end["finish_reason"] == "stop"
        jsonschema.validate(json.loads(text), PERSON)
        assert end_calls["finish_reason"] == "tool_calls" and calls[0]["function"]["name"] in (
            "get_weather",
            "get_time",
        )
    finally:
        ws.close()


def test_the_engine_refuses_a_bad_constraint_instead_of_acknowledging_it(stack) -> None:
    """Past the web tier (a client on the bus itself): the engine compiles the grammar before it acknowledges
    the request, so a bad one is refused where the ack would be, with its field, however often it comes."""
    from inference_engine.bus.client import EngineClient
    from inference_engine.errors import InvalidRequestError

    client = EngineClient(stack.redis.url)
    try:
        bad = {"max_tokens": 8, "structured_outputs": {"json": {"type": "object", "uniqueItems": True}}}
        for _ in range(2):  # the second time from the compiled-grammar cache
            with pytest.raises(InvalidRequestError) as refused:
                client.generate(stack.model, "Hi", bad)
            assert refused.value.param == "structured_outputs.json"
        params = {"max_tokens": 40, "temperature": 0, "structured_outputs": {"choice": ["red", "blue"]}}
        stream = client.generate(stack.model, messages=ASK, tools=TOOLS, params=params)
        assert stream.tool_parser == "hermes"
        assert stream.result().outputs[0].text in ("red", "blue")
    finally:
        client.close()
