"""Cumulative engine outputs -> bus messages carrying only what is new.

The engine reports text, token ids and logprobs cumulatively; the bus sends each token once. One tracker per
request remembers how much of each output index has been sent.
"""

from __future__ import annotations

from inference_engine.bus import protocol as P
from inference_engine.outputs import RequestOutput


class DeltaTracker:
    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self._sent_text: dict[int, int] = {}
        self._sent_tokens: dict[int, int] = {}
        self._sent_prompt_logprobs = False

    @property
    def started(self) -> bool:
        """Whether any token of the request has been sent."""
        return any(self._sent_tokens.values())

    def messages(self, output: RequestOutput, replica: str) -> list[P.Delta | P.Final]:
        """The `delta` entry for this step's progress (if any) and, once finished, the `final` entry."""
        changes = []
        for out in output.outputs:
            text_at = self._sent_text.get(out.index, 0)
            tokens_at = self._sent_tokens.get(out.index, 0)
            if len(out.text) == text_at and len(out.token_ids) == tokens_at:
                continue
            logprobs = out.logprobs[tokens_at:] if out.logprobs is not None else None
            changes.append(
                {
                    "index": out.index,
                    "text": out.text[text_at:],
                    "token_ids": list(out.token_ids[tokens_at:]),
                    "logprobs": P.encode_logprobs(logprobs),
                }
            )
            self._sent_text[out.index] = len(out.text)
            self._sent_tokens[out.index] = len(out.token_ids)
        messages: list[P.Delta | P.Final] = [P.Delta(changes, replica)] if changes else []
        if messages and output.prompt_logprobs is not None and not self._sent_prompt_logprobs:
            # Complete once the prompt is prefilled, which is when the first token arrives.
            messages[0].prompt_logprobs = P.encode_prompt_logprobs(output.prompt_logprobs)
            messages[0].prompt_token_ids = list(output.prompt_token_ids)
            self._sent_prompt_logprobs = True
        if output.finished:
            reasons = [(o.index, o.finish_reason, o.stop_reason) for o in output.outputs]
            messages.append(self.final(reasons, replica))
        return messages

    def final(self, reasons: list[tuple[int, str | None, int | str | None]], replica: str) -> P.Final:
        """The `final` entry from (index, finish_reason, stop_reason) per output."""
        completion = sum(self._sent_tokens.values())
        return P.Final(
            outputs=[
                {"index": i, "finish_reason": finish, "stop_reason": stop} for i, finish, stop in reasons
            ],
            usage={
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
            },
            replica=replica,
        )
