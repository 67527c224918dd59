"""Acceptance: each tool-call parser and reasoning parser, through the official openai client against the
stack (daphne, Redis, real engines), streamed and not.

Beside the session's stack engine, this module starts one engine per parser on the stack's Redis, each over
the tiny random checkpoint of a family that writes that format (`tests.engine.families`). A random model
does not write tool calls or ``<think>`` blocks by itself, so the requests make it: a ``guided_choice`` of
one text, the exact output the family's model would write, which the engine's grammar makes it generate
token by token. What the API answers is then the parsers' reading of a real engine's stream.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from inference_engine.tokenizer import load_hf_tokenizer
from tests.chat.wsclient import ChatSocket
from tests.engine import families
from tests.web.stack import Stack, engine_flags

pytestmark = pytest.mark.timeout(600)

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME_CALL = '{"name": "get_time", "arguments": {"zone": "CET"}}'
WEATHER = ("get_weather", '{"city": "Paris"}')
TIME = ("get_time", '{"zone": "CET"}')
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]},
        },
    }
    for name, arg in (("get_weather", "city"), ("get_time", "zone"))
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]

# A template in the manner of Qwen3's: ``enable_thinking: false`` writes an empty reasoning block into the
# prompt, so the model answers at once.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)

# served name: (family, engine flags). The Llama engine reads DeepSeek-R1's reasoning too (R1's distilled
# Llama): its tool-call answers, which a grammar writes, show that the reasoning parser leaves them alone.
ENGINES = {
    "parsers-llama3": ("llama3", ["--tool-call-parser", "llama3_json", "--reasoning-parser", "deepseek_r1"]),
    "parsers-mistral": ("mistral", ["--tool-call-parser", "mistral"]),
    "parsers-granite": ("granite", ["--tool-call-parser", "granite"]),
    "parsers-qwen3": ("qwen3", ["--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]),
}


def _thinking_folder(family: str, folder: Path) -> Path:
    """The family's checkpoint with `THINKING_TEMPLATE` as its chat template."""
    source = families.folder(family)
    folder.mkdir()
    for path in source.iterdir():
        if path.name != "tokenizer_config.json":
            (folder / path.name).symlink_to(path)
    config = json.loads((source / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINKING_TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def engines(stack: Stack, tmp_path_factory) -> Iterator[dict[str, Path]]:
    """Served name: checkpoint folder, for every engine of `ENGINES`, running until the module ends."""
    folders = {
        name: _thinking_folder(family, tmp_path_factory.mktemp(name) / "model")
        if name == "parsers-qwen3"
        else families.folder(family)
        for name, (family, _) in ENGINES.items()
    }
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, (_, flags) in ENGINES.items():
            procs[name] = stack._spawn(
                name,
                "-m",
                "inference_engine",
                "serve",
                "--model",
                str(folders[name]),
                "--served-model-name",
                name,
                "--redis-url",
                stack.redis.url,
                *engine_flags(),
                "--max-model-len",
                "256",
                "--kv-cache-memory-bytes",
                str(16 * 2**20),
                *flags,
            )
        _wait_served(stack, procs)
        yield folders
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_served(stack: Stack, procs: dict[str, subprocess.Popen], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"engine {name} exited with {proc.returncode}:\n{stack.log(name)}")
        with urllib.request.urlopen(stack.base_url + "/health", timeout=5) as reply:
            if set(procs) <= set(json.load(reply).get("models", {})):
                return
        time.sleep(0.3)
    raise TimeoutError("\n".join(stack.log(name) for name in procs))


@pytest.fixture(scope="module")
def client(stack: Stack, engines) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0, timeout=120)


def _answers(client: openai.OpenAI, max_tokens: int = 48, **kwargs) -> list[dict]:
    """The answer whole and streamed, each as {content, reasoning, calls, finish}. (The tiny models' context
    is 256 tokens; the tools' prompt takes about 200 of them.)"""
    kwargs |= {"max_tokens": max_tokens, "temperature": 0}
    full = client.chat.completions.create(**kwargs).choices[0]
    message = full.message
    whole = {
        "content": message.content,
        "reasoning": (message.model_extra or {}).get("reasoning_content"),
        "calls": [(c.function.name, c.function.arguments) for c in message.tool_calls or []],
        "finish": full.finish_reason,
    }
    ids = {c.id for c in message.tool_calls or []}
    assert len(ids) == len(whole["calls"])
    content = reasoning = ""
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or []:
                if call.id is not None:
                    assert call.index not in calls and call.function.name
                    calls[call.index] = [call.function.name, ""]
                calls[call.index][1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    streamed = {
        "content": content or None,
        "reasoning": reasoning or None,
        "calls": [tuple(calls[i]) for i in sorted(calls)],
        "finish": finish,
    }
    return [whole, streamed]


@pytest.mark.parametrize(
    ("model", "output", "content", "calls"),
    [
        (
            "parsers-llama3",
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
            None,
            [WEATHER],
        ),
        ("parsers-llama3", f"{CALL}; {TIME_CALL}", None, [WEATHER, TIME]),
        ("parsers-mistral", f"[TOOL_CALLS][{CALL}, {TIME_CALL}]", None, [WEATHER, TIME]),
        ("parsers-mistral", f"Let me look.\n[TOOL_CALLS] [{CALL}]", "Let me look.", [WEATHER]),
        ("parsers-granite", f"<|tool_call|>[{CALL}]", None, [WEATHER]),
        ("parsers-granite", f"<tool_call>[{TIME_CALL}]", None, [TIME]),
        ("parsers-mistral", "[TOOL_CALLS] not a list", "[TOOL_CALLS] not a list", []),
    ],
)
def test_tool_calls_in_each_format(client, model, output, content, calls) -> None:
    answers = _answers(
        client, model=model, messages=MESSAGES, tools=TOOLS, extra_body={"guided_choice": [output]}
    )
    finish = "tool_calls" if calls else "stop"
    expected = {"content": content, "reasoning": None, "calls": calls, "finish": finish}
    assert answers == [expected, expected]


def test_qwen3_reasoning_then_a_tool_call(client) -> None:
    reasoning = "The user wants the weather; I will ask the tool."
    output = f"<think>\n{reasoning}\n</think>\n\n<tool_call>\n{CALL}\n</tool_call>"
    answers = _answers(
        client,
        max_tokens=60,
        model="parsers-qwen3",
        messages=MESSAGES,
        tools=TOOLS[:1],
        extra_body={"guided_choice": [output]},
    )
    expected = {"content": None, "reasoning": reasoning, "calls": [WEATHER], "finish": "tool_calls"}
    assert answers == [expected, expected]


@pytest.mark.parametrize(
    ("output", "reasoning", "content"),
    [
        (
            "<think>\nA greeting: greet back.\n</think>\n\nHello! How can I help?",
            "A greeting: greet back.",
            "Hello! How can I help?",
        ),
        ("Hello, no thinking.", None, "Hello, no thinking."),
        ("<think>\nno end to the block", "no end to the block", None),
    ],
)
def test_qwen3_reasoning_content(client, output, reasoning, content) -> None:
    answers = _answers(
        client, model="parsers-qwen3", messages=MESSAGES, extra_body={"guided_choice": [output]}
    )
    expected = {"content": content, "reasoning": reasoning, "calls": [], "finish": "stop"}
    assert answers == [expected, expected]


def test_qwen3_enable_thinking_reaches_the_template(client, engines) -> None:
    """``chat_template_kwargs: {"enable_thinking": false}`` renders the empty block into the prompt: the
    prompt grows by exactly the tokens the engine's tokenizer gives that rendering."""
    tokenizer = load_hf_tokenizer(engines["parsers-qwen3"], [])
    rendered = {
        thinking: tokenizer.apply_chat_template(MESSAGES, chat_template_kwargs={"enable_thinking": thinking})
        for thinking in (True, False)
    }
    assert rendered[False].endswith("<think>\n\n</think>\n\n") and "<think>" not in rendered[True]
    grown = len(tokenizer.encode(rendered[False])) - len(tokenizer.encode(rendered[True]))
    usage = {
        thinking: client.chat.completions.create(
            model="parsers-qwen3",
            messages=MESSAGES,
            max_tokens=1,
            extra_body={"chat_template_kwargs": {"enable_thinking": thinking}},
        ).usage.prompt_tokens
        for thinking in (True, False)
    }
    assert grown > 0 and usage[False] - usage[True] == grown


def test_deepseek_r1_answers_start_in_the_reasoning(client, stack, engines) -> None:
    """The prompt opened the block: an answer that never closes it is all reasoning. Its text is what the
    same engine completes for the same prompt."""
    answers = _answers(client, model="parsers-llama3", messages=MESSAGES, max_tokens=12)
    prompt = load_hf_tokenizer(engines["parsers-llama3"], []).apply_chat_template(MESSAGES)
    raw = client.completions.create(model="parsers-llama3", prompt=prompt, max_tokens=12, temperature=0)
    text = raw.choices[0].text
    assert "</think>" not in text and text.strip()
    expected = {
        "content": None,
        "reasoning": text.strip(),
        "calls": [],
        "finish": raw.choices[0].finish_reason,
    }
    assert answers == [expected, expected]


@pytest.mark.parametrize(
    ("output", "reasoning", "content"),
    [
        (
            "Weighing it up.\n</think>\n\nParis is sunny.",
            None,
            "Weighing it up.\n</think>\n\nParis is sunny.",
        ),
        ("<think>Weighing it up.</think>Paris is sunny.", "Weighing it up.", "Paris is sunny."),
    ],
)
def test_deepseek_r1_grammar_answers(client, output, reasoning, content) -> None:
    """A grammar writes the answer from its first token (the engine's grammars constrain all of it): the
    answer has reasoning only where it writes the block itself."""
    answers = _answers(
        client, model="parsers-llama3", messages=MESSAGES, extra_body={"guided_choice": [output]}
    )
    expected = {"content": content, "reasoning": reasoning, "calls": [], "finish": "stop"}
    assert answers == [expected, expected]


def test_engines_without_a_reasoning_parser_leave_the_message_as_it_was(client) -> None:
    output = "<think>kept</think>as content"
    answers = _answers(
        client, model="parsers-mistral", messages=MESSAGES, extra_body={"guided_choice": [output]}
    )
    assert answers[0] == answers[1] == {"content": output, "reasoning": None, "calls": [], "finish": "stop"}
    message = (
        client.chat.completions.create(
            model="parsers-mistral", messages=MESSAGES, max_tokens=4, extra_body={"guided_choice": [output]}
        )
        .choices[0]
        .message
    )
    assert "reasoning_content" not in (message.model_extra or {})


@pytest.mark.asyncio
async def test_websocket_chat_sends_reasoning_apart(stack, engines) -> None:
    ws = await ChatSocket.open(
        stack.base_url.replace("http", "ws") + "/ws/chat/",
        origin=stack.base_url,
        protocols=["llmserve.chat", f"llmserve.key.{stack.api_key}"],
    )
    try:
        assert (await ws.receive())["type"] == "ready"
        output = f"<think>\nAsk the tool.\n</think>\n\n<tool_call>\n{CALL}\n</tool_call>"
        params = {"max_tokens": 48, "tools": TOOLS[:1], "guided_choice": [output]}
        ws.send({"type": "chat", "id": 1, "model": "parsers-qwen3", "messages": MESSAGES, "params": params})
        text = reasoning = arguments = ""
        names = []
        while (message := await asyncio.wait_for(ws.receive(), 120))["type"] in ("start", "delta"):
            text += message.get("text", "")
            reasoning += message.get("reasoning_content", "")
            for call in message.get("tool_calls", []):
                names += [call["function"]["name"]] if "id" in call else []
                arguments += call["function"]["arguments"]
        assert (text, reasoning, names, arguments) == ("", "Ask the tool.", ["get_weather"], WEATHER[1])
        assert message["type"] == "end" and message["finish_reason"] == "tool_calls"
    finally:
        ws.close()
