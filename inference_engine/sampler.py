"""Turns each sequence's next-token logits into a token, applying its sampling parameters.

Rows are processed together where they can be; seeded rows draw from their own generator, so a
seeded request samples the same tokens alone or inside any batch. Logprobs are reported from the
model's raw distribution, before penalties and temperature, as OpenAI and vLLM do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_engine.outputs import Logprob
from inference_engine.sequence import Sequence
from kernels.cpu import sampling as cpu_sampling


@dataclass
class SampleResult:
    token_id: int
    logprob: float  # 0.0 unless the request asked for logprobs
    top_logprobs: dict[int, Logprob] | None  # chosen token plus the top-k alternatives


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy tokens of [rows, vocab] logits: the native kernel where it runs (torch.argmax is
    single-threaded on the CPU), else torch.argmax, with the same result."""
    tokens = cpu_sampling.argmax(logits)
    return tokens if tokens is not None else logits.argmax(dim=-1)


class Sampler:
    def __init__(self, eos_token_ids: list[int], seed: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.generator = torch.Generator().manual_seed(seed)  # for unseeded requests

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampleResult]:
        """logits: [len(seqs), vocab] in fp32, on the CPU; modified in place.

        Logprobs (a full pass over the vocabulary) are computed only for the rows that asked for them, and
        a batch of plain greedy rows is one argmax.
        """
        if all(self._plain_greedy(s) for s in seqs):
            return [SampleResult(token, 0.0, None) for token in argmax(logits).tolist()]
        wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[wanted], dim=-1) if wanted else None
        self._apply_logit_bias_and_min_tokens(logits, seqs)
        self._apply_penalties(logits, seqs)

        tokens = torch.empty(len(seqs), dtype=torch.long)
        greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
        if greedy:
            tokens[greedy] = argmax(logits[greedy])
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled:
            tokens[sampled] = self._sample(logits[sampled], [seqs[i] for i in sampled])

        results = [SampleResult(token, 0.0, None) for token in tokens.tolist()]
        for row, i in enumerate(wanted):
            result = results[i]
            result.logprob = float(raw_logprobs[row, result.token_id])
            result.top_logprobs = top_logprobs(raw_logprobs[row], result.token_id, seqs[i].params.logprobs)
        return results

    def _plain_greedy(self, seq: Sequence) -> bool:
        """Greedy with nothing that changes the logits first and no logprobs to report."""
        params = seq.params
        return (
            params.greedy
            and params.logprobs is None
            and not params.logit_bias
            and seq.num_output_tokens >= params.min_tokens
            and params.repetition_penalty == 1.0
            and not params.presence_penalty
            and not params.frequency_penalty
        )

    def _apply_logit_bias_and_min_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        vocab = logits.shape[1]
        for i, seq in enumerate(seqs):
            params = seq.params
            if params.logit_bias:
                ids = [t for t in params.logit_bias if 0 <= t < vocab]
                logits[i, ids] += torch.tensor([params.logit_bias[t] for t in ids], dtype=logits.dtype)
            if seq.num_output_tokens < params.min_tokens:
                banned = [t for t in (*self.eos_token_ids, *params.stop_token_ids) if 0 <= t < vocab]
                logits[i, banned] = float("-inf")

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
        rows = [
            i
            for i, s in enumerate(seqs)
            if s.params.repetition_penalty != 1.0 or s.params.presence_penalty or s.params.frequency_penalty
        ]
        for i in rows:
            params, seq = seqs[i].params, seqs[i]
            row = logits[i]
            if params.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
                values = row[seen]
                row[seen] = torch.where(
                    values > 0, values / params.repetition_penalty, values * params.repetition_penalty
                )
            if (params.presence_penalty or params.frequency_penalty) and seq.num_output_tokens:
                counts = torch.bincount(torch.tensor(seq.output_token_ids), minlength=row.shape[0]).to(
                    row.dtype
                )
                row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(
                    row.dtype
                )

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        temperature = torch.tensor([s.params.temperature for s in seqs], dtype=logits.dtype).unsqueeze(1)
        logits = logits / temperature
        for i, seq in enumerate(seqs):
            _truncate(logits[i], seq.params.top_k, seq.params.top_p, seq.params.min_p)
        probs = torch.softmax(logits, dim=-1)
        # Gumbel-style race: argmax(p / E) with E ~ Exp(1) samples from p; each row owns its noise.
        noise = torch.empty_like(probs)
        unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1]).exponential_(
                generator=self.generator
            )
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                noise[i].exponential_(generator=seq.generator)
        return (probs / noise).argmax(dim=-1)


def _truncate(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> None:
    """Masks, in place, the tokens that top-k, top-p (nucleus) and min-p sampling exclude."""
    if 0 < top_k < row.shape[0]:
        kth = torch.topk(row, top_k).values[-1]
        row[row < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the top token always stays.
        drop = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        row[order[drop]] = float("-inf")
    if min_p > 0.0:
        probs = torch.softmax(row, dim=-1)
        row[probs < min_p * probs.max()] = float("-inf")


def top_logprobs(logprobs: torch.Tensor, token: int, k: int) -> dict[int, Logprob]:
    """The chosen token and the k most likely ones, each with its rank (1 = most likely)."""
    chosen = float(logprobs[token])
    result = {token: Logprob(chosen, rank=int((logprobs > chosen).sum()) + 1)}
    if k:
        values, ids = torch.topk(logprobs, k)
        for rank, (value, tid) in enumerate(zip(values.tolist(), ids.tolist(), strict=True), start=1):
            result.setdefault(tid, Logprob(value, rank=rank))
    return result
