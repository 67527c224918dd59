"""The model runner on the CPU: the shared runner plus what a CPU step needs to be fast.

At start-up it keeps freed memory in the process for the next step, puts the KV cache on huge pages,
times the per-CPU choices (how far the quantized kernel prefetches, which attention path prompt chunks
take) once rather than in the first requests' steps, and moves the model onto the native decoder, which
also lets several decode steps run in one native call (`execute_burst`).
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

from inference_engine.attention.torch_backend import native_query_max
from inference_engine.layers.linear import LinearBase
from inference_engine.model_runner import ModelRunner
from inference_engine.scheduler import SchedulerOutput
from inference_engine.step_inputs import PreparedStep
from llmserve_kernels.cpu import linear as cpu_linear
from llmserve_kernels.cpu.huge_pages import zeros_on_huge_pages

logger = logging.getLogger(__name__)


def keep_freed_memory_for_reuse() -> bool:
    """Stops glibc from handing each step's large temporaries back to the kernel as they are freed.

    By default glibc serves blocks over ~128 KiB with fresh mmaps and trims freed heap tops, so every
    prefill step pays page faults on tens of MB of activations again, several times the work of a
    memory-bound op (benchmarks/results/kernel-and-runner-timings.md). Raising the mmap threshold to glibc's
    maximum (32 MiB) and the trim threshold to 1 GiB keeps that memory in the process for the next step,
    which is what vLLM's CPU guide gets by preloading tcmalloc. Returns False where the C library is not
    glibc.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 32 << 20) and libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):
        return False


class CPURunner(ModelRunner):
    def _on_start(self) -> None:
        keep_freed_memory_for_reuse()

    def _on_model_loaded(self) -> None:
        linears = [p for m in self.model.modules() if isinstance(m, LinearBase) for p in m.packed]
        if timings := cpu_linear.time_quant_prefetch(linears):
            logger.info(
                "quantized kernel prefetches %d bytes ahead (one row through the model's quantized "
                "weights: %s)",
                min(timings, key=timings.__getitem__),
                ", ".join(f"{d} B {s * 1e3:.2f} ms" for d, s in timings.items()),
            )

    def _new_kv_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        # Attention reads its blocks from anywhere in the cache: see huge_pages.
        return zeros_on_huge_pages(shape, self.dtype)

    def _on_cache_bound(self, max_blocks: int) -> None:
        if self.attention_backend != "torch":
            return
        # Which attention path prompt chunks take is timed now, not in the first long prompt's step.
        attn, threads = self.model.model.layers[0].self_attn, torch.get_num_threads()
        native_query_max(attn.num_heads, attn.num_kv_heads, attn.head_dim, self.dtype, threads)
        self.model.use_native_decoder()

    def _forward(self, step: PreparedStep) -> torch.Tensor:
        """A step with any LoRA adapter runs layer by layer: the native decoder does not know adapters."""
        native = self.model.model.native
        if native is None or self.lora is None or self.lora.batch.slots is None:
            return super()._forward(step)
        self.model.model.native = None
        try:
            return super()._forward(step)
        finally:
            self.model.model.native = native

    @property
    def burst_rows(self) -> int:
        """Sequences `execute_burst` takes at once: 0 where it cannot run (tensor parallelism, a model off the
        native decoder)."""
        return self.model.generate_rows if self.workers is None else 0

    @torch.inference_mode()
    def execute_burst(
        self, sched: SchedulerOutput, sampling: tuple[torch.Tensor, ...] | None = None
    ) -> list[list[int]]:
        """The burst's `sched.num_steps` decode steps of every scheduled sequence in one native call (each
        sequence's newest token, then the slots reserved for the later steps); each sequence's tokens, the
        ones `execute` and the sampler would give step by step. `sampling`: `Sampler.burst_parameters`."""
        self.copy_tier_blocks(sched.kv_store, sched.kv_restore)
        step = self.inputs.prepare(sched)
        steps = sched.num_steps
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
