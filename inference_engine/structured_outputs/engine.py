"""The engine's side of structured outputs: grammars compiled off the step loop, a matcher per sequence, and
each step's token masks filled while the model runs.

llguidance builds a matcher from a grammar and the tokenizer; masks are bitmasks over the vocabulary (bit t
of a row set where token t may come next), which the sampler applies to the logits. Compiled grammars are
kept per constraint (least recently used dropped first), so a repeated schema costs one copy of the
matcher. Compiling runs on its own thread: a request whose grammar is slow to build waits for it outside
the scheduler while the others keep decoding.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch

from inference_engine.sampling_params import StructuredOutputsParams
from inference_engine.structured_outputs.grammars import check, refusal, short_error
from inference_engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class GrammarMatcher:
    """Where one sequence stands in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: list[int]) -> None:
        self.matcher = matcher
        self.eos_token_ids = eos_token_ids

    def fork(self) -> GrammarMatcher:
        return GrammarMatcher(self.matcher.deep_copy(), self.eos_token_ids)

    def accept(self, token_id: int) -> bool:
        """Advances past a sampled token; False where the grammar forbids it (the matcher is then stuck)."""
        if token_id in self.eos_token_ids:
            token_id = self.eos_token_ids[0]  # the one end-of-sequence token llguidance knows
        return self.matcher.consume_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more (not even to continue a number)."""
        return self.matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """What was generated so far is a complete match (ending here satisfies the grammar)."""
        return self.matcher.is_accepting()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


class StructuredOutputs:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 256) -> None:
        """`vocab_size`: the width of the model's logits (it may exceed the tokenizer's)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # int32 words per mask row
        self.cache_size = cache_size
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, Future[llguidance.LLMatcher]] = OrderedDict()
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._masker = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self._lock = threading.Lock()
        self.mask_seconds = 0.0  # time spent filling masks (on the mask thread)
        self.mask_wait_seconds = 0.0  # time the step loop waited for them after the model's forward pass
        self.mask_rows = 0

    # --- grammars -----------------------------------------------------------------------------------

    def compile(self, spec: StructuredOutputsParams) -> Future[llguidance.LLMatcher]:
        """The constraint's compiled grammar (a fresh matcher to copy), from the cache or compiling on the
        compile thread. The future fails with `InvalidRequestError` for a grammar llguidance refuses."""
        key = json.dumps(spec.to_dict(), sort_keys=True)
        with self._lock:
            future = self._compiled.get(key)
            if future is not None:
                self._compiled.move_to_end(key)
                return future
            future = self._compiler.submit(self._build, spec)
            self._compiled[key] = future
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return future

    def matcher(self, compiled: llguidance.LLMatcher) -> GrammarMatcher:
        return GrammarMatcher(compiled.deep_copy(), self.tokenizer.eos_token_ids)

    def _build(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        started = time.perf_counter()
        grammar = check(spec)
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        # The first mask builds the lexer states every copy then shares; build them here, not mid-step. It
        # also shows a grammar that allows no output at all (the matcher then fails at once).
        first = matcher.deep_copy()
        if not matcher.is_error():
            scratch = torch.empty(self.words, dtype=torch.int32)
            first.unsafe_compute_mask_ptr(scratch.data_ptr(), self.words * 4)
        for failed in (matcher, first):
            if failed.is_error():
                raise refusal(spec, f"no output can satisfy it ({short_error(failed.get_error())}).")
        logger.debug("compiled a %s grammar in %.1f ms", spec.kind, 1e3 * (time.perf_counter() - started))
        return matcher

    def _tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:  # only the compile thread gets here
            self._ll_tokenizer = llguidance.LLTokenizer(
                self.tokenizer.backend.to_str(),
                n_vocab=self.vocab_size,
                eos_token=self.tokenizer.eos_token_id,
            )
        return self._ll_tokenizer

    # --- masks --------------------------------------------------------------------------------------

    def fill_masks(self, matchers: list[GrammarMatcher]) -> Future[torch.Tensor]:
        """Starts filling the masks of `matchers` (one row each, int32 bit words) on the mask thread, so
        that they are ready when the step's logits are."""
        return self._masker.submit(self._fill, matchers)

    def masks(self, filling: Future[torch.Tensor]) -> torch.Tensor:
        """The masks `fill_masks` started, once they are filled."""
        started = time.perf_counter()
        bits = filling.result()
        self.mask_wait_seconds += time.perf_counter() - started
        return bits

    def _fill(self, matchers: list[GrammarMatcher]) -> torch.Tensor:
        started = time.perf_counter()
        bits = torch.empty(len(matchers), self.words, dtype=torch.int32)
        row_bytes = self.words * 4
        for i, m in enumerate(matchers):
            m.matcher.unsafe_compute_mask_ptr(bits.data_ptr() + i * row_bytes, row_bytes)
        eos, *others = self.tokenizer.eos_token_ids
        if others:  # llguidance knows one end token; the model's others end a sequence the same way
            ended = (bits[:, eos // 32] >> (eos % 32)) & 1
            for token in others:
                bits[:, token // 32] |= ended << (token % 32)
        self.mask_seconds += time.perf_counter() - started
        self.mask_rows += len(matchers)
        return bits

    def shutdown(self) -> None:
        self._compiler.shutdown(wait=False, cancel_futures=True)
        self._masker.shutdown(wait=False, cancel_futures=True)
