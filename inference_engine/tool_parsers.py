"""Tool calls in a model's output: found in the text whole, or as it streams.

Each model family writes its calls its own way, so the parser is chosen per model, as vLLM's
``--tool-call-parser`` chooses it: the engine's ``tool_call_parser`` option, which the engine reports in its
``ack``; the API parses the text it streams. Implemented:

``hermes``       ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them among text
                 (Hermes, Qwen 2.5 / Qwen3 and the models that took its format; also what the engine's
                 fallback prompt asks of a model whose chat template knows no tools).
``llama3_json``  ``{"name": ..., "parameters": {...}}`` objects separated by ``;``, opening the answer or
                 after ``<|python_tag|>`` (Llama 3.1 / 3.2 / 3.3 JSON tool calling).
``mistral``      ``[TOOL_CALLS]`` and a JSON list of ``{"name", "arguments"}`` objects (Mistral, Mixtral);
                 call ids are nine letters and digits, as Mistral's chat templates demand of them.
``granite``      ``<|tool_call|>`` (``<tool_call>`` from Granite 3.1 on) and a JSON list of calls (Granite 3).

The markers of the last three are special tokens of their models, which the detokenizer drops unless a
request keeps special tokens; so their calls are also read where they open the answer without the marker (a
``{`` for ``llama3_json``, a ``[`` for the others), as vLLM's parsers read them. Text that turns out not to be
calls (a list of numbers, a JSON object without a name, code after ``<|python_tag|>``) is content, as written.

Two more follow ``tool_choice``, whatever the model: `NamedToolCall` (the grammar made the whole output the
arguments of one named function) and `RequiredToolCalls` (the grammar made it a JSON array of
``{"name", "parameters"}`` objects). All parsers stream: `feed` takes the text as it arrives and returns what
can be said already (content, a call's id and name once its name is complete, its arguments as they are
written), `finish` the rest; `parse` does both on a whole text, so streamed and whole answers agree.

Torch-free: the web tier imports it.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class ToolCallDelta:
    index: int  # which call of the answer
    id: str | None = None  # on a call's first delta, with its name
    name: str | None = None
    arguments: str = ""  # the next piece of its arguments' JSON text


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ParsedDelta) -> ParsedDelta:
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolParser:
    name: ClassVar[str]

    def feed(self, text: str) -> ParsedDelta:
        raise NotImplementedError

    def finish(self) -> ParsedDelta:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole answer; content is None where only calls were written."""
        parsed = self.feed(text).extend(self.finish())
        calls: dict[int, ToolCall] = {}
        for d in parsed.tool_calls:
            call = calls.setdefault(d.index, ToolCall(d.id or new_call_id(), d.name or "", ""))
            call.arguments += d.arguments
        content = parsed.content if parsed.content.strip() or not calls else None
        return content, [calls[i] for i in sorted(calls)]


class _ValueEnd:
    """Follows one JSON value as its text arrives, to tell where it ends (nothing is parsed)."""

    def __init__(self) -> None:
        self.depth = 0
        self.started = False
        self.in_string = False
        self.escaped = False
        self.ended = False

    def feed(self, text: str) -> int | None:
        """The length of `text` that belongs to the value once it ends in `text`, else None."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return self._end(i + 1)
                continue
            if not self.started:
                if ch.isspace():
                    continue
                self.started = True
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                if self.depth == 0:  # closes what holds a number, true, false or null
                    return self._end(i)
                self.depth -= 1
                if self.depth == 0:
                    return self._end(i + 1)
            elif self.depth == 0 and (ch in "," or ch.isspace()):
                return self._end(i)  # a number, true, false or null ends at what follows it
        return None

    def _end(self, at: int) -> int:
        self.ended = True
        return at


# Matched once the arguments' first character is there, so that they never start with whitespace.
_NAME_THEN_ARGUMENTS = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)'
)


class _CallStream:
    """One ``{"name": ..., "arguments": ...}`` object as its text arrives: the name once it is complete,
    then the arguments' text as it is written. Keys in another order, or a text that is no such object,
    are only understood once the object is complete (`close`)."""

    def __init__(self, index: int, new_id: Callable[[], str] = new_call_id) -> None:
        self.index = index
        self.new_id = new_id
        self.text = ""
        self.object = _ValueEnd()
        self.arguments: _ValueEnd | None = None
        self.sent = 0  # how much of `text` went out as arguments
        self.named = False
        self.closed = False

    def feed(self, text: str) -> tuple[list[ToolCallDelta], str | None]:
        """(deltas, the text after the object once it ended, else None)."""
        end = self.object.feed(text)
        self.text += text if end is None else text[:end]
        deltas = self._progress()
        return deltas, None if end is None else text[end:]

    def _progress(self) -> list[ToolCallDelta]:
        deltas = []
        if not self.named:
            match = _NAME_THEN_ARGUMENTS.match(self.text)
            if match is None:
                return deltas
            self.named, self.sent = True, match.end()
            self.arguments = _ValueEnd()
            deltas.append(ToolCallDelta(self.index, self.new_id(), json.loads(match.group(1))))
        if self.arguments is not None and not self.arguments.ended:
            new = self.text[self.sent :]
            end = self.arguments.feed(new)
            piece = new if end is None else new[:end]
            if piece:
                deltas.append(ToolCallDelta(self.index, arguments=piece))
            self.sent += len(piece)
        return deltas

    def close(self) -> tuple[list[ToolCallDelta], bool]:
        """At the end of the object (or of the output): the deltas still due, and whether this was a call
        at all (an object never named that does not parse as one is not)."""
        self.closed = True
        if self.named:
            return [], True
        try:
            call = json.loads(self.text)
        except ValueError:
            return [], False
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return [], False
        arguments = call.get("arguments", call.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        return [ToolCallDelta(self.index, self.new_id(), call["name"], arguments)], True


def _held_back(text: str, marker: str) -> int:
    """The length of the longest end of `text` that may be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.pending = ""  # text not yet said: a possible start of a marker, or whitespace
        self.call: _CallStream | None = None
        self.calls = 0
        self.after_call = False  # between a call's object and its end marker

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        text = self.pending + text
        self.pending = ""
        while text:
            if self.call is not None:
                text = self._in_call(text, out)
            elif self.after_call:
                text = self._after_call(text)
            else:
                text = self._in_text(text, out)
        return out

    def _in_text(self, text: str, out: ParsedDelta) -> str:
        # Whitespace before a call, or at the end, is not content: it is held until more text follows.
        start = text.find(self.START)
        if start < 0:
            said = text[: len(text) - _held_back(text, self.START)]
            out.content += said.rstrip()
            self.pending = text[len(said.rstrip()) :]
            return ""
        out.content += text[:start].rstrip()
        self.call = _CallStream(self.calls)
        self.calls += 1
        return text[start + len(self.START) :]

    def _in_call(self, text: str, out: ParsedDelta) -> str:
        marker = text.find(self.END)
        before = text[:marker] if marker >= 0 else text[: len(text) - _held_back(text, self.END)]
        deltas, rest = self.call.feed(before)
        out.tool_calls += deltas
        if rest is None:
            if marker < 0:  # the object goes on; hold what may start the end marker
                self.pending = text[len(before) :]
                return ""
            if not self._close(out):  # the end marker came inside a broken object
                out.content += self.END
            return text[marker + len(self.END) :]
        self.after_call = self._close(out)
        return rest + text[len(before) :]

    def _after_call(self, text: str) -> str:
        stripped = text.lstrip()
        if stripped.startswith(self.END):
            self.after_call = False
            return stripped[len(self.END) :]
        if self.END.startswith(stripped):  # whitespace, or the start of the end marker
            self.pending = text
            return ""
        self.after_call = False  # no end marker: what follows is text again
        return text

    def _close(self, out: ParsedDelta) -> bool:
        call, self.call = self.call, None
        deltas, was_call = call.close()
        out.tool_calls += deltas
        if not was_call:
            self.calls -= 1
            out.content += self.START + call.text
        return was_call

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.call is not None:
            self._close(out)
        elif not self.after_call and self.pending.strip():
            out.content += self.pending
        self.pending = ""
        return out


class _JsonCallsParser(ToolParser):
    """Calls written as JSON after a marker (`MARKERS`): a list of call objects (`LISTED`), else call objects
    separated by ``;``; or the same where it opens the answer without its marker.

    What is read of the calls is kept (`raw`) until the calls in it are complete, so that text which turns out
    not to be calls goes out as content, as it was written (marker and all)."""

    MARKERS: ClassVar[tuple[str, ...]]
    LISTED: ClassVar[bool]

    def __init__(self) -> None:
        self.pending = ""  # text not yet said: a possible start of a marker, or whitespace
        self.started = False  # the answer's first non-whitespace character came
        self.in_calls = False
        self.expect = ""  # in the calls: "open" (the list), "item" (a call), "next" (a separator or the end)
        self.raw = ""  # the calls' text since the last complete call
        self.call: _CallStream | None = None
        self.calls = 0

    def new_id(self) -> str:
        return new_call_id()

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        text = self.pending + text
        self.pending = ""
        while text:
            text = self._in_calls(text, out) if self.in_calls else self._in_text(text, out)
        return out

    def _in_text(self, text: str, out: ParsedDelta) -> str:
        if not self.started:
            stripped = text.lstrip()
            if not stripped or any(m.startswith(stripped) for m in self.MARKERS):
                self.pending = text  # too early to tell calls from text
                return ""
            self.started = True
            opener = "[" if self.LISTED else "{"
            if stripped[0] == opener and not any(stripped.startswith(m) for m in self.MARKERS):
                self._enter(text[: len(text) - len(stripped)], "open" if self.LISTED else "item")
                return stripped
        found = [(text.find(m), m) for m in self.MARKERS if m in text]
        if not found:
            said = text[: len(text) - max(_held_back(text, m) for m in self.MARKERS)]
            out.content += said.rstrip()
            self.pending = text[len(said.rstrip()) :]
            return ""
        at, marker = min(found)
        out.content += text[:at].rstrip()
        self._enter(marker, "open" if self.LISTED else "item")
        return text[at + len(marker) :]

    def _enter(self, raw: str, expect: str) -> None:
        self.in_calls, self.raw, self.expect = True, raw, expect

    def _in_calls(self, text: str, out: ParsedDelta) -> str:
        if self.call is not None:
            deltas, rest = self.call.feed(text)
            out.tool_calls += deltas
            if rest is None:
                return ""
            if self._close(out):
                self.raw, self.expect = "", "next"
            return rest
        stripped = text.lstrip()
        if not stripped:
            self.pending = text
            return ""
        ch, space = stripped[0], text[: len(text) - len(stripped)]
        separator = "," if self.LISTED else ";"
        if (self.expect, ch) in (("open", "["), ("next", separator)):
            self.raw += space + ch
            self.expect = "item"
            return stripped[1:]
        if self.expect == "item" and ch == "{":
            self.raw += space
            self.call = _CallStream(self.calls, self.new_id)
            self.calls += 1
            return stripped
        if self.expect == "next":  # the calls are complete; what follows is text
            self.in_calls = False
            return stripped[1:] if self.LISTED and ch == "]" else text
        self._leave(out, self.raw)  # not calls after all
        return text

    def _close(self, out: ParsedDelta) -> bool:
        """Closes the call being read; one that is no call goes out as content with what came before it."""
        call, self.call = self.call, None
        deltas, was_call = call.close()
        out.tool_calls += deltas
        if not was_call:
            self.calls -= 1
            self._leave(out, self.raw + call.text)
        return was_call

    def _leave(self, out: ParsedDelta, text: str) -> None:
        out.content += text
        self.in_calls, self.raw = False, ""

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.call is not None:
            self._close(out)
        elif self.in_calls:
            self._leave(out, self.raw if self.raw.strip() else "")
        elif self.pending.strip():
            out.content += self.pending
        self.pending, self.in_calls = "", False
        return out


class Llama3JsonToolParser(_JsonCallsParser):
    name = "llama3_json"
    MARKERS = ("<|python_tag|>",)
    LISTED = False


class MistralToolParser(_JsonCallsParser):
    name = "mistral"
    MARKERS = ("[TOOL_CALLS]",)
    LISTED = True

    def new_id(self) -> str:
        return uuid.uuid4().hex[:9]


class GraniteToolParser(_JsonCallsParser):
    name = "granite"
    MARKERS = ("<|tool_call|>", "<tool_call>")
    LISTED = True


class NamedToolCall(ToolParser):
    """``tool_choice`` naming a function: the grammar made the whole output that function's arguments."""

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function
        self.started = False

    def feed(self, text: str) -> ParsedDelta:
        if not text:
            return ParsedDelta()
        delta = ToolCallDelta(0, arguments=text)
        if not self.started:
            self.started = True
            delta.id, delta.name = new_call_id(), self.function
        return ParsedDelta(tool_calls=[delta])

    def finish(self) -> ParsedDelta:
        return ParsedDelta()


class RequiredToolCalls(ToolParser):
    """``tool_choice: "required"``: the grammar made the output a JSON array of calls (`required_schema`)."""

    name = "required"

    def __init__(self) -> None:
        self.call: _CallStream | None = None
        self.calls = 0

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        while text:
            if self.call is None:
                start = text.find("{")
                if start < 0:
                    return out
                self.call = _CallStream(self.calls)
                self.calls += 1
                text = text[start:]
            deltas, rest = self.call.feed(text)
            out.tool_calls += deltas
            if rest is None:
                return out
            out.tool_calls += self.call.close()[0]
            self.call, text = None, rest
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.call is not None:
            out.tool_calls += self.call.close()[0]
            self.call = None
        return out


def required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of ``tool_choice: "required"``: one call (or, with parallel calls, several) of the
    listed functions, each with arguments that match the function's parameters."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "parameters": f.get("parameters") or {"type": "object", "properties": {}},
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, GraniteToolParser)
}


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r} (known: {', '.join(PARSERS)})") from None
