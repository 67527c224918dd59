"""One step's sampling parameters as tensors on the logits' device, built once per step (vLLM's
SamplingMetadata).

A row is one position to sample: a sequence's next token, or, when a speculative draft of k tokens is
verified, each of the sequence's k + 1 positions. Row j of a draft sees the draft's first j tokens as if
they had been generated already: they count for the penalties and for min_tokens.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from inference_engine.sequence import Sequence


@dataclass
class LogitEdits:
    """Sparse changes to the [rows, vocab] logits, as flat indices (row * vocab + token) into them.

    Duplicate indices are safe: biases and frequency penalties are added once per occurrence, and where a
    value is replaced every duplicate writes the same value.
    """

    bias_index: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    ban_index: torch.Tensor | None = None  # min_tokens: EOS and stop tokens set to -inf
    repetition_index: torch.Tensor | None = None  # every token of prompt and output
    repetition: torch.Tensor | None = None  # the row's repetition penalty, per index
    output_index: torch.Tensor | None = None  # every output token, once per occurrence
    frequency: torch.Tensor | None = None  # minus the row's frequency penalty, per index
    presence: torch.Tensor | None = None  # the row's presence penalty, per index


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [rows] f32, 0 for greedy rows
    top_k: torch.Tensor  # [rows] i32, 0 where off (or not below the vocabulary size)
    top_p: torch.Tensor  # [rows] f32, 1 where off
    min_p: torch.Tensor  # [rows] f32, 0 where off
    draft: torch.Tensor  # [rows] i64, the proposed token a row verifies, -1 for none
    uniforms: torch.Tensor | None  # [rows, 2] f64: acceptance test, inverse-CDF draw; None if all greedy
    greedy_rows: list[int]
    top_k_rows: list[int]  # sampled rows with top-k
    full_rows: list[int]  # sampled rows without top-k
    edits: LogitEdits | None
    logprob_rows: list[int]  # rows whose sequence asked for logprobs
    logprob_ks: list[int]  # how many top alternatives each of those rows reports

    @classmethod
    def build(
        cls,
        seqs: list[Sequence],
        drafts: Seq[Seq[int]] | None,
        vocab_size: int,
        eos_token_ids: Seq[int],
        generator: torch.Generator,
        history: TokenHistory,
        device: torch.device,
    ) -> SamplingMetadata:
        """drafts[i]: the tokens proposed for seqs[i] (None: no drafts anywhere). Seeded sequences draw their
        uniforms from their own generator, the others from `generator`, always on the CPU, so a seeded
        sequence gets the same uniforms alone, in any batch and on any device."""
        params = [seq.params for seq in seqs]
        counts = [len(d) + 1 for d in drafts] if drafts else [1] * len(seqs)
        starts = list(itertools.accumulate(counts, initial=0))
        num_rows = starts.pop()
        if drafts and any(not 0 <= t < vocab_size for d in drafts for t in d):
            raise ValueError(f"draft tokens must be in [0, {vocab_size})")

        def per_row(values: list) -> list:
            if num_rows == len(seqs):
                return values
            return [v for v, n in zip(values, counts, strict=True) for _ in range(n)]

        def rows_of(selected: list[int]) -> list[int]:
            return [r for i in selected for r in range(starts[i], starts[i] + counts[i])]

        greedy = [p.greedy for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]
        sampled = [i for i, g in enumerate(greedy) if not g]
        seeded = [i for i in sampled if seqs[i].generator is not None]
        logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        edited = [
            (starts[i], seq, list(drafts[i]) if drafts else [])
            for i, (seq, p) in enumerate(zip(seqs, params, strict=True))
            if p.edits_logits(seq.num_output_tokens)
        ]
        greedy_rows = rows_of([i for i, g in enumerate(greedy) if g])
        unseeded_rows = rows_of([i for i in sampled if seqs[i].generator is None])
        temperature = per_row([0.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)])
        draft = [t for d in drafts for t in (*d, -1)] if drafts else [-1] * num_rows

        uniforms = None
        if sampled:
            uniforms = torch.zeros(num_rows, 2, dtype=torch.float64)
            if unseeded_rows:
                uniforms[unseeded_rows] = torch.rand(
                    len(unseeded_rows), 2, generator=generator, dtype=torch.float64
                )
            for i in seeded:
                uniforms[starts[i] : starts[i] + counts[i]] = torch.rand(
                    counts[i], 2, generator=seqs[i].generator, dtype=torch.float64
                )
            uniforms = uniforms.to(device)

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=tensor(temperature, torch.float32),
            top_k=tensor(per_row(top_k), torch.int32),
            top_p=tensor(per_row([p.top_p for p in params]), torch.float32),
            min_p=tensor(per_row([p.min_p for p in params]), torch.float32),
            draft=tensor(draft, torch.int64),
            uniforms=uniforms,
            greedy_rows=greedy_rows,
            top_k_rows=rows_of([i for i in sampled if top_k[i]]),
            full_rows=rows_of([i for i in sampled if not top_k[i]]),
            edits=_edits(edited, vocab_size, eos_token_ids, history, device) if edited else None,
            logprob_rows=rows_of(logprobs),
            logprob_ks=[params[i].logprobs for i in logprobs for _ in range(counts[i])],
        )


def _edits(
    edited: list[tuple[int, Sequence, list[int]]],
    vocab: int,
    eos_token_ids: Seq[int],
    history: TokenHistory,
    device: torch.device,
) -> LogitEdits:
    bias_index, bias, ban_index = [], [], []
    rep_ids, rep_rows, rep_values = [], [], []
    out_ids, out_rows, frequency, presence = [], [], [], []
    for first, seq, proposed in edited:
        params = seq.params
        bias_items = [(t, b) for t, b in (params.logit_bias or {}).items() if 0 <= t < vocab]
        banned = [t for t in (*eos_token_ids, *params.stop_token_ids) if 0 <= t < vocab]
        penalised = params.repetition_penalty != 1.0
        counted = bool(params.presence_penalty or params.frequency_penalty)
        tokens = history(seq) if penalised or counted else None
        for j in range(len(proposed) + 1):
            row = first + j
            bias_index += [row * vocab + t for t, _ in bias_items]
            bias += [b for _, b in bias_items]
            if seq.num_output_tokens + j < params.min_tokens:
                ban_index += [row * vocab + t for t in banned]
            if tokens is None:
                continue
            ids = torch.cat([tokens, torch.tensor(proposed[:j], dtype=torch.long)]) if j else tokens
            if penalised:
                rep_ids.append(ids)
                rep_rows.append((row, len(ids)))
                rep_values.append(params.repetition_penalty)
            outputs = ids[seq.num_prompt_tokens :] if counted else None
            if outputs is not None and len(outputs):
                out_ids.append(outputs)
                out_rows.append((row, len(outputs)))
                frequency.append(-params.frequency_penalty)
                presence.append(params.presence_penalty)

    edits = LogitEdits()
    if bias_index:
        edits.bias_index = torch.tensor(bias_index, dtype=torch.long, device=device)
        edits.bias = torch.tensor(bias, dtype=torch.float32, device=device)
    if ban_index:
        edits.ban_index = torch.tensor(ban_index, dtype=torch.long, device=device)
    if rep_ids:
        edits.repetition_index = _flat_index(rep_ids, rep_rows, vocab).to(device)
        edits.repetition = _per_index(rep_values, rep_rows).to(device)
    if out_ids:
        edits.output_index = _flat_index(out_ids, out_rows, vocab).to(device)
        edits.frequency = _per_index(frequency, out_rows).to(device)
        edits.presence = _per_index(presence, out_rows).to(device)
    return edits


def _flat_index(ids: list[torch.Tensor], rows: list[tuple[int, int]], vocab: int) -> torch.Tensor:
    offsets = torch.tensor([row * vocab for row, _ in rows], dtype=torch.long)
    return torch.cat(ids) + offsets.repeat_interleave(torch.tensor([n for _, n in rows]))


def _per_index(values: list[float], rows: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).repeat_interleave(torch.tensor([n for _, n in rows]))


class TokenHistory:
    """Each sequence's token ids as an int64 tensor that grows with it, so that a step with penalties
    converts only the tokens new since the last step (converting whole histories from Python lists takes
    tens of milliseconds at batch 256 with 1,000-token sequences).

    A sequence whose tokens were cut back (its last known token changed or it got shorter) is converted
    again from the start.
    """

    def __init__(self) -> None:
        self._known: weakref.WeakKeyDictionary[Sequence, tuple[torch.Tensor, int]] = (
            weakref.WeakKeyDictionary()
        )

    def __call__(self, seq: Sequence) -> torch.Tensor:
        tokens = seq.token_ids
        n = len(tokens)
        buffer, known = self._known.get(seq, (None, 0))
        if known > n or (known and int(buffer[known - 1]) != tokens[known - 1]):
            known = 0
        if buffer is None or len(buffer) < n:
            grown = torch.empty(max(64, 2 * n), dtype=torch.long)
            if known:
                grown[:known] = buffer[:known]
            buffer = grown
        if n > known:
            buffer[known:n] = torch.tensor(tokens[known:n], dtype=torch.long)
        self._known[seq] = (buffer, n)
        return buffer[:n]
