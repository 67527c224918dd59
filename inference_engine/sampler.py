"""Turns logits into tokens: each sequence's next token, or, verifying a speculative draft, the draft tokens
it accepts plus one more.

Everything runs batched on the logits' device. A step's sampling parameters become per-row tensors
(`SamplingMetadata`); logit biases, min_tokens bans and penalties are sparse in-place edits; each sampled row
keeps the tokens that temperature, top-k, top-p and min-p leave and draws one by inverse CDF from a single
uniform. On the CPU the native kernel (`kernels/cpu/sampling.py`, which defines the kept set and the draw)
does the per-row work; on other devices, or where it cannot run, the PyTorch code below does the same.
Only token ids and requested logprobs come back to the host.

Structured outputs arrive as a token bitmask per constrained row (`TokenBitmask`); the tokens a row's grammar
forbids get -inf before anything else decides, so greedy and sampled rows alike pick an allowed token.

Uniforms are drawn on the CPU: seeded sequences from their own generator, so that a seeded request samples
the same tokens alone or inside any batch. Logprobs are reported from the model's raw distribution, before
penalties and temperature, as OpenAI and vLLM do.

Speculative verification (`Sampler.verify`) accepts draft token t at a position with probability p(t) under
that position's processed distribution and otherwise draws from p without t, renormalised; when every draft
token is accepted it draws one more from the last position. For a deterministic draft (n-gram proposals)
that leaves the output distribution exactly that of sampling one token at a time; greedy rows accept the
longest prefix that equals the argmax and then take the argmax, exactly what greedy decoding gives.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from inference_engine.outputs import Logprob
from inference_engine.sampling_metadata import LogitEdits, SamplingMetadata, TokenHistory
from inference_engine.sequence import Sequence
from llmserve_kernels.cpu import sampling as cpu_sampling


@dataclass
class TokenBitmask:
    """Allowed tokens of some rows: bit t of `bits[i]` (int32 words, 32 tokens each) is set where token t
    may follow at logits row `rows[i]`."""

    rows: list[int]
    bits: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32, on any device


def apply_token_bitmask(logits: torch.Tensor, mask: TokenBitmask) -> None:
    """Sets the logits of every token a row's bitmask forbids to -inf, in place."""
    device, vocab = logits.device, logits.shape[1]
    bits = mask.bits.to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).view(len(mask.rows), -1)[:, :vocab].bool()
    rows = torch.tensor(mask.rows, device=device)
    logits[rows] = logits[rows].masked_fill_(~allowed, float("-inf"))


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
    def __init__(self, eos_token_ids: list[int], seed: int, use_native: bool = True) -> None:
        """use_native=False runs the PyTorch path on the CPU too (the path CUDA takes)."""
        self.eos_token_ids = eos_token_ids
        self.generator = torch.Generator().manual_seed(seed)  # for unseeded requests
        self.use_native = use_native
        self.history = TokenHistory()

    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], allowed: TokenBitmask | None = None
    ) -> list[SampleResult]:
        """logits: [len(seqs), vocab], fp32 on any device; modified in place. `allowed`: the grammars'
        masks of the constrained rows."""
        if len(logits) != len(seqs):
            raise ValueError(f"{len(logits)} rows of logits for {len(seqs)} sequences")
        return [results[0] for results in self._sample(logits, seqs, None, allowed)]

    @torch.inference_mode()
    def verify(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        draft_token_ids: Seq[Seq[int]],
        allowed: TokenBitmask | None = None,
    ) -> list[list[SampleResult]]:
        """Each sequence's accepted draft tokens plus one more.

        logits: for each sequence in turn, len(draft) + 1 rows: after its last token and after each of its
        draft tokens (fp32, any device; modified in place). Penalties and min_tokens at row j count the
        draft's first j tokens as generated.
        """
        if len(draft_token_ids) != len(seqs):
            raise ValueError(f"{len(draft_token_ids)} drafts for {len(seqs)} sequences")
        rows = sum(len(d) + 1 for d in draft_token_ids)
        if len(logits) != rows:
            raise ValueError(f"{len(logits)} rows of logits for drafts that need {rows}")
        return self._sample(logits, seqs, draft_token_ids, allowed)

    def _sample(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        drafts: Seq[Seq[int]] | None,
        allowed: TokenBitmask | None,
    ) -> list[list[SampleResult]]:
        logprobs: dict[int, tuple[float, dict[int, Logprob]]] = {}
        if all(self.plain_greedy(s) for s in seqs):
            if allowed is not None:
                apply_token_bitmask(logits, allowed)
            tokens = argmax(logits).tolist()
            proposed = [t for d in drafts for t in (*d, -1)] if drafts else [-1] * len(tokens)
            accepted = [t == d for t, d in zip(tokens, proposed, strict=True)]
        else:
            logits = logits.float().contiguous()  # no copy when it already is
            md = SamplingMetadata.build(
                seqs,
                drafts,
                logits.shape[1],
                self.eos_token_ids,
                self.generator,
                self.history,
                logits.device,
            )
            raw = logits[md.logprob_rows] if md.logprob_rows else None  # a copy, before the edits
            if allowed is not None:
                apply_token_bitmask(logits, allowed)
            if md.edits is not None:
                apply_edits(logits, md.edits)
            token_tensor, accepted_tensor = self._sample_rows(logits, md)
            if raw is not None:
                logprobs = _logprobs(raw, token_tensor[md.logprob_rows], md.logprob_rows, md.logprob_ks)
            tokens, accepted = token_tensor.tolist(), accepted_tensor.tolist()

        results, row = [], 0
        for i in range(len(seqs)):
            num_rows = len(drafts[i]) + 1 if drafts else 1
            taken = []
            for r in range(row, row + num_rows):
                logprob, top = logprobs.get(r, (0.0, None))
                taken.append(SampleResult(tokens[r], logprob, top))
                if not accepted[r]:
                    break
            results.append(taken)
            row += num_rows
        return results

    def _sample_rows(self, logits: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if self.use_native:
            native = cpu_sampling.sample(
                logits, md.temperature, md.top_k, md.top_p, md.min_p, md.draft, md.uniforms
            )
            if native is not None:
                return native
        return sample_rows(logits, md)

    def burst_parameters(
        self, seqs: list[Sequence], steps: int, vocab_size: int
    ) -> tuple[torch.Tensor, ...] | None:
        """What a burst of `steps` decode steps of `seqs` samples with (`ModelRunner.execute_burst`): None
        where every sequence is greedy, else each one's temperature, top_k, top_p and min_p, and every step's
        uniforms [steps, len(seqs), 2], drawn from each generator as that many single steps draw them while
        every sequence runs."""
        if all(seq.params.greedy for seq in seqs):
            return None
        cpu = torch.device("cpu")
        per_step = [
            SamplingMetadata.build(
                seqs, None, vocab_size, self.eos_token_ids, self.generator, self.history, cpu
            )
            for _ in range(steps)
        ]
        first = per_step[0]
        uniforms = torch.stack([md.uniforms for md in per_step])
        return first.temperature, first.top_k, first.top_p, first.min_p, uniforms

    @classmethod
    def plain_greedy(cls, seq: Sequence) -> bool:
        """Greedy with nothing that changes the logits first and no logprobs to report."""
        return seq.params.greedy and cls.unedited(seq)

    @staticmethod
    def unedited(seq: Sequence) -> bool:
        """Nothing changes the logits before the choice, and no logprobs to report."""
        return seq.params.logprobs is None and not seq.params.edits_logits(seq.num_output_tokens)


def apply_edits(logits: torch.Tensor, edits: LogitEdits) -> None:
    """Logit bias, then the min_tokens ban, then the repetition penalty (prompt and output tokens: positive
    logits divided by it, negative ones multiplied), then frequency and presence penalties (output tokens)."""
    flat = logits.view(-1)
    if edits.bias_index is not None:
        flat.index_add_(0, edits.bias_index, edits.bias)
    if edits.ban_index is not None:
        flat.index_fill_(0, edits.ban_index, float("-inf"))
    if edits.repetition_index is not None:
        values = flat[edits.repetition_index]
        flat[edits.repetition_index] = torch.where(
            values > 0, values / edits.repetition, values * edits.repetition
        )
    if edits.output_index is not None:
        flat.index_add_(0, edits.output_index, edits.frequency)
        flat[edits.output_index] = flat[edits.output_index] - edits.presence


def sample_rows(logits: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch path: (tokens, accepted) for every row of fp32 logits, as the native kernel defines them.

    Rows without top-k weigh and draw over the whole vocabulary (a sort where they have top-p); top-k rows
    work on their candidates, every token at or above the k-th largest logit, taken in vocabulary order.
    Padding a narrower row's candidates changes none of its sums, so a row's result does not depend on the
    batch (on the CPU exactly; CUDA kernels may order a reduction differently for other shapes).
    """
    device = logits.device
    tokens = torch.empty(len(logits), dtype=torch.long, device=device)
    accepted = torch.zeros(len(logits), dtype=torch.bool, device=device)
    if md.greedy_rows:
        rows = torch.tensor(md.greedy_rows, device=device)
        chosen = logits[rows].argmax(dim=-1)
        tokens[rows] = chosen
        accepted[rows] = chosen == md.draft[rows]
    for row_list, top_k in ((md.full_rows, False), (md.top_k_rows, True)):
        if not row_list:
            continue
        rows = torch.tensor(row_list, device=device)
        x, draft, u = logits[rows], md.draft[rows], md.uniforms[rows]
        inv_t = 1.0 / md.temperature[rows]
        if top_k:
            ids, x = _top_k_candidates(x, md.top_k[rows])
            match = ids == draft[:, None]
            column = torch.where(match.any(dim=-1), match.int().argmax(dim=-1), -1)
        else:
            ids, column = None, draft
        best = x.max(dim=-1, keepdim=True).values
        weights = torch.exp((x - best) * inv_t[:, None])
        cut = torch.maximum(md.min_p[rows], _top_p_cut(weights, md.top_p[rows]))
        chosen, took_draft = _draw(weights, cut, column, u)
        broken = ~best.squeeze(1).isfinite()  # all -inf, a +inf or a NaN: the argmax, as the kernel does
        chosen, took_draft = torch.where(broken, x.argmax(dim=-1), chosen), took_draft & ~broken
        if ids is not None:
            chosen = ids.gather(1, chosen[:, None]).squeeze(1)
        tokens[rows] = torch.where(took_draft, draft, chosen)
        accepted[rows] = took_draft
    return tokens, accepted


def _top_k_candidates(x: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, logits) of every token at or above each row's k-th largest logit, ids ascending; rows with
    fewer candidates than the widest are padded with id vocab_size and logit -inf."""
    vocab = x.shape[1]
    top = x.topk(int(k.max()), dim=-1)
    kth = top.values.gather(1, (k.long() - 1)[:, None])
    count = (x >= kth).sum(dim=-1).clamp(min=k)  # at least k, also where the k-th largest is a NaN
    width = int(count.max())
    if width > top.values.shape[1]:  # ties at the k-th largest
        top = x.topk(width, dim=-1)
    valid = torch.arange(width, device=x.device) < count[:, None]
    ids, order = top.indices[:, :width].masked_fill(~valid, vocab).sort(dim=-1)
    values = top.values[:, :width].gather(1, order).masked_fill(ids == vocab, float("-inf"))
    return ids, values


def _top_p_cut(weights: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the weight of the last token of the smallest most-likely set whose mass reaches top_p (0
    where top_p is 1)."""
    cut = torch.zeros(len(weights), device=weights.device)
    if not bool((top_p < 1.0).any()):
        return cut
    ordered = weights.sort(dim=-1, descending=True).values
    cumulative = ordered.cumsum(dim=-1, dtype=torch.float64)
    before = cumulative - ordered
    keep = (before < top_p[:, None].double() * cumulative[:, -1:]).sum(dim=-1).clamp(min=1)
    return torch.where(top_p < 1.0, ordered.gather(1, (keep - 1)[:, None]).squeeze(1), cut)


def _draw(
    weights: torch.Tensor, cut: torch.Tensor, draft_column: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(column drawn, draft accepted) per row: the draft column (-1: none) is accepted with its share of the
    kept weight (weights >= cut); otherwise a column is drawn by inverse CDF from the kept weights without
    the draft."""
    kept = torch.where(weights >= cut[:, None], weights, 0.0)
    has_draft = draft_column >= 0
    column = draft_column.clamp(min=0)[:, None]
    draft_weight = kept.gather(1, column).squeeze(1) * has_draft
    kept.scatter_(1, column, (kept.gather(1, column).squeeze(1) * ~has_draft)[:, None])
    cdf = kept.cumsum(dim=-1, dtype=torch.float64)
    rest = cdf[:, -1]
    accept = has_draft & ((uniforms[:, 0] * (rest + draft_weight) < draft_weight) | ~(rest > 0))
    target = torch.minimum(uniforms[:, 1] * rest, torch.nextafter(rest, torch.zeros_like(rest)))
    drawn = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1).clamp(max=kept.shape[1] - 1)
    return drawn, accept


def _logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, rows: list[int], ks: list[int]
) -> dict[int, tuple[float, dict[int, Logprob]]]:
    """Row -> (logprob of its token, that token and the k most likely ones with their ranks)."""
    logprobs = torch.log_softmax(raw, dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    top_values, top_ids = logprobs.topk(max(ks), dim=-1)
    result = {}
    for i, (row, k, token, value) in enumerate(
        zip(rows, ks, tokens.tolist(), chosen.squeeze(1).tolist(), strict=True)
    ):
        top = _ranked(token, value, ranks[i], top_values[i, :k].tolist(), top_ids[i, :k].tolist())
        result[row] = (value, top)
    return result


def _ranked(token: int, value: float, rank: int, values: list[float], ids: list[int]) -> dict[int, Logprob]:
    result = {token: Logprob(value, rank=rank)}
    for r, (v, tid) in enumerate(zip(values, ids, strict=True), start=1):
        result.setdefault(tid, Logprob(v, rank=r))
    return result


def top_logprobs(logprobs: torch.Tensor, token: int, k: int) -> dict[int, Logprob]:
    """The chosen token and the k most likely ones, each with its rank (1 = most likely), from one row of
    logprobs."""
    chosen = float(logprobs[token])
    values, ids = torch.topk(logprobs, k) if k else (logprobs[:0], logprobs[:0].long())
    return _ranked(token, chosen, int((logprobs > chosen).sum()) + 1, values.tolist(), ids.tolist())
