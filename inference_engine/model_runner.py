"""Runs the model on one scheduled step: the shared base of the CPU and CUDA runners.

The step's sequences are flattened into one batch of tokens (ids, positions, cache slots) with the
per-sequence block tables and lengths the attention backend needs; the runner owns the model, the
paged KV cache and its sizing from a memory budget. What only one kind of device does (allocator and
kernel tuning and multi-step decoding on the CPU: cpu_runner.py; memory profiling, CUDA graphs and pinned
swap space on CUDA: cuda_runner.py) sits in the hooks those runners override; `runners.make_runner` picks one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from inference_engine import distributed
from inference_engine.attention import get_backend
from inference_engine.config import EngineConfig
from inference_engine.kv_offload import BlockCopy, restore_blocks, store_blocks, tier_gib
from inference_engine.lora.slots import LoRAManager
from inference_engine.model_loader import LoadedModel
from inference_engine.models import MODEL_CLASSES
from inference_engine.outputs import Logprob
from inference_engine.pooling import pool_rows, split_pooling
from inference_engine.sampler import top_logprobs
from inference_engine.scheduler import SchedulerOutput
from inference_engine.sequence import Sequence
from inference_engine.step_inputs import PreparedStep, StepInputs
from llmserve_kernels.cpu import linear as cpu_linear

if TYPE_CHECKING:  # tp_workers imports this module to run a rank's steps
    from inference_engine.tp_workers import TPWorkers

DEFAULT_KV_BYTES = 1 << 30  # the KV budget where the config sets none and the device is not measured
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
    pool_spans: list[tuple[int, int]] = field(default_factory=list)  # hidden rows pooling sequences read
    kv_store: list[BlockCopy] = field(default_factory=list)  # the prefix cache's second tier (kv_offload)
    kv_restore: list[BlockCopy] = field(default_factory=list)

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
    # Pooling sequences: (sequence, its chunk's first position, the fp32 sum of the hidden rows it reads)
    pooled: list[tuple[Sequence, int, torch.Tensor]] = field(default_factory=list)


class ModelRunner:
    """Owns the model shard and the KV cache of one rank. Rank 0's runner also prepares each step and,
    with tensor parallelism, hands it to the other ranks (`workers`) before running its own part.

    Runs the model on any device as it is; `CPURunner` and `CUDARunner` override the hooks (the methods
    named `_on_*`, `_kv_budget`, `_new_kv_cache`, `_forward`) with what their device adds."""

    spare_blocks = 0  # KV blocks allocated beyond the scheduler's, for the device's own use
    pin_swap_space = False  # whether the host's swap blocks are pinned for asynchronous copies

    def __init__(self, config: EngineConfig, loaded: LoadedModel, workers: TPWorkers | None = None) -> None:
        self.config = config
        self.model_config = loaded.config
        self.workers = workers
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, self.device)
        self.attention_backend = resolve_attention_backend(config, self.device)
        self.block_size = config.block_size
        self._on_start()
        self.model = self._build_model(loaded)
        self.lora = self._lora_manager() if config.enable_lora else None
        self._on_model_loaded()
        self.num_blocks = self._num_kv_blocks()
        mc = self.model_config
        kv_shape = (
            2,
            mc.num_hidden_layers,
            self.num_blocks + self.spare_blocks,
            self.block_size,
            self.model.model.layers[0].self_attn.num_kv_heads,
            mc.head_dim,
        )
        self.kv_cache = self._new_kv_cache(kv_shape)
        self._bind_cache(self.kv_cache)
        max_blocks = min(-(-loaded.config.max_position_embeddings // self.block_size), self.num_blocks)
        self.inputs = StepInputs(
            max(config.max_num_batched_tokens, config.max_num_seqs),
            config.max_num_seqs,
            max_blocks,
            self.block_size,
            self.device,
        )
        self._on_cache_bound(max_blocks)
        # Swap space: host memory that holds preempted sequences' KV blocks, a block contiguous.
        self.num_cpu_blocks = int(config.swap_space * 2**30) // self.kv_bytes_per_block
        self.cpu_kv_cache = torch.zeros(
            (self.num_cpu_blocks, *self.kv_cache.shape[:2], *self.kv_cache.shape[3:]),
            dtype=self.dtype,
            pin_memory=self.pin_swap_space and self.num_cpu_blocks > 0,
        )
        # The prefix cache's second tier (kv_offload): host memory for blocks the device pool evicts.
        gib = tier_gib(config.kv_offload_gib, self.device)
        tier_bytes = int(gib * 2**30) if config.enable_prefix_caching else 0
        self.num_offload_blocks = tier_bytes // self.kv_bytes_per_block
        self.offload_kv_cache = torch.zeros(
            (self.num_offload_blocks, *self.cpu_kv_cache.shape[1:]),
            dtype=self.dtype,
            pin_memory=self.pin_swap_space and self.num_offload_blocks > 0,
        )
        self.offload_store_seconds = self.offload_restore_seconds = 0.0  # for stats

    def _build_model(self, loaded: LoadedModel) -> torch.nn.Module:
        model_cls = MODEL_CLASSES[loaded.config.architecture]
        torch.manual_seed(self.config.seed)
        # Built under the target default dtype (not cast afterwards) so fp32 buffers like RoPE's stay fp32.
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            size = self.config.tensor_parallel_size
            rank = torch.distributed.get_rank() if size > 1 else 0
            with torch.device(self.device), distributed.building(rank, size):
                model = model_cls(loaded.config, get_backend(self.attention_backend))
        finally:
            torch.set_default_dtype(default_dtype)
        model.load_weights(loaded.weights)
        model.eval()
        model.finalize(quantize_int8=self.config.quantization == "int8")
        return model

    def _lora_manager(self) -> LoRAManager:
        """The adapters' slots beside the model's linear layers (inference_engine/lora)."""
        c = self.config
        return LoRAManager(self.model, c.max_loras, c.max_lora_rank, c.max_cpu_loras or c.max_loras)

    # Hooks: each device's runner overrides those it needs.

    def _on_start(self) -> None:
        """Before the model is built."""

    def _on_model_loaded(self) -> None:
        """With the model's weights loaded and packed, before the KV cache is sized."""

    def _kv_budget(self) -> int:
        """Bytes for the KV cache where the config sets no budget."""
        return DEFAULT_KV_BYTES

    def _new_kv_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _on_cache_bound(self, max_blocks: int) -> None:
        """With the KV cache bound to the model's layers (`max_blocks`: the most blocks a sequence holds)."""

    def _on_swapped_out(self) -> None:
        """After a step that swapped blocks out issued its copies: later swap-ins read those host blocks."""

    def _on_tier_copied(self) -> None:
        """After the second tier's copies of a step were issued: where they run asynchronously, wait for them
        (their time is reported)."""

    def _forward(self, step: PreparedStep) -> torch.Tensor:
        """The hidden states of every row of the step."""
        return self.model(step.input_ids, step.positions, step.meta)

    # The rest is the same on every device.

    def _bind_cache(self, kv_cache: torch.Tensor) -> None:
        for i, layer in enumerate(self.model.model.layers):
            layer.self_attn.k_cache, layer.self_attn.v_cache = kv_cache[0, i], kv_cache[1, i]

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
        if budget is None:
            budget = self._kv_budget()
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
        pooling = split_pooling(sched.seqs, step)
        prompt_rows, prompt_targets = self._prompt_rows(sched, step)
        plan = StepPlan(sched.swap_out, sched.swap_in, sched.block_copies, step, prompt_rows)
        plan.pool_spans = [rows for _, _, rows in pooling]
        plan.kv_store, plan.kv_restore = sched.kv_store, sched.kv_restore
        if self.workers is not None:
            self.workers.send(plan.for_other_ranks())
        if self.lora is not None:  # each row's adapter slot, for the linear layers
            self.lora.set_step([seq.group.lora_request for seq in sched.seqs], list(sched.num_new_tokens))
        try:
            logits, prompt_logits, pooled = self.run(plan)
        finally:
            if self.lora is not None:
                self.lora.clear_step()
        prompt_logprobs = {}
        for seq, (lo, hi, first, k) in prompt_targets.items():
            logprobs = torch.log_softmax(prompt_logits[lo:hi].float(), -1).cpu()
            prompt_logprobs[seq] = [
                top_logprobs(logprobs[i], seq.token_ids[first + i + 1], k) for i in range(hi - lo)
            ]
        parts = pooled.cpu() if pooled is not None else []
        pooled = [(seq, start, part) for (seq, start, _), part in zip(pooling, parts, strict=True)]
        return StepOutput(step.sample_seqs, logits, prompt_logprobs, pooled)

    @property
    def burst_rows(self) -> int:
        """Sequences `execute_burst` takes at once (0: it cannot run here; only the CPU runner has it)."""
        return 0

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Every rank: the cache copies, the forward pass and the logits of the sampled and prompt rows
        (rank 0 gets them, on its device, the others None), and the pooled hidden rows (`pool_rows`)."""
        # Swap-outs first: their device blocks may be handed to other sequences in this very step.
        for device_block, cpu_block in plan.swap_out:
            self.cpu_kv_cache[cpu_block].copy_(self.kv_cache[:, :, device_block], non_blocking=True)
        self.copy_tier_blocks(plan.kv_store, plan.kv_restore)
        for cpu_block, device_block in plan.swap_in:
            self.kv_cache[:, :, device_block].copy_(self.cpu_kv_cache[cpu_block], non_blocking=True)
        if plan.swap_out:
            self._on_swapped_out()
        if plan.block_copies:
            src, dst = zip(*plan.block_copies, strict=True)
            self.kv_cache[:, :, list(dst)] = self.kv_cache[:, :, list(src)]
        step = plan.step
        hidden = self._forward(step)
        # Sampled rows are distinct and in order, so as many as the step has rows are all of them (a decode).
        sampled = hidden if len(step.sample_rows) == len(hidden) else hidden[step.sample_rows]
        logits = self.model.compute_logits(sampled) if step.sample_rows else None
        # fp32 for the sampler (also where all rows are greedy: argmax over bf16 is the slower one on a CPU,
        # see benchmarks/results/kernel-and-runner-timings.md), on the model's device: the sampler brings
        # back only token ids.
        logits = None if logits is None else logits.float()
        prompt_logits = self.model.compute_logits(hidden[plan.prompt_rows]) if plan.prompt_rows else None
        pooled = pool_rows(hidden, plan.pool_spans) if plan.pool_spans else None
        return logits, prompt_logits, pooled

    def copy_tier_blocks(self, stores: list[BlockCopy], restores: list[BlockCopy]) -> None:
        """The second tier's copies of a step (`kv_offload`): blocks the device pool evicts into their slots
        first (a block may be reused by this very step), then slots back into the blocks restored."""
        for copies, copy, counter in (
            (stores, store_blocks, "offload_store_seconds"),
            (restores, restore_blocks, "offload_restore_seconds"),
        ):
            if copies:
                start = time.perf_counter()
                copy(self.kv_cache, self.offload_kv_cache, copies)
                self._on_tier_copied()
                setattr(self, counter, getattr(self, counter) + time.perf_counter() - start)

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
