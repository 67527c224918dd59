"""Acceptance, at a size for the suite: texts sent to ``/v1/embeddings`` in batches of 64 while a chat streams
from the same engine of the session's stack (its embedding prompts share the batch with the chat's decode
steps): every vector equals the one computed alone (cosine >= 0.9999), and the chat keeps streaming during the
load; its time per token alone and under the load is reported. The full size (1,000 texts) is
benchmarks/embeddings_under_chat.py, whose `measure` this runs."""

from __future__ import annotations

import json

import pytest

from benchmarks.embeddings import texts
from benchmarks.embeddings_under_chat import measure

pytestmark = pytest.mark.timeout(300)


def test_a_batch_of_embeddings_beside_a_streaming_chat(stack) -> None:
    items = texts(80, seed=1, max_words=24)  # batches of 64 and 16
    result = measure(stack.base_url, stack.api_key, stack.model, items, 64, chat_tokens=400, quiet_tokens=24)
    shown = {k: v for k, v in result.items() if not k.startswith("_")}
    print(json.dumps(shown, indent=2))
    assert result["below_0.9999"] == 0, shown
    assert result["min_cosine_to_alone"] >= 0.9999
    assert result["chat_tokens_during_load"] >= 2, shown  # the chat was not held up by the load
    assert result["chat_tpot_ms_alone"]["mean"] is not None
    assert result["chat_tpot_ms_during_load"]["mean"] is not None
