"""Runs the model on one scheduled step.

The step's sequences are flattened into one batch of tokens (ids, positions, cache slots) with the
per-sequence block tables and lengths the attention backend needs; the runner owns the model, the
paged KV cache and its sizing from a memory budget.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from inference_engine import distributed
from inference_engine.attention import AttentionMetadata, get_backend
from inference_engine.attention.torch_backend import native_query_max
from inference_engine.config import EngineConfig
from inference_engine.cuda_graphs import GraphRunner
from inference_engine.layers.linear import LinearBase
from inference_engine.model_loader import LoadedModel
from inference_engine.models import MODEL_CLASSES
from inference_engine.outputs import Logprob
from inference_engine.sampler import top_logprobs
from inference_engine.scheduler import SchedulerOutput
from inference_engine.sequence import Sequence
from inference_engine.step_inputs import PreparedStep, StepInputs
from llmserve_kernels.cpu import linear as cpu_linear
from llmserve_kernels.cpu.huge_pages import zeros_on_huge_pages

if TYPE_CHECKING:  # tp_workers imports this module to run a rank's steps
    from inference_engine.tp_workers import TPWorkers

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(config: EngineConfig) -> torch.device:
    kind = config.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda" and config.tensor_parallel_size > 1:
        return torch.device("cuda", distributed.local_rank())
    return torch.device(kind)


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if _cpu_has_fast_bf16() else torch.float32


def _cpu_has_fast_bf16() -> bool:
    """bf16 halves the bytes a decode step reads and lets a step of a few tokens run in one native call
    (kernels/cpu/decoder.py); it pays where our linear kernels run vector code for it (AVX512-BF16 or
    AVX2), or where the CPU has bf16 dot products for oneDNN."""
    if cpu_linear.native_bf16():
        return True
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def keep_freed_memory_for_reuse() -> bool:
    """Stops glibc from handing each step's large temporaries back to the kernel as they are freed.

    By default glibc serves blocks over ~128 KiB with fresh mmaps and trims freed heap tops, so every
    prefill step pays page faults on tens of MB of activations again: measured here, a bf16 RMSNorm on
    2048 tokens took 4.1 ms instead of 0.4 ms. Raising the mmap threshold to glibc's maximum (32 MiB)
    and the trim threshold to 1 GiB keeps that memory in the process for the next step, which is what
    vLLM's CPU guide gets by preloading tcmalloc. Returns False where the C library is not glibc.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 32 << 20) and libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):
        return False


def resolve_attention_backend(config: EngineConfig, device: torch.device) -> str:
    if config.attention_backend != "auto":
        return config.attention_backend
    return "triton" if device.type == "cuda" else "torch"


@dataclass
class StepPlan:
    """What every rank needs for one step: cache copies, the prepared batch, the prompt-logprob rows."""

    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    block_copies: list[tuple[int, int]]
    step: PreparedStep
    prompt_rows: list[int]

    def for_other_ranks(self) -> StepPlan:
        """A copy to broadcast: tensors cut out of the persistent buffers (a view would pickle the
        whole buffer), on the host."""
        step, meta = self.step, self.step.meta

        def cut(t: torch.Tensor) -> torch.Tensor:
            return t.cpu().clone()

        meta = replace(
            meta,
            slot_mapping=cut(meta.slot_mapping),
            query_start_loc=cut(meta.query_start_loc),
            seq_lens=cut(meta.seq_lens),
            block_tables=cut(meta.block_tables),
        )
        step = PreparedStep(cut(step.input_ids), cut(step.positions), meta, step.sample_rows, [])
        return replace(self, step=step)

    def to(self, device: torch.device) -> StepPlan:
        """This plan with its tensors on `device` (a receiving rank's)."""
        if device.type == "cpu":
            return self
        step, meta = self.step, self.step.meta
        moved = {
            f: getattr(meta, f).to(device)
            for f in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")
        }
        step = PreparedStep(
            step.input_ids.to(device), step.positions.to(device), replace(meta, **moved), step.sample_rows, []
        )
        return replace(self, step=step)


@dataclass
class StepOutput:
    sample_seqs: list[Sequence]  # sequences whose next token must be sampled, in row order
    logits: torch.Tensor  # [len(sample_seqs), vocab], fp32 on the model's device
    prompt_logprobs: dict[Sequence, list[dict[int, Logprob]]]  # for this step's prompt positions


class ModelRunner:
    """Owns the model shard and the KV cache of one rank. Rank 0's runner also prepares each step and,
    with tensor parallelism, hands it to the other ranks (`workers`) before running its own part."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, workers: TPWorkers | None = None) -> None:
        self.config = config
        self.model_config = loaded.config
        self.workers = workers
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, self.device)
        self.attention_backend = resolve_attention_backend(config, self.device)
        self.block_size = config.block_size
        if self.device.type == "cpu":
            keep_freed_memory_for_reuse()
        else:  # what this process held before this engine: another engine's weights and cache are not ours
            self._allocated_before = torch.cuda.memory_allocated(self.device)
        model_cls = MODEL_CLASSES[loaded.config.architecture]
        torch.manual_seed(config.seed)
        # Built under the target default dtype (not cast afterwards) so fp32 buffers like RoPE's stay fp32.
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            size = config.tensor_parallel_size
            rank = torch.distributed.get_rank() if size > 1 else 0
            with torch.device(self.device), distributed.building(rank, size):
                self.model = model_cls(loaded.config, get_backend(self.attention_backend))
        finally:
            torch.set_default_dtype(default_dtype)
        self.model.load_weights(loaded.weights)
        self.model.eval()
        self.model.finalize(quantize_int8=config.quantization == "int8")
        if self.device.type == "cpu":
            linears = [p for m in self.model.modules() if isinstance(m, LinearBase) for p in m.packed]
            if timings := cpu_linear.time_quant_prefetch(linears):
                logger.info(
                    "quantized kernel prefetches %d bytes ahead (one row through the model's quantized "
                    "weights: %s)",
                    min(timings, key=timings.__getitem__),
                    ", ".join(f"{d} B {s * 1e3:.2f} ms" for d, s in timings.items()),
                )
        self.num_blocks = self._num_kv_blocks()
        # CUDA graphs pad a decode batch to a captured size; padding rows write to one reserved block.
        self.use_graphs = self.device.type == "cuda" and not config.enforce_eager
        mc = self.model_config
        kv_shape = (
            2,
            mc.num_hidden_layers,
            self.num_blocks + self.use_graphs,
            self.block_size,
            self.model.model.layers[0].self_attn.num_kv_heads,
            mc.head_dim,
        )
        if self.device.type == "cpu":  # attention reads its blocks from anywhere in it: see huge_pages
            self.kv_cache = zeros_on_huge_pages(kv_shape, self.dtype)
        else:
            self.kv_cache = torch.zeros(kv_shape, dtype=self.dtype, device=self.device)
        self._bind_cache(self.kv_cache)
        if self.attention_backend == "torch" and self.device.type == "cpu":
            # Which attention path prompt chunks take is timed now, not in the first long prompt's step.
            attn, threads = self.model.model.layers[0].self_attn, torch.get_num_threads()
            native_query_max(attn.num_heads, attn.num_kv_heads, attn.head_dim, self.dtype, threads)
            self.model.use_native_decoder()
        max_blocks = min(-(-loaded.config.max_position_embeddings // self.block_size), self.num_blocks)
        self.inputs = StepInputs(
            max(config.max_num_batched_tokens, config.max_num_seqs),
            config.max_num_seqs,
            max_blocks,
            self.block_size,
            self.device,
        )
        self.graphs = self._capture_graphs(max_blocks) if self.use_graphs else None
        # Swap space: host memory that holds preempted sequences' KV blocks, a block contiguous (pinned on
        # CUDA, so each block's copy runs without blocking).
        self.num_cpu_blocks = int(config.swap_space * 2**30) // self.kv_bytes_per_block
        self.cpu_kv_cache = torch.zeros(
            (self.num_cpu_blocks, *self.kv_cache.shape[:2], *self.kv_cache.shape[3:]),
            dtype=self.dtype,
            pin_memory=self.device.type == "cuda" and self.num_cpu_blocks > 0,
        )

    def _bind_cache(self, kv_cache: torch.Tensor) -> None:
        for i, layer in enumerate(self.model.model.layers):
            layer.self_attn.k_cache, layer.self_attn.v_cache = kv_cache[0, i], kv_cache[1, i]

    def _capture_graphs(self, max_blocks: int) -> GraphRunner:
        from llmserve_kernels.triton import choose_num_splits, sm_count

        kv_heads, sms = self.model.model.layers[0].self_attn.num_kv_heads, sm_count(self.device)
        context = max_blocks * self.block_size
        return GraphRunner(
            self.model,
            self.config.max_num_seqs,
            max_blocks,
            pad_block=self.num_blocks,
            block_size=self.block_size,
            num_splits=lambda batch: choose_num_splits(batch, kv_heads, context, sms),
            device=self.device,
        )

    @property
    def kv_bytes_per_block(self) -> int:
        mc = self.model_config
        kv_heads = self.model.model.layers[0].self_attn.num_kv_heads
        return 2 * mc.num_hidden_layers * self.block_size * kv_heads * mc.head_dim * self.dtype.itemsize

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes

    def _num_kv_blocks(self) -> int:
        budget = self.config.kv_cache_memory_bytes
        if budget is None and self.device.type == "cuda":
            budget = self._cuda_kv_budget()
        elif budget is None:
            budget = DEFAULT_CPU_KV_BYTES
        num_blocks = torch.tensor(budget // self.kv_bytes_per_block, device=self.device)
        if self.config.tensor_parallel_size > 1:  # every rank holds the same blocks: the smallest count wins
            torch.distributed.all_reduce(num_blocks, op=torch.distributed.ReduceOp.MIN)
        num_blocks = int(num_blocks)
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget ({budget} bytes) holds no block of {self.kv_bytes_per_block} bytes."
            )
        return int(num_blocks)

    def execute(self, sched: SchedulerOutput) -> StepOutput:
        """Rank 0: runs one scheduled step (on every rank) and returns what the sampler needs."""
        step = self.inputs.prepare(sched)
        prompt_rows, prompt_targets = self._prompt_rows(sched, step)
        plan = StepPlan(sched.swap_out, sched.swap_in, sched.block_copies, step, prompt_rows)
        if self.workers is not None:
            self.workers.send(plan.for_other_ranks())
        logits, prompt_logits = self.run(plan)
        prompt_logprobs = {}
        for seq, (lo, hi, first, k) in prompt_targets.items():
            logprobs = torch.log_softmax(prompt_logits[lo:hi].float(), -1).cpu()
            prompt_logprobs[seq] = [
                top_logprobs(logprobs[i], seq.token_ids[first + i + 1], k) for i in range(hi - lo)
            ]
        return StepOutput(step.sample_seqs, logits, prompt_logprobs)

    @property
    def burst_rows(self) -> int:
        """Sequences `execute_burst` takes at once: 0 where it cannot run (tensor parallelism, a GPU, a model
        off the native decoder)."""
        return self.model.generate_rows if self.workers is None and self.device.type == "cpu" else 0

    @torch.inference_mode()
    def execute_burst(
        self, sched: SchedulerOutput, sampling: tuple[torch.Tensor, ...] | None = None
    ) -> list[list[int]]:
        """Decode steps of every scheduled sequence in one native call, as many as the fewest tokens
        scheduled for one of them (its newest token, then placeholders that reserved the burst's slots);
        each sequence's tokens, the ones `execute` and the sampler would give step by step. `sampling`:
        `Sampler.burst_parameters`."""
        step = self.inputs.prepare(sched)
        steps = min(sched.num_new_tokens)
        first = step.meta.query_start_loc[:-1].long()
        rows = first + torch.arange(steps)[:, None]  # [steps, batch]: each step's token of each sequence
        positions = step.positions[rows]
        tokens = self.model.generate(
            step.input_ids[first],
            positions,
            step.meta.slot_mapping[rows],
            step.meta.block_tables,
            positions + 1,
            sampling,
        )
        return tokens.t().tolist()

    def _cuda_kv_budget(self) -> int:
        """gpu_memory_utilization is this engine's share of the device, as in vLLM: its cache gets that
        share less what the engine itself holds at its peak (weights, activations), whatever else the
        process holds, and never more than is free once the next step's activations are set aside."""
        peak, activations = self._profile_peak_memory()
        free, total = torch.cuda.mem_get_info(self.device)
        share = int(total * self.config.gpu_memory_utilization) - (peak - self._allocated_before)
        if free - activations < share:
            logger.warning(
                "gpu_memory_utilization=%.2f leaves %.2f GiB for the KV cache on %s, but only %.2f GiB are "
                "free (other processes or engines hold the rest): the cache takes what is free",
                self.config.gpu_memory_utilization,
                share / 2**30,
                self.device,
                (free - activations) / 2**30,
            )
        return min(share, free - activations)

    @torch.inference_mode()
    def _profile_peak_memory(self) -> tuple[int, int]:
        """Peak bytes this process allocates on the GPU through the largest step the scheduler can build,
        and how many of them the step itself took: a forward over max_num_batched_tokens prompt tokens
        (over a scratch KV cache) with the logits of every row, as a chunk asking for prompt logprobs has
        (vLLM sizes its cache the same way)."""
        config, mc, bs = self.config, self.model_config, self.block_size
        tokens = config.max_num_batched_tokens
        seqs = min(config.max_num_seqs, tokens)
        per_seq = -(-tokens // seqs)
        blocks = -(-per_seq // bs)
        kv_heads = self.model.model.layers[0].self_attn.num_kv_heads
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        with torch.device(self.device):
            scratch = torch.zeros(
                2, mc.num_hidden_layers, seqs * blocks, bs, kv_heads, mc.head_dim, dtype=self.dtype
            )
            self._bind_cache(scratch)
            lens = torch.full((seqs,), per_seq, dtype=torch.int32)
            lens[-1] = tokens - per_seq * (seqs - 1)
            starts = torch.zeros(seqs + 1, dtype=torch.int32)
            starts[1:] = lens.cumsum(0)
            tables = torch.arange(seqs * blocks, dtype=torch.int32).view(seqs, blocks)
            rows = torch.repeat_interleave(torch.arange(seqs), lens)
            positions = torch.arange(tokens) - starts[:-1].long().repeat_interleave(lens)
            slots = tables[rows, positions // bs].long() * bs + positions % bs
            meta = AttentionMetadata(
                slots, starts, lens, tables, lens.tolist(), [0] * seqs, int(lens.max()), int(lens.max())
            )
            hidden = self.model(torch.zeros(tokens, dtype=torch.long), positions, meta)
            self.model.compute_logits(hidden).float()
        del scratch, hidden
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        return peak, peak - before

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Every rank: the cache copies, the forward pass and the logits of the sampled and prompt rows
        (rank 0 gets them, on its device, the others None)."""
        # Swap-outs first: their device blocks may be handed to other sequences in this very step.
        for device_block, cpu_block in plan.swap_out:
            self.cpu_kv_cache[cpu_block].copy_(self.kv_cache[:, :, device_block], non_blocking=True)
        for cpu_block, device_block in plan.swap_in:
            self.kv_cache[:, :, device_block].copy_(self.cpu_kv_cache[cpu_block], non_blocking=True)
        if plan.swap_out and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the host copies are read by later swap-ins
        if plan.block_copies:
            src, dst = zip(*plan.block_copies, strict=True)
            self.kv_cache[:, :, list(dst)] = self.kv_cache[:, :, list(src)]
        step = plan.step
        size = self.graphs.size_for(step) if self.graphs is not None else None
        if size is not None:
            hidden = self.graphs.run(step, size)
        else:
            hidden = self.model(step.input_ids, step.positions, step.meta)
        # Sampled rows are distinct and in order, so as many as the step has rows are all of them (a decode).
        sampled = hidden if len(step.sample_rows) == len(hidden) else hidden[step.sample_rows]
        logits = self.model.compute_logits(sampled)
        # fp32 for the sampler (also where all rows are greedy: argmax over bf16 is 5x slower here), on the
        # model's device: the sampler brings back only token ids.
        logits = None if logits is None else logits.float()
        prompt_logits = self.model.compute_logits(hidden[plan.prompt_rows]) if plan.prompt_rows else None
        return logits, prompt_logits

    def _prompt_rows(self, sched: SchedulerOutput, step: PreparedStep):
        """Rows whose logits score the next prompt token, for requests that asked for prompt logprobs:
        the rows, and per sequence (first, last + 1 of its rows, its first position, k)."""
        rows, targets = [], {}
        for b, seq in enumerate(sched.seqs):
            k = seq.params.prompt_logprobs
            start = step.meta.context_lens[b]
            if k is None or start >= seq.num_prompt_tokens - 1:
                continue
            end = min(start + step.meta.query_lens[b], seq.num_prompt_tokens - 1)
            row0 = int(step.meta.query_start_loc[b])
            targets[seq] = (len(rows), len(rows) + end - start, start, k)
            rows += range(row0, row0 + end - start)
        return rows, targets

    def release(self, seq: Sequence) -> None:
        """Forgets a finished or aborted sequence."""
        self.inputs.release(seq)
