"""The engine: requests in, one scheduler iteration per `step()`, outputs out.

`LLMEngine` ties the tokenizer, scheduler, model runner, sampler and detokenizer together. A step reads as
nano-vllm's: the scheduler picks a batch, the runner and the sampler give its tokens, the scheduler's
post-processing appends them under the stop rules. It is synchronous and single-threaded on purpose: the
offline `LLM` calls `step()` in a loop, and the engine process interleaves it with reading the request bus.

Structured-output requests are the exception that proves it: their grammar compiles on a thread of its own
(`structured_outputs.engine`) while the request waits outside the scheduler (`preparing`), and a grammar
llguidance refuses drops the request at the next step (`pop_refused`). Each step the masks of the
constrained sequences are filled on another thread while the model runs, and every accepted token advances
its sequence's matcher; a grammar that is complete ends its sequence (finish_reason "stop").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait

import torch

from inference_engine.block_manager import BlockManager
from inference_engine.config import EngineConfig
from inference_engine.detokenizer import IncrementalDetokenizer
from inference_engine.errors import EngineError, EngineOverloadedError, InvalidRequestError
from inference_engine.lora.request import LoRARequest
from inference_engine.lora.stats import lora_stats
from inference_engine.model_loader import load_configured_model
from inference_engine.model_runner import StepOutput
from inference_engine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
)
from inference_engine.pooling import Pooler, PoolingParams, check_pooling_prompt, checkpoint_folder
from inference_engine.runners import make_runner
from inference_engine.sampler import Sampler, SampleResult, TokenBitmask
from inference_engine.sampling_params import SamplingParams
from inference_engine.scheduler import Scheduler, SchedulerOutput
from inference_engine.sequence import Sequence, SequenceGroup, SequenceStatus
from inference_engine.speculative import NgramConfig, NgramProposer
from inference_engine.structured_outputs.engine import StructuredOutputs
from inference_engine.tp_workers import TPWorkers, check_tensor_parallel

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        loaded = load_configured_model(config)
        self.model_name = config.served_model_name or loaded.name
        self.tokenizer = loaded.tokenizer
        model_len = loaded.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or model_len, model_len)
        check_tensor_parallel(loaded.config, config.tensor_parallel_size)
        if config.runner == "generate" and not loaded.config.has_lm_head:
            raise InvalidRequestError(
                f"{loaded.name} is a base model without a language-model head (the body"
                f" of {loaded.config.architecture}): it embeds but cannot generate; use runner 'pooling'."
            )
        self.workers = TPWorkers(config) if config.tensor_parallel_size > 1 else None
        try:
            self.runner = make_runner(config, loaded, self.workers)
        except BaseException:
            self.shutdown()
            raise
        self.scheduler = Scheduler(
            config,
            self.runner.num_blocks,
            self.runner.num_cpu_blocks,
            self.max_model_len,
            self.tokenizer.eos_token_ids,
            self.runner.burst_rows,
            self.runner.num_offload_blocks,
        )
        # Embeddings: every engine pools (its prompts share the batch with generation); a pooling runner's
        # engine does nothing else.
        self.pooler = Pooler.build(config.pooler_config, checkpoint_folder(config), loaded.config.hidden_size)
        self.proposer: NgramProposer | None = None
        if config.speculative_config:
            quantized = loaded.quantization != "none"
            device = self.runner.device.type
            bf16 = self.runner.dtype == torch.bfloat16
            ngram = NgramConfig.from_dict(config.speculative_config, device, quantized, bf16)
            self.proposer = NgramProposer(ngram, self.max_model_len, device)
        self.sampler = Sampler(self.tokenizer.eos_token_ids, config.seed)
        self.vocab_size = loaded.config.vocab_size  # the width of the model's logits
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size)
        self.groups: dict[str, SequenceGroup] = {}
        self._preparing: dict[str, tuple[SequenceGroup, Future]] = {}  # waiting for their grammar
        self._refused: dict[str, EngineError] = {}  # dropped because their grammar failed to compile
        # LoRA: requests waiting for a slot for their adapter (not yet the scheduler's), and those holding one
        self._lora_waiting: list[Sequence] = []
        self._lora_holders: set[str] = set()
        self._next_seq_id = 0
        self._last_log = time.monotonic()
        self._logged_tokens = 0
        self.step_seconds_total = 0.0  # in steps that ran a batch
        self._logged_seconds = (0.0, 0.0)  # step and MoE seconds at the last log
        self._logged_drafts = (0, 0, 0)  # the proposer's totals() at the last log
        logger.info(
            "engine ready: model=%s device=%s dtype=%s attention=%s kv_blocks=%d x %d tokens (%.1f MiB)",
            self.model_name,
            self.runner.device,
            self.runner.dtype,
            self.runner.attention_backend,
            self.runner.num_blocks,
            config.block_size,
            self.runner.num_blocks * self.runner.kv_bytes_per_block / 2**20,
        )

    @property
    def block_manager(self) -> BlockManager:
        """The scheduler's KV blocks, to read (every edit goes through the scheduler)."""
        return self.scheduler.block_manager

    @property
    def prompt_tokens_total(self) -> int:
        return self.scheduler.num_prompt_tokens

    @property
    def generation_tokens_total(self) -> int:
        return self.scheduler.num_generated_tokens

    def shutdown(self) -> None:
        """Stops the other tensor-parallel ranks, if any (they also die with this process)."""
        if self.workers is not None:
            self.workers.stop()
        if hasattr(self, "structured"):
            self.structured.shutdown()

    # --- requests ---------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[int]:
        """Validates and queues a request; returns its prompt token ids. Raises before queueing anything.

        A structured-output request first waits for its grammar (`preparing`); if llguidance refuses the
        grammar, a later `step()` drops the request and `pop_refused()` hands over the error."""
        if request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already running.")
        if len(self.groups) >= self.config.max_pending_requests:
            raise EngineOverloadedError(f"the engine already holds {len(self.groups)} requests; retry later.")
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, [int(t) for t in prompt]
            if any(not 0 <= t < self.tokenizer.vocab_size for t in token_ids):
                raise InvalidRequestError("prompt token ids must be in [0, vocab_size).")
        if isinstance(params, PoolingParams) or self.config.runner == "pooling":
            return self._add_pooling(request_id, text, token_ids, params, priority, arrival_time)
        if params.truncate_prompt_tokens is not None:  # vLLM's: keep the prompt's last tokens
            keep = params.truncate_prompt_tokens
            if keep == -1:  # as many as fit beside the answer
                keep = self.max_model_len - min(params.max_tokens or 1, self.max_model_len - 1)
            text, token_ids = None, token_ids[-keep:]
        params = self._check_lengths(token_ids, params)
        self._check_vocabulary(params)
        if lora_request is not None:
            if self.runner.lora is None:
                raise InvalidRequestError("LoRA adapters need an engine started with enable_lora.")
            self.runner.lora.load(lora_request)  # read and checked now: a bad adapter is refused here
        spec = params.structured_outputs
        grammar = self.structured.compile(spec) if spec is not None else None
        if grammar is not None and grammar.done() and grammar.exception() is not None:
            raise _refusal(grammar.exception())  # a constraint already known to be bad
        group = SequenceGroup(request_id, text, token_ids, params, priority, arrival_time or time.time())
        group.lora_request = lora_request
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        self.groups[request_id] = group
        seq = self._new_sequence(group, token_ids, index=0)
        if grammar is None:
            self._enqueue(seq)
        elif grammar.done():
            seq.grammar = self.structured.matcher(grammar.result())
            self._enqueue(seq)
        else:
            self._preparing[request_id] = (group, grammar)
        return token_ids

    def _add_pooling(
        self,
        request_id: str,
        text: str | None,
        token_ids: list[int],
        params: SamplingParams | PoolingParams,
        priority: int,
        arrival_time: float | None,
    ) -> list[int]:
        """An embedding request (see `pooling`): its prompt is prefilled and pooled, nothing generated."""
        if not isinstance(params, PoolingParams):
            raise InvalidRequestError(
                "this model serves embeddings (runner 'pooling'); it does not generate text."
            )
        if params.truncate_prompt_tokens is not None:  # as for generation: keep the prompt's last tokens
            keep = (
                self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            )
            text, token_ids = None, token_ids[-keep:]
        capacity = (self.block_manager.num_blocks - self.scheduler.watermark) * self.config.block_size
        check_pooling_prompt(len(token_ids), self.max_model_len, capacity)
        # max_tokens=1: nothing (a draft proposer, a burst) plans work past the prompt.
        group = SequenceGroup(
            request_id, text, token_ids, SamplingParams(max_tokens=1), priority, arrival_time or time.time()
        )
        group.pooling = self.pooler.state(params, len(token_ids))
        self.groups[request_id] = group
        self.scheduler.add(self._new_sequence(group, token_ids, index=0))
        return token_ids

    def preparing(self, request_id: str) -> bool:
        """Whether the request still waits for its grammar to compile."""
        return request_id in self._preparing

    def pop_refused(self) -> dict[str, EngineError]:
        """Requests dropped since the last call because their grammar failed to compile, with the error."""
        refused, self._refused = self._refused, {}
        return refused

    def _admit_prepared(self) -> None:
        """Queues the requests whose grammar has compiled; drops those whose grammar failed."""
        for request_id, (group, future) in list(self._preparing.items()):
            if not future.done():
                continue
            del self._preparing[request_id]
            error = future.exception()
            if error is not None:
                del self.groups[request_id]
                self._refused[request_id] = _refusal(error)
                continue
            seq = group.seqs[0]
            seq.grammar = self.structured.matcher(future.result())
            self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        """Hands a new request's sequence to the scheduler, once its LoRA adapter (if any) holds a slot: with
        every slot held by other adapters' requests it waits here, and `_admit_lora_waiting` retries."""
        lora = seq.group.lora_request
        if lora is not None:
            if not self.runner.lora.acquire(lora):
                self._lora_waiting.append(seq)
                return
            self._lora_holders.add(seq.group.request_id)
        self.scheduler.add(seq)

    def _admit_lora_waiting(self) -> None:
        waiting, self._lora_waiting = self._lora_waiting, []
        for seq in waiting:
            self._enqueue(seq)

    def _drop_lora(self, group: SequenceGroup) -> None:
        """A finished or aborted request gives back its adapter's slot (or stops waiting for one)."""
        if group.request_id in self._lora_holders:
            self._lora_holders.discard(group.request_id)
            self.runner.lora.release(group.lora_request)
        self._lora_waiting = [seq for seq in self._lora_waiting if seq.group is not group]

    def _check_vocabulary(self, params: SamplingParams) -> None:
        """Token ids the request names must be the model's (the web tier cannot know its vocabulary)."""
        vocab = self.tokenizer.vocab_size
        for field in ("logit_bias", "allowed_token_ids"):
            tokens = getattr(params, field, None) or ()
            outside = sorted(t for t in tokens if not 0 <= int(t) < vocab)
            if outside:
                raise InvalidRequestError(
                    f"{field}: token id {outside[0]} is not in this model's vocabulary [0, {vocab}).",
                    param=field,
                )

    def _check_lengths(self, token_ids: list[int], params: SamplingParams) -> SamplingParams:
        n = len(token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty.")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens, "
                f"but the prompt has {n} tokens."
            )
        room = self.max_model_len - n
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} in the completion)."
            )
        capacity = (self.block_manager.num_blocks - self.scheduler.watermark) * self.config.block_size
        needed = n + (params.max_tokens or room)
        if needed > capacity:
            raise InvalidRequestError(
                f"The request needs up to {needed} tokens of KV cache but the engine's whole cache holds "
                f"{capacity}; lower max_tokens or shorten the prompt."
            )
        return params

    def _new_sequence(self, group: SequenceGroup, token_ids: list[int], index: int) -> Sequence:
        params = group.params
        seq = Sequence(self._next_seq_id, group, list(token_ids), len(group.prompt_token_ids), index=index)
        self._next_seq_id += 1
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(hash((params.seed, index)) & (2**63 - 1))
        seq.detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            group.prompt_token_ids,
            params.stop,
            params.skip_special_tokens,
            params.include_stop_str_in_output,
        )
        group.seqs.append(seq)
        return seq

    def abort_request(self, request_id: str | Iterable[str]) -> list[RequestOutput]:
        """Drops requests at once and frees their KV blocks; unknown ids are ignored. Returns the final
        outputs (finish_reason "abort") of the requests it dropped."""
        outputs = []
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            group = self.groups.pop(rid, None)
            if group is None:
                continue
            self._preparing.pop(rid, None)
            self._drop_lora(group)
            for seq in group.seqs:
                self._retire(seq)
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
            group.metrics.finished_time = time.time()
            output = self._request_output(group)
            output.finished = True  # also before a prompt forks into its n samples
            outputs.append(output)
        return outputs

    def _retire(self, seq: Sequence) -> None:
        """A finished or aborted sequence leaves the scheduler (its KV blocks freed) and the runner."""
        self.scheduler.remove(seq)
        self.runner.release(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def reset_prefix_cache(self) -> bool:
        """Drops the prefix cache; False (and nothing dropped) while requests hold KV blocks."""
        return self.scheduler.reset_prefix_cache()

    # --- the loop ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule a batch, run it, post-process its tokens; the outputs of the requests
        that got tokens."""
        start = time.perf_counter()
        self._admit_prepared()
        self._admit_lora_waiting()
        sched = self._schedule()
        if sched.is_empty:
            return []
        samples = self._execute(sched)
        for seq in self.scheduler.postprocess(sched, samples):
            self.runner.release(seq)
        self.step_seconds_total += time.perf_counter() - start
        return self._outputs(samples)

    def _schedule(self) -> SchedulerOutput:
        """The next batch, the proposer's draft tokens (speculative decoding) in it. With nothing to run but
        grammars to wait for, waits for one briefly rather than spin."""
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running)
        # No bursts while adapters run: a burst is one native call, which knows no adapters.
        sched = self.scheduler.schedule(burst=not self._preparing and not self._lora_holders)
        if sched.is_empty and self._preparing:
            wait([future for _, future in self._preparing.values()], 0.05, FIRST_COMPLETED)
        return sched

    def _execute(self, sched: SchedulerOutput) -> list[tuple[Sequence, list[SampleResult]]]:
        """Runs the batch and samples: each sampled sequence's new tokens (a burst's, its accepted draft
        tokens and one, or one), the samples a prompt of n > 1 forks into among them."""
        if sched.num_steps > 1:
            sampling = self.sampler.burst_parameters(sched.seqs, sched.num_steps, self.vocab_size)
            tokens = self.runner.execute_burst(sched, sampling)
            return [
                (seq, [SampleResult(t, 0.0, None) for t in row])
                for seq, row in zip(sched.seqs, tokens, strict=True)
            ]
        # The constrained sequences this step samples: their masks are filled while the model runs.
        constrained = [
            seq
            for seq, n in zip(sched.seqs, sched.num_new_tokens, strict=True)
            if seq.grammar is not None and seq.num_computed_tokens + n >= len(seq)
        ]
        masks = self.structured.fill_masks([seq.grammar for seq in constrained]) if constrained else None
        out = self.runner.execute(sched)
        for seq, logprobs in out.prompt_logprobs.items():
            seq.group.prompt_logprobs.extend(logprobs)
        allowed = (
            dict(zip(constrained, self.structured.masks(masks), strict=True)) if masks is not None else None
        )
        return self._sample(out, allowed) + self._pool(out, sched)

    def _pool(self, out: StepOutput, sched: SchedulerOutput) -> list[tuple[Sequence, list[SampleResult]]]:
        """Adds the step's pooled hidden rows to their requests. The pooling sequences whose prompt this step
        completes finish (their vector is ready), with no token: post-processing frees them."""
        for seq, start, part in out.pooled:
            seq.group.pooling.add(part, start)
        done = []
        for seq, n in zip(sched.seqs, sched.num_new_tokens, strict=True):
            if seq.group.pooling is not None and seq.num_computed_tokens + n == len(seq):
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "stop"
                done.append((seq, []))
        return done

    def _sample(
        self, out: StepOutput, masks: dict[Sequence, torch.Tensor] | None = None
    ) -> list[tuple[Sequence, list[SampleResult]]]:
        """Each sampled sequence's new tokens: one, or its accepted draft tokens plus one. `masks`: the
        allowed tokens of constrained sequences (their forked samples share them)."""
        rows, seqs, drafts = [], [], []
        mask_rows, mask_bits = [], []
        row = 0
        while row < len(out.sample_seqs):
            seq = out.sample_seqs[row]
            count = 1 + len(seq.draft_token_ids)
            if masks and seq in masks:  # constrained sequences never carry drafts
                mask_rows.append(len(rows))
                mask_bits.append(masks[seq])
            rows += range(row, row + count)
            seqs.append(seq)
            drafts.append(seq.draft_token_ids)
            for child in self._fork(seq):  # a prompt with n > 1 forks before its first sample
                if masks and seq in masks:
                    mask_rows.append(len(rows))
                    mask_bits.append(masks[seq])
                rows.append(row)
                seqs.append(child)
                drafts.append([])
            row += count
        if not seqs:
            return []
        allowed = TokenBitmask(mask_rows, torch.stack(mask_bits)) if mask_rows else None
        # Rows repeat only where a prompt forks into n samples; otherwise the logits go over uncopied.
        logits = out.logits if len(rows) == len(out.logits) else out.logits[rows]
        if any(drafts):
            samples = list(zip(seqs, self.sampler.verify(logits, seqs, drafts, allowed), strict=True))
            for (_, results), draft in zip(samples, drafts, strict=True):
                if draft:
                    self.proposer.record(len(draft), len(results) - 1)
            return samples
        results = self.sampler(logits, seqs, allowed)
        return [(seq, [result]) for seq, result in zip(seqs, results, strict=True)]

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """The n - 1 further samples of a prompt about to sample its first token (the scheduler's
        post-processing gives them its KV blocks)."""
        group = seq.group
        if seq.num_output_tokens or len(group.seqs) >= group.params.n or seq.index != 0:
            return []
        children = []
        for index in range(1, group.params.n):
            child = self._new_sequence(group, seq.token_ids, index)
            child.grammar = seq.grammar.fork() if seq.grammar is not None else None
            children.append(child)
        return children

    def _outputs(self, samples: list[tuple[Sequence, list[SampleResult]]]) -> list[RequestOutput]:
        """The outputs of the requests that got tokens; finished ones leave the engine."""
        outputs, now = [], time.time()
        for group in {seq.group.request_id: seq.group for seq, _ in samples}.values():
            if group.is_finished:
                group.metrics.finished_time = now
                del self.groups[group.request_id]
                self._drop_lora(group)
            outputs.append(self._request_output(group))
        self._maybe_log_stats()
        return outputs

    def _request_output(self, group: SequenceGroup) -> RequestOutput | EmbeddingRequestOutput:
        if group.pooling is not None:
            done = group.is_finished and group.seqs[0].finish_reason == "stop"
            return EmbeddingRequestOutput(
                request_id=group.request_id,
                prompt=group.prompt,
                prompt_token_ids=group.prompt_token_ids,
                outputs=EmbeddingOutput(group.pooling.embedding()) if done else None,
                finished=group.is_finished,
                metrics=group.metrics,
            )
        completions = []
        for seq in sorted(group.seqs, key=lambda s: s.index):
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.detokenizer.visible_text,
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None,
                    logprobs=self._decoded(seq.logprobs) if seq.params.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            finished=group.is_finished,
            metrics=group.metrics,
            prompt_logprobs=self._decoded(group.prompt_logprobs)
            if group.prompt_logprobs is not None
            else None,
            num_cached_tokens=group.seqs[0].num_cached_tokens,
        )

    def _decoded(self, positions: list[dict[int, Logprob] | None]) -> list[dict[int, Logprob] | None]:
        for entry in positions:
            for token_id, lp in (entry or {}).items():
                if lp.decoded_token is None:
                    lp.decoded_token = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return list(positions)

    # --- observability ------------------------------------------------------------------------------

    def stats(self) -> dict:
        running = self.scheduler.running
        return {
            "num_running": len(running),
            "num_waiting": len(self.scheduler.waiting),
            "num_swapped": len(self.scheduler.swapped),
            "kv_usage": self.block_manager.usage,
            "num_free_blocks": self.block_manager.num_free_blocks,
            "num_blocks": self.block_manager.num_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "prefix_cache_query_tokens": self.block_manager.num_cache_queries,
            "prefix_cache_hit_tokens": self.block_manager.num_cache_hits,
            **self._offload_stats(),
            "step_seconds_total": self.step_seconds_total,
            **({"moe_seconds_total": moe} if (moe := self._moe_seconds()) is not None else {}),
            **(self.proposer.stats() if self.proposer is not None else {}),
            **(self._lora_stats() if self.runner.lora is not None else {}),
        }

    def _lora_stats(self) -> dict:
        s = self.scheduler
        waiting = [*s.waiting, *s.swapped, *self._lora_waiting]
        return lora_stats(s.running, waiting, self.runner.lora.max_loras)

    def _offload_stats(self) -> dict:
        """The prefix cache's second tier (kv_offload), where there is one: prompt tokens looked up in it and
        found there, blocks stored and restored, and the seconds their copies took."""
        tier = self.block_manager.tier
        if tier is None:
            return {}
        return {
            "kv_offload_blocks": tier.num_slots,
            "kv_offload_used_blocks": len(tier),
            "kv_offload_query_tokens": self.block_manager.num_offload_queries,
            "kv_offload_hit_tokens": tier.num_restored_blocks * self.block_manager.block_size,
            "kv_offload_stored_blocks": tier.num_stored_blocks,
            "kv_offload_restored_blocks": tier.num_restored_blocks,
            "kv_offload_store_seconds": self.runner.offload_store_seconds,
            "kv_offload_restore_seconds": self.runner.offload_restore_seconds,
        }

    def _maybe_log_stats(self) -> None:
        interval = self.config.log_stats_interval
        now = time.monotonic()
        if not interval or now - self._last_log < interval:
            return
        tokens = self.generation_tokens_total - self._logged_tokens
        s = self.stats()
        logger.info(
            "running=%d waiting=%d kv_usage=%.1f%% generation=%.1f tok/s preemptions=%d%s",
            s["num_running"],
            s["num_waiting"],
            100 * s["kv_usage"],
            tokens / (now - self._last_log),
            s["num_preemptions"],
            self._moe_share(s),
        )
        self._last_log, self._logged_tokens = now, self.generation_tokens_total
        if self.proposer is not None:
            self._log_speculation()

    def _moe_seconds(self) -> float | None:
        """Seconds the model's experts spent in their fused kernel (MoE models on the CPU), else None."""
        return getattr(self.runner.model, "moe_seconds", None)

    def _moe_share(self, stats: dict) -> str:
        """` moe=NN%`: the share of step time since the last log spent in the experts' fused kernel; empty
        where the experts are not timed (no experts, CUDA) or no step ran."""
        if "moe_seconds_total" not in stats:
            return ""
        totals = (stats["step_seconds_total"], stats["moe_seconds_total"])
        steps, moe = (a - b for a, b in zip(totals, self._logged_seconds, strict=True))
        self._logged_seconds = totals
        return f" moe={100 * moe / steps:.0f}%" if steps > 0 else ""

    def _log_speculation(self) -> None:
        """Since the last log: mean acceptance length (tokens a verification of proposals gave, its own
        included) and the share of proposed tokens accepted, as vLLM logs them; nothing without proposals."""
        totals = self.proposer.totals()
        drafts, proposed, accepted = (a - b for a, b in zip(totals, self._logged_drafts, strict=True))
        self._logged_drafts = totals
        if drafts:
            logger.info(
                "speculative decoding: mean acceptance length=%.2f acceptance rate=%.1f%% drafts=%d",
                1 + accepted / drafts,
                100 * accepted / proposed,
                drafts,
            )


def _refusal(error: BaseException) -> EngineError:
    """A failed grammar compile as the error of one request (a compiled grammar's error is shared by every
    request with the same constraint)."""
    if isinstance(error, InvalidRequestError):
        return InvalidRequestError(str(error), param=error.param)
    return InvalidRequestError(f"the constraint could not be compiled: {error}")
