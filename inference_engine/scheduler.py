"""Iteration-level scheduling (continuous batching) with chunked prefill and preemption.

Every step the scheduler first keeps the running sequences going (a decode token each, or the next
chunk of a long prompt), then admits waiting sequences while the token budget, `max_num_seqs` and
free KV blocks allow; prefill and decode share one batch. When blocks run out, the lowest-priority,
most recently admitted sequence is preempted: its blocks are freed and it is recomputed later
(or, with swap space, its blocks are copied to CPU memory and back). Requests are ordered by
(priority, arrival), so interactive traffic at priority 0 runs ahead of bulk jobs at a higher value;
a step that admits a more urgent request leaves the less urgent running sequences out, so its first
token waits for its own prefill only, not for a full batch of bulk decodes as well. And while interactive
requests come in, low-priority prompts are prefilled in small chunks (as many tokens a step as sequences
decode in it), so no step grows long enough to keep a newly arrived interactive request waiting long.

The scheduler owns the KV blocks (its `BlockManager`): every block a step takes or gives back goes through it,
and so does the end of a step (`postprocess`: the sampled tokens appended under the stop rules, the slots of
rejected draft tokens given back, full blocks published to the prefix cache, finished sequences freed).
When nothing else waits, a batch of decoding sequences may run several decode steps in one call (a burst,
`SchedulerOutput.num_steps`; vLLM's multi-step scheduling).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from inference_engine.block_manager import BlockManager
from inference_engine.config import EngineConfig
from inference_engine.sampler import Sampler, SampleResult
from inference_engine.sequence import Sequence, SequenceStatus
from inference_engine.stop_rules import append_token

# Seconds after an interactive (priority <= 0) request during which low-priority prompts prefill in small
# chunks: about the pause between the turns of a chat.
INTERACTIVE_WINDOW = 30.0


def _order(seq: Sequence) -> tuple[int, float, int]:
    return (seq.group.priority, seq.group.arrival_time, seq.seq_id)


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    # Slots each sequence computes this step: prompt tokens, or its newest token and its draft tokens; in a
    # burst its newest token and one slot for each later step.
    num_new_tokens: list[int] = field(default_factory=list)
    num_steps: int = 1  # decode steps of a burst (every sequence decoding), run in one call; 1: a plain step
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write, before the step
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block), done first
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    # The prefix cache's second tier (kv_offload): evicted blocks to keep, (device block, slot), then blocks
    # to bring back, (slot, device block); both after the swap-outs and before the swap-ins
    kv_store: list[tuple[int, int]] = field(default_factory=list)
    kv_restore: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        num_cpu_blocks: int,
        max_model_len: int,
        eos_token_ids: Collection[int],
        burst_rows: int = 0,
        num_offload_blocks: int = 0,
    ) -> None:
        """`num_blocks`, `num_cpu_blocks`, `num_offload_blocks`: the KV blocks the runner allocated (device,
        swap space, the prefix cache's second tier); `burst_rows`: sequences the runner's burst takes at once
        (0: no bursts)."""
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.num_scheduler_steps = config.num_scheduler_steps
        self.burst_rows = burst_rows
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching, num_cpu_blocks, num_offload_blocks
        )
        # Admission keeps ~1% of blocks free so newly admitted sequences don't force preemptions at once.
        self.watermark = max(1, num_blocks // 100)
        self.waiting: list[Sequence] = []  # sorted by _order
        self.running: list[Sequence] = []  # sorted by _order
        self.swapped: list[Sequence] = []  # sorted by _order; resumed before any new admission
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # prompt tokens of the requests scheduled so far, for stats
        self.num_generated_tokens = 0  # tokens sampled so far, for stats
        self._interactive_at = -INTERACTIVE_WINDOW  # when the last interactive request arrived

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_order)
        if seq.group.priority <= 0:
            self._interactive_at = time.monotonic()

    def add_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=_order)

    def remove(self, seq: Sequence) -> None:
        """Takes a finished or aborted sequence out of the queues and frees its blocks."""
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
        self.block_manager.free_seq(seq)
        self.block_manager.free_cpu_blocks(seq)

    def reset_prefix_cache(self) -> bool:
        return self.block_manager.reset_prefix_cache()

    def schedule(self, burst: bool = True) -> SchedulerOutput:
        """The next step's batch. `burst`: whether it may be a burst (False while requests the scheduler
        does not hold yet are about to join, e.g. once their grammar compiles: they would wait for it)."""
        out = SchedulerOutput(num_steps=self._burst_steps() if burst else 1)
        budget = self.max_num_batched_tokens
        cutoff = self._make_room_for_urgent(out)
        low_prefill = self._low_priority_prefill_budget()
        out_of_blocks = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if cutoff is not None and seq.group.priority > cutoff:
                break  # running is sorted by priority: the rest wait one step for the urgent prefill
            n = min(len(seq) - seq.num_computed_tokens, budget)
            if n > 1 and seq.group.priority > 0 and low_prefill is not None:
                n = min(n, low_prefill)
                low_prefill -= n
                if n == 0:
                    i += 1
                    continue
            if seq.draft_token_ids:  # speculative proposals ride along where budget and blocks allow
                drafts = seq.draft_token_ids[: budget - n]
                while drafts and not self.block_manager.can_append(seq, n + len(drafts)):
                    drafts = drafts[:-1]
                seq.draft_token_ids = drafts
                n += len(drafts)
            n += out.num_steps - 1  # a burst's later steps: `_burst_steps` made sure their slots fit
            while not self.block_manager.can_append(seq, n):
                victim = self.running[-1]
                self._preempt(victim, out)
                out_of_blocks = True
                if victim is seq:
                    break
            else:
                out.block_copies += self.block_manager.append_slots(seq, n)
                out.seqs.append(seq)
                out.num_new_tokens.append(n)
                budget -= n
                i += 1
        # Then resume swapped sequences and admit waiting ones, most urgent first; nothing while
        # running sequences lack blocks, so that what frees up goes to them.
        while budget > 0 and len(self.running) < self.max_num_seqs and not out_of_blocks:
            queue = min(
                (q for q in (self.swapped, self.waiting) if q), key=lambda q: _order(q[0]), default=None
            )
            if queue is None or (cutoff is not None and queue[0].group.priority > cutoff):
                break
            seq = queue[0]
            n = min(len(seq) - seq.num_computed_tokens, budget)
            capped = n > 1 and seq.group.priority > 0 and low_prefill is not None
            if capped:
                if low_prefill == 0:
                    break
                n = min(n, low_prefill)
            if queue is self.swapped:
                if not self.block_manager.can_swap_in(seq, reserve=self.watermark):
                    break
                out.swap_in += self.block_manager.swap_in(seq)
            else:
                if seq.group.params.prompt_logprobs is None and seq.group.pooling is None:
                    self.block_manager.match_prefix(seq)  # (pooling reads every prompt position)
                n = min(len(seq) - seq.num_computed_tokens, n)  # the prefix match may have covered some
                if not self.block_manager.can_append(seq, n, reserve=self.watermark):
                    self.block_manager.free_seq(seq)  # undo the prefix match; retry next step
                    seq.num_computed_tokens = seq.num_cached_tokens = 0
                    break
            queue.pop(0)
            if capped:
                low_prefill -= n
            out.block_copies += self.block_manager.append_slots(seq, n)
            self.add_running(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
        if out.seqs:  # else they wait for the next step that runs: nothing writes the cache before it
            out.kv_store, out.kv_restore = self.block_manager.take_offload_copies()
        now = time.time()
        for seq in out.seqs:
            metrics = seq.group.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
                self.num_prompt_tokens += len(seq.group.prompt_token_ids)
        return out

    def _burst_steps(self) -> int:
        """Decode steps the coming batch runs in one call (vLLM's multi-step scheduling), which spares the
        Python between steps: up to `num_scheduler_steps` where every running sequence decodes with nothing
        that edits its logits (greedy or sampled, seeded or not) and nothing to report but its tokens, no
        other request waits (it would wait for the whole burst), and the burst fits each sequence's
        max_tokens and context, the step's token budget and the free KV blocks; else 1. The slots of the
        burst's later steps are reserved when it is scheduled; `postprocess` gives back those past where a
        sequence ends."""
        steps, running = self.num_scheduler_steps, self.running
        if (
            steps < 2
            or not running
            or len(running) > self.burst_rows
            or len(running) * steps > self.max_num_batched_tokens
            or self.waiting
            or self.swapped
        ):
            return 1
        for seq in running:
            if (
                len(seq) - seq.num_computed_tokens != 1
                or seq.num_output_tokens == 0  # its first token may fork it (n > 1)
                or seq.draft_token_ids
                or seq.grammar is not None
                or not Sampler.unedited(seq)
            ):
                return 1
            if seq.params.max_tokens is not None:
                steps = min(steps, seq.params.max_tokens - seq.num_output_tokens)
            steps = min(steps, self.max_model_len - len(seq))
        free = self.block_manager.num_free_blocks
        while steps > 1 and sum(self.block_manager.blocks_needed(seq, steps) for seq in running) > free:
            steps -= 1
        return steps if steps > 1 else 1

    def postprocess(
        self, sched: SchedulerOutput, samples: list[tuple[Sequence, list[SampleResult]]]
    ) -> list[Sequence]:
        """The end of a step (nano-vllm's `Scheduler.postprocess`): the scheduled slots now hold K/V; each
        sampled sequence's tokens are appended until a stop rule finishes it; K/V computed past a sequence's
        tokens (rejected draft tokens, a burst's steps after its end) is dropped and its blocks given back;
        full blocks join the prefix cache. Returns the sequences that finished, already freed.

        `samples` may hold sequences the batch did not: the samples a prompt of n > 1 forked into when it
        sampled its first token. They share its KV blocks (copy-on-write) and join the running queue."""
        scheduled = set(sched.seqs)
        for seq, n in zip(sched.seqs, sched.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
        for seq, _ in samples:
            if seq not in scheduled:
                self._fork(seq.group.seqs[0], seq)
        finished, now = [], time.time()
        for seq, results in samples:
            for result in results:
                append_token(seq, result, self.eos_token_ids, self.max_model_len)
                self.num_generated_tokens += 1
                if seq.is_finished:
                    break
            metrics = seq.group.metrics
            metrics.first_token_time = metrics.first_token_time or now
            if seq.is_finished:
                finished.append(seq)
        for seq in sched.seqs:
            if seq.num_computed_tokens >= len(seq):  # K/V of slots past its tokens: not the sequence's
                seq.num_computed_tokens = len(seq) - 1  # rewritten by later steps
                self.block_manager.trim(seq, len(seq))
            seq.draft_token_ids = []
            if seq.group.pooling is None:  # a pooling request's blocks are freed when it ends, never cached
                self.block_manager.register_full_blocks(seq)
        for seq in finished:
            self.remove(seq)
        return finished

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        self.block_manager.fork(parent, child)
        self.add_running(child)

    def _make_room_for_urgent(self, out: SchedulerOutput) -> int | None:
        """Preempts less urgent running sequences while a more urgent request cannot be admitted. Returns
        that request's priority once it can be admitted beside less urgent running sequences (which then sit
        out this step); None when there is no such request (then every running sequence is scheduled).

        Without this, a queue full of bulk work would hold every slot and an interactive request
        would wait for whole bulk generations to finish before its first token.
        """
        while self.waiting and self.running:
            urgent, victim = self.waiting[0], self.running[-1]
            if urgent.group.priority >= victim.group.priority:
                return None
            first_chunk = min(len(urgent), self.max_num_batched_tokens)
            fits = self.block_manager.can_append(urgent, first_chunk, reserve=self.watermark)
            if len(self.running) < self.max_num_seqs and fits:
                return urgent.group.priority
            self._preempt(victim, out)
        return None

    def _low_priority_prefill_budget(self) -> int | None:
        """Prompt tokens low-priority sequences may prefill this step, all together: None (no bound) unless
        an interactive request arrived within `INTERACTIVE_WINDOW`; then as many as sequences decode this
        step (at least a block), which keeps a step within about twice a decode step's work."""
        if time.monotonic() - self._interactive_at > INTERACTIVE_WINDOW:
            return None
        decoding = sum(1 for seq in self.running if len(seq) - seq.num_computed_tokens == 1)
        return max(self.block_manager.block_size, decoding)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Swaps the sequence's KV out to CPU blocks when swap space allows; otherwise drops the KV,
        keeps the tokens and prefills them again later (recompute)."""
        self.running.remove(seq)
        seq.draft_token_ids = []
        self.num_preemptions += 1
        seq.group.metrics.num_preemptions += 1
        if self.block_manager.can_swap_out(seq):
            out.swap_out += self.block_manager.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=_order)
            return
        self.block_manager.free_seq(seq)
        seq.num_computed_tokens = 0
        self.add(seq)
