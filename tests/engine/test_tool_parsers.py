"""The tool-call parsers of the model families (vLLM's ``--tool-call-parser`` names) and the reasoning parsers
(``--reasoning-parser``): each answer whole and streamed in random cuts gives the same content, calls and
reasoning; text that is not calls or reasoning comes out as content, never an exception."""

from __future__ import annotations

import json
import random
import string

import pytest

from inference_engine.config import EngineConfig
from inference_engine.errors import InvalidRequestError
from inference_engine.reasoning_parsers import PARSERS as REASONING_PARSERS
from inference_engine.reasoning_parsers import get_reasoning_parser
from inference_engine.tool_parsers import PARSERS, get_parser

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CALL2 = '{"name": "f", "arguments": {"x": [1, {"y": "]}"}], "s": "a\\"b;,"}}'
WEATHER = ("get_weather", '{"city": "Paris"}')
F = ("f", '{"x": [1, {"y": "]}"}], "s": "a\\"b;,"}')

# parser: [(answer, content of the whole answer, calls)]
CASES = {
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [WEATHER]),
        (f"<|python_tag|>{CALL}; {CALL2}", None, [WEATHER, F]),
        (f"  \n{CALL};{CALL2}", None, [WEATHER, F]),
        (f"Let me look.\n<|python_tag|>{CALL}", "Let me look.", [WEATHER]),
        (f"{CALL} and then text", " and then text", [WEATHER]),
        ('{"parameters": {"city": "Paris"}, "name": "get_weather"}', None, [WEATHER]),  # keys in any order
        ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but no call
        ("<|python_tag|>brave_search.call(query='x')", "<|python_tag|>brave_search.call(query='x')", []),
        ("Plain {braces} and <|python", "Plain {braces} and <|python", []),
        (f"{CALL}; not a call", "; not a call", [WEATHER]),
        ('{"name": "get_weather", "parameters": {"ci', None, [("get_weather", '{"ci')]),  # cut short
        ('{"na', '{"na', []),
        ("", "", []),
    ],
    "mistral": [
        (f"[TOOL_CALLS] [{CALL}, {CALL2}]", None, [WEATHER, F]),
        (f"[TOOL_CALLS][{CALL}]", None, [WEATHER]),
        (f"[{CALL}]", None, [WEATHER]),  # the special token dropped by the detokenizer
        (f"Sure.\n\n[TOOL_CALLS][{CALL}]", "Sure.", [WEATHER]),
        (f"[TOOL_CALLS][{CALL}] done", " done", [WEATHER]),
        ("[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
        ("[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
        ('[TOOL_CALLS][{"city": "Paris"}]', '[TOOL_CALLS][{"city": "Paris"}]', []),
        ("[TOOL_CALLS]get_weather[ARGS]{}", "[TOOL_CALLS]get_weather[ARGS]{}", []),
        (f"[TOOL_CALLS][{CALL}, 7]", ", 7]", [WEATHER]),
        ("[TOOL", "[TOOL", []),
        ("[TOOL_CALLS]", "[TOOL_CALLS]", []),
        ("[TOOL_CALLS][{", "[TOOL_CALLS][{", []),
    ],
    "granite": [
        (f"<|tool_call|>[{CALL}, {CALL2}]", None, [WEATHER, F]),
        (f"<tool_call>[{CALL}]", None, [WEATHER]),
        (f" [{CALL}]", None, [WEATHER]),
        (f"I will call it. <|tool_call|>[{CALL}]", "I will call it.", [WEATHER]),
        ("<|tool_call|>[]", "<|tool_call|>[]", []),
        ("<|tool_call|>{}", "<|tool_call|>{}", []),
        ("[ ] <|tool_ca", "[ ] <|tool_ca", []),
        (f"<|tool_call|>[{CALL}", None, [WEATHER]),  # the list never closed
    ],
    "hermes": [
        (f"<tool_call>\n{CALL}\n</tool_call>", None, [WEATHER]),
    ],
}
CHUNKINGS = 30


def _pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    pieces, i = [], 0
    while i < len(text):
        n = rng.choice((1, 1, 2, 3, 5, 8, 13))
        pieces.append(text[i : i + n])
        i += n
    return pieces


def _streamed(name: str, text: str, seed: int) -> tuple[str, list[tuple[str, str]], set[str]]:
    parser = get_parser(name)
    content, calls, ids = "", {}, set()
    for delta in [parser.feed(p) for p in _pieces(text, seed)] + [parser.finish()]:
        content += delta.content
        for d in delta.tool_calls:
            call = calls.setdefault(d.index, {"name": None, "arguments": ""})
            if d.id is not None:
                assert call["name"] is None, "a call's id and name come once, first"
                call["name"] = d.name
                ids.add(d.id)
            else:
                assert call["name"] is not None, "arguments before the call's name"
            call["arguments"] += d.arguments
    return content, [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)], ids


@pytest.mark.parametrize(
    ("name", "text", "content", "calls"),
    [(name, *case) for name, cases in CASES.items() for case in cases],
)
def test_streamed_in_any_cuts_equals_whole(name, text, content, calls) -> None:
    whole_content, whole_calls = get_parser(name).parse(text)
    assert (whole_content, [(c.name, c.arguments) for c in whole_calls]) == (content, calls)
    for seed in range(CHUNKINGS):
        streamed_content, streamed_calls, ids = _streamed(name, text, seed)
        assert (streamed_content, streamed_calls) == (content or "", calls)
        assert len(ids) == len(calls)


def test_arguments_stream_before_the_call_ends() -> None:
    """A client sees the call's name, then its arguments as they are written, not all at the end."""
    for name, text in (("llama3_json", CALL), ("mistral", f"[TOOL_CALLS][{CALL}]"), ("granite", f"[{CALL}]")):
        parser = get_parser(name)
        head = text[: text.index("Par")]
        delta = parser.feed(head)
        assert [d.name for d in delta.tool_calls if d.id] == ["get_weather"]
        assert "".join(d.arguments for d in delta.tool_calls) == '{"city": "'
        assert delta.content == ""


def test_mistral_ids_are_what_its_templates_accept() -> None:
    """Mistral's chat templates refuse a call id that is not nine letters and digits."""
    _, calls = get_parser("mistral").parse(f"[TOOL_CALLS][{CALL}, {CALL}]")
    assert len({c.id for c in calls}) == 2
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    _, calls = get_parser("granite").parse(f"[{CALL}]")
    assert calls[0].id.startswith("call_")


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_arbitrary_text_never_raises(name) -> None:
    """Random mixes of the formats' markers, JSON punctuation and text: whole and streamed agree, and every
    character that is not part of a call is content."""
    alphabet = [*"{}[]\",:; \n\\ab", "<|python_tag|>", "[TOOL_CALLS]", "<|tool_call|>", "<tool_call>",
                "</tool_call>", '"name"', '"arguments"', '"parameters"', CALL]  # fmt: skip
    rng = random.Random(name)
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        content, calls = get_parser(name).parse(text)
        for seed in range(3):
            streamed_content, streamed_calls, _ = _streamed(name, text, seed)
            assert streamed_content == (content or "")
            assert streamed_calls == [(c.name, c.arguments) for c in calls]
        if not calls:
            assert _squeezed(content or "") == _squeezed(text), text


def test_unknown_parser_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="llama3_json, mistral, granite"):
        get_parser("pythonic")


# ------------------------------------------------------------------------------------------ reasoning

# parser: [(answer, reasoning, content)]
REASONING = {
    "qwen3": [
        ("<think>\nThe user greets me.\n</think>\n\nHello!", "The user greets me.", "Hello!"),
        ("<think>\n\n</think>\n\nHello!", None, "Hello!"),
        ("Hello, no thinking.", None, "Hello, no thinking."),
        ("  Hello.", None, "  Hello."),
        ("<think>cut short by max_tok", "cut short by max_tok", ""),
        ("<think>a <think> b</think>c</think>", "a <think> b", "c</think>"),
        (
            '<think>\nCall it.\n</think>\n\n<tool_call>\n{"name": "f"}',
            "Call it.",
            '<tool_call>\n{"name": "f"}',
        ),
        ("I think </think> here", None, "I think </think> here"),
        ("<thin", None, "<thin"),
        ("<thinking>", None, "<thinking>"),
        ("<think>a  \n</thi", "a  \n</thi", ""),
        ("", None, ""),
    ],
    "deepseek_r1": [
        ("The user greets me.\n</think>\n\nHello!", "The user greets me.", "Hello!"),
        ("<think>\nThe user greets me.</think>Hello!", "The user greets me.", "Hello!"),
        ("</think>\n\nHello!", None, "Hello!"),
        ("All reasoning, cut short", "All reasoning, cut short", ""),
        ("<thin", "<thin", ""),
        ("  \n ", None, ""),
    ],
}


def _streamed_reasoning(name: str, text: str, seed: int) -> tuple[str, str]:
    parser = get_reasoning_parser(name)
    reasoning = content = ""
    for delta in [parser.feed(p) for p in _pieces(text, seed)] + [parser.finish()]:
        reasoning += delta.reasoning
        content += delta.content
    return reasoning, content


@pytest.mark.parametrize(
    ("name", "text", "reasoning", "content"),
    [(name, *case) for name, cases in REASONING.items() for case in cases],
)
def test_reasoning_streamed_in_any_cuts_equals_whole(name, text, reasoning, content) -> None:
    assert get_reasoning_parser(name).parse(text) == (reasoning, content)
    for seed in range(CHUNKINGS):
        assert _streamed_reasoning(name, text, seed) == (reasoning or "", content)


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_reasoning_of_arbitrary_text_never_raises(name) -> None:
    alphabet = ["<think>", "</think>", "<", "/", "think", ">", " ", "\n", "a", "b"]
    rng = random.Random(name)
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        reasoning, content = get_reasoning_parser(name).parse(text)
        for seed in range(3):
            assert _streamed_reasoning(name, text, seed) == (reasoning or "", content)
        # Nothing is lost but the block's markers and the whitespace around them.
        text, kept = _squeezed(text), _squeezed((reasoning or "") + content)
        assert kept in (text, text.replace("<think>", "", 1), text.replace("</think>", "", 1)) or kept == (
            text.replace("<think>", "", 1).replace("</think>", "", 1)
        )


def _squeezed(text: str) -> str:
    return "".join(text.split())


def test_an_answer_a_grammar_wrote_has_reasoning_only_where_it_opens_the_block() -> None:
    """The engine's grammars constrain an answer from its first token: a JSON answer to a deepseek_r1 model
    is content, not reasoning cut short."""
    for text, parsed in (('{"a": 1}', (None, '{"a": 1}')), ("<think>r</think>{}", ("r", "{}"))):
        assert get_reasoning_parser("deepseek_r1", opened_by_prompt=False).parse(text) == parsed


def test_unknown_reasoning_parser_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="qwen3, deepseek_r1"):
        get_reasoning_parser("granite")
    with pytest.raises(InvalidRequestError, match=r"reasoning_parser 'granite'.*qwen3, deepseek_r1"):
        EngineConfig(reasoning_parser="granite")
    with pytest.raises(InvalidRequestError, match=r"tool_call_parser 'pythonic'.*hermes, llama3_json"):
        EngineConfig(tool_call_parser="pythonic")
    assert EngineConfig(tool_call_parser="granite", reasoning_parser="deepseek_r1").reasoning_parser


def test_random_json_calls_round_trip() -> None:
    """Calls with random names and arguments, as each format writes them, come back as they were written."""
    rng = random.Random(7)
    for _ in range(50):
        calls = []
        for _ in range(rng.randint(1, 3)):
            name = "".join(rng.choice(string.ascii_lowercase + "_") for _ in range(rng.randint(1, 12)))
            args = {
                k: rng.choice([1, -2.5, 's ;,]}"', None, True, [1, {"a": []}]])
                for k in "xyz"[: rng.randint(0, 3)]
            }
            calls.append((name, json.dumps(args)))
        objects = [json.dumps({"name": n, "arguments": json.loads(a)}) for n, a in calls]
        texts = {
            "llama3_json": "; ".join(objects),
            "mistral": "[TOOL_CALLS]" + "[" + ", ".join(objects) + "]",
            "granite": "<|tool_call|>[" + ",".join(objects) + "]",
        }
        for name, text in texts.items():
            content, parsed = get_parser(name).parse(text)
            assert content is None and [(c.name, c.arguments) for c in parsed] == calls
            assert _streamed(name, text, rng.randint(0, 99))[1] == calls
