"""N-gram speculative decoding (prompt lookup), configured as vLLM's
`speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, ...}`.

Before each step, a decoding sequence whose last n tokens (n from `prompt_lookup_max` down to
`prompt_lookup_min`) also occur earlier in its prompt or output proposes the k tokens that followed that
earlier occurrence. On a CPU a match shorter than `CPU_CONFIDENT_MATCH` tokens proposes one token only: a
common pair ("of the") often predicts the token after it but seldom the ones after that, and each row a step
verifies costs an eighth (bf16) to a quarter (quantized) of a one-row step there. The step runs the proposals
through the model together with the sequence's newest token, and the sampler keeps the longest prefix the
model agrees with plus one token of its own (`Sampler.verify`: for greedy requests exactly the tokens greedy
decoding gives; for sampled ones by rejection sampling, which keeps the output distribution). The scheduler
then rolls back what the rejected tokens left behind (`Scheduler.postprocess`). Summaries and extractions
quote their sources, which is where this pays; a large batch already keeps the hardware busy, so above
`disable_by_batch_size` running sequences nothing is proposed. Unset, that limit is `CPU_BATCH_LIMIT` on a
CPU, where verifying drafts costs compute that a batch of several sequences already saturates
(`benchmarks/speculative.py`), higher for bf16 weights where AMX takes every step of the bf16 kernel (a step
of up to 16 rows costs about what one row does there), lower for quantized weights, whose kernels spend more
arithmetic on each extra row, and 0 (never) for quantized weights on a CPU without AVX512-VNNI, where each
extra row costs about what the first does; none on a GPU, where a step's extra tokens are nearly free. JSON
null lifts it. Unset on a CPU, proposals are also shortened where needed so that a decode step verifies at
most `SAME_BITS_ROWS` rows (`NgramConfig.max_step_rows`), within which every row gets the bits it gets alone:
greedy outputs stay exactly those of plain decoding, and a few sequences with long proposals share the rows
rather than stop proposing.
Nor for structured-output requests: a draft token their grammar forbids would have to be masked position by
position, and a copied n-gram rarely fits a grammar anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inference_engine.errors import InvalidRequestError
from inference_engine.sequence import Sequence
from llmserve_kernels.cpu.linear import SAME_BITS_ROWS, cheap_bf16_rows, cheap_quant_rows

CPU_BATCH_LIMIT = 4
CPU_AMX_BATCH_LIMIT = 8
CPU_QUANTIZED_BATCH_LIMIT = 2
CPU_CONFIDENT_MATCH = 3


@dataclass
class NgramConfig:
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = None  # no proposals while more sequences than this are running
    # Rows a decode step may verify, its running sequences' own included (proposals are shortened to fit);
    # None: no bound. Not a key of the user's config: set with the default batch limit on a CPU.
    max_step_rows: int | None = field(default=None, init=False)

    @classmethod
    def from_dict(
        cls, config: dict, device: str = "cpu", quantized: bool = False, bf16: bool = False
    ) -> NgramConfig:
        """`device`, `quantized` and `bf16` (the model's weights) choose the default
        `disable_by_batch_size`."""
        config = dict(config)
        method = config.pop("method", "ngram")
        if method != "ngram":
            raise InvalidRequestError(f"speculative method {method!r} is not supported (only 'ngram').")
        try:
            result = cls(**config)
        except TypeError as exc:
            raise InvalidRequestError(f"invalid speculative_config: {exc}") from None
        if "prompt_lookup_min" not in config:
            result.prompt_lookup_min = min(result.prompt_lookup_min, result.prompt_lookup_max)
        if not 1 <= result.num_speculative_tokens <= 16:
            raise InvalidRequestError("num_speculative_tokens must be in [1, 16].")
        if not 1 <= result.prompt_lookup_min <= result.prompt_lookup_max:
            raise InvalidRequestError("need 1 <= prompt_lookup_min <= prompt_lookup_max.")
        limit = result.disable_by_batch_size
        if "disable_by_batch_size" not in config:  # the default may be 0, which a user may not set
            result.disable_by_batch_size = _default_batch_limit(device, quantized, bf16)
            result.max_step_rows = SAME_BITS_ROWS if device == "cpu" else None
        elif limit is not None and (not isinstance(limit, int) or limit < 1):
            raise InvalidRequestError("disable_by_batch_size must be a positive integer or null.")
        return result


def _default_batch_limit(device: str, quantized: bool, bf16: bool) -> int | None:
    if device != "cpu":
        return None
    if quantized:
        return CPU_QUANTIZED_BATCH_LIMIT if cheap_quant_rows() else 0
    return CPU_AMX_BATCH_LIMIT if bf16 and cheap_bf16_rows() else CPU_BATCH_LIMIT


def fit_to_rows(drafts: list[list[int]], extra_rows: int) -> list[list[int]]:
    """The proposals shortened to at most `extra_rows` tokens in all: each cut to the longest length that
    fits, so that short ones keep every token and long ones share what is left (prefixes still, which the
    model verifies as it would the whole)."""
    longest = max(map(len, drafts), default=0)
    cap = longest
    while cap > 0 and sum(min(len(d), cap) for d in drafts) > extra_rows:
        cap -= 1
    return drafts if cap == longest else [d[:cap] for d in drafts]


def ngram_proposal(tokens: list[int], k: int, n_min: int, n_max: int, confident: int = 0) -> list[int]:
    """The up-to-k tokens that followed the latest earlier occurrence of the longest suffix of `tokens`
    (n_max down to n_min tokens long) that occurs earlier, only the first of them where that suffix is
    shorter than `confident`; [] where none occurs.

    Runs every step of every sequence, so it works on the list as it is: the earlier occurrences of the last
    token are found at C speed (`list.index`), then extended backwards from the latest."""
    end = len(tokens) - 1
    last, ends = tokens[end], []
    i = tokens.index(last)
    while i < end:
        ends.append(i)
        i = tokens.index(last, i + 1)
    best, best_n = -1, 0
    for c in reversed(ends):
        n = 1
        while n < n_max and n <= c and tokens[c - n] == tokens[end - n]:
            n += 1
        if n > best_n:
            best, best_n = c, n
            if n == n_max:
                break
    if best_n < n_min:
        return []
    return tokens[best + 1 : best + 1 + (k if best_n >= confident else 1)]


class NgramProposer:
    def __init__(self, config: NgramConfig, max_model_len: int, device: str = "cpu") -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.confident_match = CPU_CONFIDENT_MATCH if device == "cpu" else 0
        # For stats, as vLLM counts them: verifications of a sequence's proposals, the tokens proposed, the
        # tokens accepted, and how often the token at each position of a proposal was accepted.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * config.num_speculative_tokens

    def propose(self, running: list[Sequence]) -> None:
        """Sets `draft_token_ids` of every running sequence that decodes next (none above the batch limit,
        within `max_step_rows`)."""
        limit, rows = self.config.disable_by_batch_size, self.config.max_step_rows
        enabled = limit is None or len(running) <= limit
        drafts = [self._for(seq) if enabled else [] for seq in running]
        if rows is not None:
            drafts = fit_to_rows(drafts, rows - len(running))
        for seq, draft in zip(running, drafts, strict=True):
            seq.draft_token_ids = draft

    def _for(self, seq: Sequence) -> list[int]:
        params = seq.params
        if seq.num_computed_tokens != len(seq) - 1 or params.structured_outputs is not None:
            return []  # still prefilling, or constrained by a grammar
        # Never propose past the request's last token: the verified step emits drafts + 1 tokens.
        room = self.max_model_len - len(seq)
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - seq.num_output_tokens)
        k = min(self.config.num_speculative_tokens, room - 1)
        if k < 1:
            return []
        config = self.config
        return ngram_proposal(
            seq.token_ids, k, config.prompt_lookup_min, config.prompt_lookup_max, self.confident_match
        )

    def record(self, proposed: int, accepted: int) -> None:
        """A verification of a sequence's `proposed` tokens, whose first `accepted` the model agreed with."""
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    def totals(self) -> tuple[int, int, int]:
        """Verifications of proposals, tokens proposed and tokens accepted so far: what a rate over an
        interval takes the difference of."""
        return self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens

    def stats(self) -> dict:
        """The counters, under the names of the engine's stats (and of vLLM's metrics)."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position),
        }
