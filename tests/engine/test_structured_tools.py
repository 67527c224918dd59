"""Tool calling in the engine's half: tools rendered into a chat template (or its fallback), and the tool-call
parsers, whose streamed answers must equal their whole-text ones however the text is cut."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from inference_engine.tokenizer import Tokenizer
from inference_engine.tool_parsers import (
    HermesToolParser,
    NamedToolCall,
    RequiredToolCalls,
    ToolParser,
    required_schema,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "18C, sunny"},
]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A template that knows tools, in the shape of Hugging Face's tool-calling templates.
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %} CALL {{ c['function']['name'] }} "
    "{{ c['function']['arguments']['city'] }}{% endfor %}\n{% endfor %}"
)


def _tokenizer(template: str) -> Tokenizer:
    return Tokenizer(HFTokenizer(models.BPE()), eos_token_ids=[0], chat_template=template)


def test_a_template_without_tools_gets_the_hermes_fallback() -> None:
    tokenizer = _tokenizer(CHATML)
    assert not tokenizer.template_reads_tools
    prompt = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS)
    system, user, assistant, result, _ = prompt.split("<|im_start|>")[1:]
    assert system.startswith("system\n") and json.dumps(TOOLS[0]) in system and "<tool_call>" in system
    assert user == "user\nWeather in Paris?<|im_end|>\n"
    call = assistant.removeprefix("assistant\n<tool_call>\n").split("\n</tool_call>")[0]
    assert json.loads(call) == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert result == "user\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>\n"
    # Without tools, a plain conversation renders as it always did.
    plain = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(plain) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_with_tools_reads_them_and_argument_objects() -> None:
    tokenizer = _tokenizer(TOOL_TEMPLATE)
    assert tokenizer.template_reads_tools
    prompt = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS)
    assert prompt.startswith("TOOLS " + json.dumps(TOOLS))
    assert "CALL get_weather Paris" in prompt and "tool: 18C, sunny" in prompt


def _streamed(parser: ToolParser, text: str, seed: int) -> tuple[str, list[tuple[str, str]]]:
    rng, content, calls = random.Random(seed), "", {}
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        pieces.append(text[i : i + n])
        i += n
    for delta in [parser.feed(p) for p in pieces] + [parser.finish()]:
        content += delta.content
        for d in delta.tool_calls:
            call = calls.setdefault(d.index, {"name": None, "arguments": ""})
            if d.id is not None:
                assert call["name"] is None and d.id.startswith("call_")  # id and name come once, first
                call["name"] = d.name
            call["arguments"] += d.arguments
    return content, [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]


HERMES = [
    (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "f", "arguments": {"x": [1, {"y": "}"}], "s": "a\\"b"}}\n</tool_call>',
        "Let me check.",
        [("get_weather", '{"city": "Paris"}'), ("f", '{"x": [1, {"y": "}"}], "s": "a\\"b"}')],
    ),
    ("No call here, only <tool and text.", "No call here, only <tool and text.", []),
    ('<tool_call>{"arguments": {"a": 1}, "name": "g"}</tool_call> after', " after", [("g", '{"a": 1}')]),
    ("<tool_call>not json</tool_call>tail", "<tool_call>not json</tool_call>tail", []),
    ('<tool_call>\n{"name": "h", "arguments": {"q": 1}}', None, [("h", '{"q": 1}')]),  # no end marker
    ('text <tool_call>{"name": "h", "arguments": {"q": 1}} and more', "text and more", [("h", '{"q": 1}')]),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES)
def test_hermes_parser_streamed_equals_whole(text, content, calls) -> None:
    whole_content, whole_calls = HermesToolParser().parse(text)
    assert whole_content == content
    assert [(c.name, c.arguments) for c in whole_calls] == calls
    for seed in range(25):
        streamed_content, streamed_calls = _streamed(HermesToolParser(), text, seed)
        assert streamed_content == (content or "") and streamed_calls == calls


def test_required_and_named_parsers() -> None:
    text = '[{"name": "a", "parameters": {"k": "v"}}, {"name": "b", "parameters": {}}]'
    content, calls = RequiredToolCalls().parse(text)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("a", '{"k": "v"}'), ("b", "{}")]
    assert len({c.id for c in calls}) == 2
    for seed in range(10):
        assert _streamed(RequiredToolCalls(), text, seed) == ("", [("a", '{"k": "v"}'), ("b", "{}")])
        assert _streamed(NamedToolCall("fn"), '{"a": [1, 2]}', seed) == ("", [("fn", '{"a": [1, 2]}')])


def test_required_schema_lists_every_function() -> None:
    functions = [TOOLS[0]["function"], {"name": "noop"}]
    schema = required_schema(functions, parallel=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    names = [option["properties"]["name"]["const"] for option in schema["items"]["anyOf"]]
    assert names == ["get_weather", "noop"]
    assert "maxItems" not in required_schema(functions, parallel=True)
