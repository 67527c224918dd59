"""When a sequence stops: the rules each sampled token is checked against (vLLM's `check_stop`).

The scheduler's post-processing appends every sampled token through `append_token`; the detokenizer
(stop strings) and the grammar matcher (structured outputs) stay per-sequence objects that this asks.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from inference_engine.sampler import SampleResult
from inference_engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


def append_token(
    seq: Sequence, result: SampleResult, eos_token_ids: Collection[int], max_model_len: int
) -> None:
    """Appends a sampled token (its logprobs, its text); finishes the sequence where a stop rule says so."""
    seq.token_ids.append(result.token_id)
    seq.cumulative_logprob += result.logprob
    if result.top_logprobs is not None:
        seq.logprobs.append(result.top_logprobs)
    stop_string = seq.detokenizer.add_token(result.token_id)
    reason, stop_reason = check_stop(seq, result.token_id, stop_string, eos_token_ids, max_model_len)
    if reason is not None:
        if stop_string is None:
            seq.detokenizer.finish()
        seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, reason, stop_reason


def check_stop(
    seq: Sequence,
    token_id: int,
    stop_string: str | None,
    eos_token_ids: Collection[int],
    max_model_len: int,
) -> tuple[str | None, int | str | None]:
    """(finish_reason, stop_reason) after `token_id` joined the sequence, (None, None) while it goes on.
    Stop tokens, EOS and stop strings count only from `min_tokens` on; a grammar is advanced by the token
    (an accepted token the matcher refuses, or an end before the grammar is complete, is cut short:
    "length"); then max_tokens and the context's end."""
    params = seq.params
    reason, stop_reason = None, None
    if seq.num_output_tokens >= params.min_tokens:
        if token_id in params.stop_token_ids:
            reason, stop_reason = "stop", token_id
        elif not params.ignore_eos and token_id in eos_token_ids:
            reason = "stop"
        elif stop_string is not None:
            reason, stop_reason = "stop", stop_string
    grammar = seq.grammar
    if grammar is not None and reason is None:
        if not grammar.accept(token_id):
            # Only a matcher that ran out of its resource limits gets here (masks allow nothing else).
            logger.warning("request %s left its grammar: %s", seq.group.request_id, grammar.error)
            reason = "length"  # cut short of what its grammar describes, as a length limit cuts it
        elif grammar.is_terminated:
            reason = "stop"
    elif grammar is not None and reason == "stop" and stop_reason is None and not grammar.is_accepting:
        # End of sequence before the grammar is complete (a failed matcher allows nothing else): the output is
        # cut short, never a finished match.
        logger.warning("request %s ended outside its grammar: %s", seq.group.request_id, grammar.error)
        reason = "length"
    if reason is None and (
        (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens)
        or len(seq) >= max_model_len
    ):
        reason = "length"
    return reason, stop_reason
