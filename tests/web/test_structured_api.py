"""The web tier's half of structured output and tools, in-process: request bodies become the right
constraint, tools and parser choice (or a 400 naming the field), and answers the right OpenAI shapes."""

from __future__ import annotations

import json

import pytest

from inference_engine.bus.client import GenerationResult
from inference_engine.bus.protocol import CompletionDelta, RequestDelta, Usage
from inference_engine.outputs import CompletionOutput
from llmserve.api import schema
from llmserve.api.errors import BadRequest
from llmserve.api.responses import ResponseBuilder
from llmserve.api.responses_api import _responses_param
from llmserve.bulk import requests
from llmserve.bulk.models import BulkJob

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "Weather?"}]


def _chat(**fields) -> schema.GenerationRequest:
    return schema.parse("chat", {"model": "m", "messages": ASK, **fields})


def test_constraints_from_each_field() -> None:
    person = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": person}}},
            {"json": person},
        ),
        (
            {"guided_json": json.dumps(person), "guided_whitespace_pattern": " *"},
            {"json": person, "whitespace_pattern": " *"},
        ),
        ({"guided_choice": ["a", "b"]}, {"choice": ["a", "b"]}),
        ({"structured_outputs": {"regex": "[0-9]+"}}, {"regex": "[0-9]+"}),
    ]
    for fields, expected in cases:
        spec = _chat(**fields).params.structured_outputs
        assert (spec.to_dict() if spec else None) == expected, fields
    completion = schema.parse("completion", {"model": "m", "prompt": "x", "guided_grammar": 'start: "x"'})
    assert completion.params.structured_outputs.grammar == 'start: "x"'


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": 3}}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"json": {"type": "object"}, "regex": "x"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
        ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
        ({"guided_regex": "x", "guided_choice": ["x"]}, "guided_choice"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": "required", "guided_regex": "x"}, "tool_choice"),
        ({"tools": [TOOL, TOOL]}, "tools"),
        ({"tools": [TOOL], "functions": [TOOL["function"]]}, "functions"),
        (
            {
                "tools": [{**TOOL, "function": {"name": "f", "parameters": {"type": "strin"}}}],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            "tools[0].function.parameters",
        ),
    ],
)
def test_refusals_name_the_field(fields, param) -> None:
    with pytest.raises(BadRequest) as refused:
        _chat(**fields)
    assert refused.value.param == param, refused.value.message


def test_tool_choice_modes() -> None:
    auto = _chat(tools=[TOOL])
    assert auto.tools == [TOOL] and auto.tool_choice.mode == "auto" and auto.params.structured_outputs is None
    none = _chat(tools=[TOOL], tool_choice="none")
    assert none.tools is None and none.tool_choice is None
    required = _chat(tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    assert required.params.structured_outputs.json["maxItems"] == 1
    named = _chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.tool_choice.function == "get_weather"
    assert named.params.structured_outputs.json == TOOL["function"]["parameters"]
    legacy = _chat(functions=[TOOL["function"]], function_call={"name": "get_weather"})
    assert legacy.tool_choice.legacy and legacy.tools == [TOOL]
    # Earlier calls and their results reach the engine as the chat template reads them.
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    messages = [
        *ASK,
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sun"},
    ]
    engine = _chat(messages=messages, tools=[TOOL]).messages
    assert engine[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert engine[2] == {"role": "tool", "content": "sun", "tool_call_id": "c1"}


def _result(text: str, reason: str = "stop") -> GenerationResult:
    return GenerationResult(
        "r", 3, [CompletionOutput(0, text, [1], finish_reason=reason)], Usage(3, 1, 4), tool_parser="hermes"
    )


def test_answers_with_tool_calls() -> None:
    auto = _chat(tools=[TOOL])
    body = ResponseBuilder(auto).full(
        _result('Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    )
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Oslo"}',
    }
    plain = ResponseBuilder(auto).full(_result("It is sunny."))["choices"][0]
    assert plain["finish_reason"] == "stop" and "tool_calls" not in plain["message"]
    cut = ResponseBuilder(_chat(tools=[TOOL], tool_choice="required")).full(
        _result('[{"name": "get_weather", "parameters": {"ci', "length")
    )
    assert cut["choices"][0]["finish_reason"] == "length"
    legacy = _chat(functions=[TOOL["function"]], function_call={"name": "get_weather"})
    choice = ResponseBuilder(legacy).full(_result('{"city": "Rome"}'))["choices"][0]
    assert choice["finish_reason"] == "function_call"
    assert choice["message"]["function_call"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}


def test_streamed_chunks_carry_call_pieces() -> None:
    request = _chat(
        tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True
    )
    builder = ResponseBuilder(request, tool_format="hermes")
    chunks = [
        builder.delta_chunk(RequestDelta("r", [CompletionDelta(0, text, [1])]))
        for text in ('{"city"', ': "Oslo"}')
    ]
    last = builder.delta_chunk(RequestDelta("r", [CompletionDelta(0, finish_reason="stop")], finished=True))
    first, second = (c["choices"][0]["delta"]["tool_calls"][0] for c in chunks)
    assert first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert second == {"index": 0, "function": {"arguments": ': "Oslo"}'}}
    assert last["choices"][0]["finish_reason"] == "tool_calls"


def test_responses_api_fields() -> None:
    body = schema.validate(
        schema.ResponsesRequest,
        {
            "model": "m",
            "input": [
                {"role": "user", "content": "Weather?"},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sun"},
            ],
            "tools": [
                {"type": "function", "name": "get_weather", "parameters": TOOL["function"]["parameters"]}
            ],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
        },
    )
    messages = [m.as_engine_message() for m in body.input_messages()]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    fields = body.chat_fields()
    assert fields["tools"] == [TOOL] and fields["tool_choice"]["function"]["name"] == "get_weather"
    assert fields["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": {"type": "object"}},
    }
    assert _responses_param("tools[1].function.parameters") == "tools[1].parameters"
    assert _responses_param("response_format.json_schema.schema") == "text.format.schema"


def test_batch_items_and_bulk_jobs_pass_constraints_on() -> None:
    job = BulkJob(model="m", kind=BulkJob.Kind.CHAT, template="")
    item = requests.build(
        job,
        None,
        {"model": "m", "messages": ASK, "tools": [TOOL], "response_format": {"type": "json_object"}},
    )
    assert item.tools == [TOOL] and item.params.structured_outputs.json_object
    extraction = requests.job_params({"structured_outputs": {"json": {"type": "object"}}, "max_tokens": 50})
    assert extraction.structured_outputs.json == {"type": "object"}
    with pytest.raises(BadRequest) as refused:
        requests.job_params({"structured_outputs": {"regex": "(("}})
    assert refused.value.param == "params"
