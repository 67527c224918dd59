"""Incremental detokenization with stop strings.

Decoding token by token breaks multi-byte characters (a Chinese character is often split over
several byte-level tokens), so text is released only once the bytes decode cleanly; and text that
could still turn out to be the start of a stop string is held back, so a stop string never leaks
into a stream.
"""

from __future__ import annotations

from inference_engine.tokenizer import Tokenizer

# Re-decode a few tokens before the new ones, because some tokenizers' decoding of a token depends
# on its neighbours (leading spaces, byte fallback).
_PREFIX_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special: bool = True,
        include_stop: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special = skip_special
        self.include_stop = include_stop
        self.tokens: list[int] = list(prompt_token_ids[-_PREFIX_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""  # all decoded output text, held-back tail included
        self.emitted = 0  # how much of `text` may be shown

    def add_token(self, token_id: int) -> str | None:
        """Appends one generated token; returns the stop string it completed, if any."""
        self.tokens.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.tokens[self.prefix_offset : self.read_offset], self.skip_special)
        full = decode(self.tokens[self.prefix_offset :], self.skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new_text = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            search_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
            self.text += new_text
            hits = [(pos, stop) for stop in self.stop if (pos := self.text.find(stop, search_from)) != -1]
            if hits:
                pos, stop = min(hits)
                self.text = self.text[: pos + len(stop) if self.include_stop else pos]
                self.emitted = len(self.text)
                return stop
        self.emitted = max(self.emitted, len(self.text) - self._partial_stop_len())
        return None

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of the text that is the start of a stop string."""
        return max(
            (
                k
                for stop in self.stop
                for k in range(min(len(stop) - 1, len(self.text)), 0, -1)
                if self.text.endswith(stop[:k])
            ),
            default=0,
        )

    def finish(self) -> None:
        """The sequence ended without a stop string: release the held-back tail."""
        self.emitted = len(self.text)

    @property
    def visible_text(self) -> str:
        return self.text[: self.emitted]
