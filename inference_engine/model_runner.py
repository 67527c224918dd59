"""Runs the model on one scheduled step.

The step's sequences are flattened into one batch of tokens (ids, positions, cache slots) with the
per-sequence block tables and lengths the attention backend needs; the runner owns the model, the
paged KV cache and its sizing from a memory budget.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from dataclasses import dataclass

import torch

from inference_engine.attention import AttentionMetadata, get_backend
from inference_engine.attention.torch_backend import native_query_max
from inference_engine.config import EngineConfig
from inference_engine.model_loader import LoadedModel
from inference_engine.models import MODEL_CLASSES
from inference_engine.outputs import Logprob
from inference_engine.sampler import top_logprobs
from inference_engine.scheduler import SchedulerOutput
from inference_engine.sequence import Sequence

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if _cpu_has_fast_bf16() else torch.float32


def _cpu_has_fast_bf16() -> bool:
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
class StepOutput:
    sample_seqs: list[Sequence]  # sequences whose next token must be sampled, in row order
    logits: torch.Tensor  # [len(sample_seqs), vocab], fp32 on the model's device
    prompt_logprobs: dict[Sequence, list[dict[int, Logprob]]]  # for this step's prompt positions


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        self.config = config
        self.model_config = loaded.config
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, self.device)
        self.attention_backend = resolve_attention_backend(config, self.device)
        self.block_size = config.block_size
        if self.device.type == "cpu":
            keep_freed_memory_for_reuse()
        model_cls = MODEL_CLASSES[loaded.config.architecture]
        torch.manual_seed(config.seed)
        # Built under the target default dtype (not cast afterwards) so fp32 buffers like RoPE's stay fp32.
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = model_cls(loaded.config, get_backend(self.attention_backend))
        finally:
            torch.set_default_dtype(default_dtype)
        self.model.load_weights(loaded.weights)
        self.model.eval()
        self.model.finalize(quantize_int8=config.quantization == "int8")
        self.num_blocks = self._num_kv_blocks()
        mc = self.model_config
        self.kv_cache = torch.zeros(
            2,
            mc.num_hidden_layers,
            self.num_blocks,
            self.block_size,
            self.model.model.layers[0].self_attn.num_kv_heads,
            mc.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        for i, layer in enumerate(self.model.model.layers):
            layer.self_attn.k_cache, layer.self_attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        if self.attention_backend == "torch" and self.device.type == "cpu":
            # Which attention path prompt chunks take is timed now, not in the first long prompt's step.
            attn, threads = self.model.model.layers[0].self_attn, torch.get_num_threads()
            native_query_max(attn.num_heads, attn.num_kv_heads, attn.head_dim, self.dtype, threads)
        # Swap space: host memory that holds preempted sequences' KV blocks (pinned for fast copies on CUDA).
        self.num_cpu_blocks = int(config.swap_space * 2**30) // self.kv_bytes_per_block
        self.cpu_kv_cache = torch.zeros(
            (*self.kv_cache.shape[:2], self.num_cpu_blocks, *self.kv_cache.shape[3:]),
            dtype=self.dtype,
            pin_memory=self.device.type == "cuda" and self.num_cpu_blocks > 0,
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
            free, total = torch.cuda.mem_get_info(self.device)
            # Room for one full-budget step's activations and logits besides the weights already loaded.
            activations = (
                self.config.max_num_batched_tokens
                * (self.model_config.vocab_size + 8 * self.model_config.intermediate_size)
                * 4
            )
            budget = int(total * self.config.gpu_memory_utilization) - (total - free) - activations
        elif budget is None:
            budget = DEFAULT_CPU_KV_BYTES
        num_blocks = budget // self.kv_bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget ({budget} bytes) holds no block of {self.kv_bytes_per_block} bytes."
            )
        return int(num_blocks)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepOutput:
        # Swap-outs first: their device blocks may be handed to other sequences in this very step.
        for pairs, src_cache, dst_cache in (
            (sched.swap_out, self.kv_cache, self.cpu_kv_cache),
            (sched.swap_in, self.cpu_kv_cache, self.kv_cache),
            (sched.block_copies, self.kv_cache, self.kv_cache),
        ):
            if pairs:
                src, dst = zip(*pairs, strict=True)
                dst_cache[:, :, list(dst)] = src_cache[:, :, list(src)].to(dst_cache.device)
        input_ids, positions, meta, sample_rows, sample_seqs = self._prepare(sched)
        hidden = self.model(input_ids, positions, meta)
        # fp32 for the sampler (also where all rows are greedy: argmax over bf16 is 5x slower here), on the
        # model's device: the sampler brings back only token ids.
        logits = self.model.compute_logits(hidden[sample_rows]).float()
        prompt_logprobs = self._prompt_logprobs(sched, hidden, meta)
        return StepOutput(sample_seqs, logits, prompt_logprobs)

    def _prepare(self, sched: SchedulerOutput):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc, seq_lens, context_lens, sample_rows, sample_seqs = [0], [], [], [], []
        for seq, n in zip(sched.seqs, sched.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            input_ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(start + n)
            context_lens.append(start)
            if start + n == len(seq):  # this chunk reaches the newest token: sample the next one
                sample_rows.append(query_start_loc[-1] - 1)
                sample_seqs.append(seq)
        max_blocks = max(len(seq.block_table) for seq in sched.seqs)
        tables = [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in sched.seqs]

        def tensor(data, dtype=torch.int32):
            return torch.tensor(data, dtype=dtype, device=self.device)

        meta = AttentionMetadata(
            slot_mapping=tensor(slots, torch.long),
            query_start_loc=tensor(query_start_loc),
            seq_lens=tensor(seq_lens),
            block_tables=tensor(tables),
            query_lens=list(sched.num_new_tokens),
            context_lens=context_lens,
            max_query_len=max(sched.num_new_tokens),
            max_seq_len=max(seq_lens),
        )
        return tensor(input_ids, torch.long), tensor(positions, torch.long), meta, sample_rows, sample_seqs

    def _prompt_logprobs(self, sched: SchedulerOutput, hidden: torch.Tensor, meta: AttentionMetadata):
        """Logprob of each prompt token given the ones before it, for requests that asked."""
        result = {}
        for b, seq in enumerate(sched.seqs):
            k = seq.params.prompt_logprobs
            start = meta.context_lens[b]
            if k is None or start >= seq.num_prompt_tokens - 1:
                continue
            end = min(start + meta.query_lens[b], seq.num_prompt_tokens - 1)
            row0 = int(meta.query_start_loc[b])
            logprobs = torch.log_softmax(
                self.model.compute_logits(hidden[row0 : row0 + end - start]).float(), -1
            )
            result[seq] = [
                top_logprobs(logprobs[i].cpu(), seq.token_ids[start + i + 1], k) for i in range(end - start)
            ]
        return result
