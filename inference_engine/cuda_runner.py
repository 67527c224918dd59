"""The model runner on CUDA: the shared runner plus the KV budget measured from the device's memory, CUDA
graphs for decode steps and swap space in pinned host memory.
"""

from __future__ import annotations

import logging

import torch

from inference_engine.attention import AttentionMetadata
from inference_engine.cuda_graphs import GraphRunner
from inference_engine.model_runner import ModelRunner
from inference_engine.step_inputs import PreparedStep

logger = logging.getLogger(__name__)


class CUDARunner(ModelRunner):
    pin_swap_space = True  # so that each block's copy runs without blocking

    graphs: GraphRunner | None = None

    def _on_start(self) -> None:
        # What this process held before this engine: another engine's weights and cache are not ours.
        self._allocated_before = torch.cuda.memory_allocated(self.device)
        # CUDA graphs pad a decode batch to a captured size; padding rows write to one reserved block.
        self.use_graphs = not self.config.enforce_eager
        self.spare_blocks = int(self.use_graphs)

    def _on_cache_bound(self, max_blocks: int) -> None:
        if self.use_graphs:
            self.graphs = self._capture_graphs(max_blocks)

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

    def _on_swapped_out(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def _on_tier_copied(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def _forward(self, step: PreparedStep) -> torch.Tensor:
        # Graphs were captured without adapters: a step with any LoRA adapter runs eagerly.
        lora_step = self.lora is not None and self.lora.batch.slots is not None
        if self.graphs is not None and not lora_step and (size := self.graphs.size_for(step)) is not None:
            return self.graphs.run(step, size)
        return self.model(step.input_ids, step.positions, step.meta)

    def _kv_budget(self) -> int:
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
