"""A model's reasoning in its output, kept apart from its answer: found in the text whole, or as it streams.

Thinking models write their reasoning in a ``<think>...</think>`` block before the answer; the API returns it
as ``reasoning_content`` beside ``content``, as vLLM's ``--reasoning-parser`` does. The parser is chosen per
model: the engine's ``reasoning_parser`` option, which the engine reports in its ``ack`` of chat requests.

``qwen3``        the block opens the answer (Qwen3); an answer without it (``enable_thinking: false``, whose
                 template writes an empty block into the prompt) is all content.
``deepseek_r1``  the prompt opened the block (DeepSeek-R1, QwQ, Qwen3's thinking-only models): the answer
                 starts in the reasoning (a ``<think>`` it repeats is dropped) and its content follows
                 ``</think>``.

An answer that ends before ``</think>`` (cut by ``max_tokens``) is all reasoning once the block opened. The
whitespace around the block (the newlines models write after ``<think>``, before ``</think>`` and after it)
is neither reasoning nor content. Parsers stream as the tool-call parsers do: `feed` returns what can be said
already, `finish` the rest, `parse` both on a whole text, so streamed and whole answers agree.

Torch-free: the web tier imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from inference_engine.tool_parsers import _held_back

START, END = "<think>", "</think>"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""

    def extend(self, other: ReasoningDelta) -> ReasoningDelta:
        self.reasoning += other.reasoning
        self.content += other.content
        return self


class ReasoningParser:
    name: ClassVar[str]
    OPENED_BY_PROMPT: ClassVar[bool]  # the answer starts inside the block

    def __init__(self, opened_by_prompt: bool = True) -> None:
        """`opened_by_prompt` False: this answer does not start inside the block, whatever the model's
        template does (a grammar wrote it from its first token)."""
        self.opened = self.OPENED_BY_PROMPT and opened_by_prompt
        self.state = "start"  # "start" (nothing said yet), "reasoning", "content"
        self.pending = ""  # text not yet said: whitespace, or what may start a marker
        self.said = False  # in the current state, something was said (leading whitespace is dropped)

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        text = self.pending + text
        self.pending = ""
        while text:
            if self.state == "start":
                text = self._at_start(text)
            elif self.state == "reasoning":
                text = self._in_reasoning(text, out)
            else:
                out.content += self._trimmed(text)
                text = ""
        return out

    def _at_start(self, text: str) -> str:
        stripped = text.lstrip()
        if not stripped or (START.startswith(stripped) and stripped != START):
            self.pending = text  # too early to tell
            return ""
        if stripped.startswith(START):
            self.state = "reasoning"
            return stripped[len(START) :]
        if self.opened:
            self.state = "reasoning"
            return stripped
        self.state, self.said = "content", True  # no block: the text is the answer, as written
        return text

    def _in_reasoning(self, text: str, out: ReasoningDelta) -> str:
        end = text.find(END)
        if end < 0:
            said = text[: len(text) - _held_back(text, END)].rstrip()
            out.reasoning += self._trimmed(said)
            self.pending = text[len(said) :]
            return ""
        out.reasoning += self._trimmed(text[:end].rstrip())
        self.state, self.said = "content", False
        return text[end + len(END) :]

    def _trimmed(self, text: str) -> str:
        """`text` without the whitespace that opens the reasoning or the content."""
        if not self.said:
            text = text.lstrip()
            self.said = bool(text)
        return text

    def finish(self) -> ReasoningDelta:
        out = ReasoningDelta()
        pending, self.pending = self.pending, ""
        if self.state == "start" and pending.strip():
            if self.opened:
                out.reasoning += pending.strip()
            else:
                out.content += pending
        elif self.state == "reasoning" and pending.strip():
            out.reasoning += self._trimmed(pending.rstrip())
        return out

    def parse(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole answer; reasoning is None where the answer has none."""
        parsed = self.feed(text).extend(self.finish())
        return parsed.reasoning or None, parsed.content


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    OPENED_BY_PROMPT = False


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    OPENED_BY_PROMPT = True


PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}


def get_reasoning_parser(name: str, opened_by_prompt: bool = True) -> ReasoningParser:
    try:
        return PARSERS[name](opened_by_prompt)
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r} (known: {', '.join(PARSERS)})") from None
