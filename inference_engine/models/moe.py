"""The sparse mixture-of-experts MLP and the decoder layer and model that carry it, over the Llama layers.

Each token's router logits pick its top-k experts (`route`, as transformers computes it per family); the
experts, stacked into [E, 2I, H] (gate rows, then up rows) and [E, H, I] tensors at load, run in one fused
kernel over the whole step: `llmserve_kernels.cpu.moe` on the CPU, `llmserve_kernels.triton.fused_moe` on
CUDA, `fused_moe_ref` where neither can run. The native whole-decoder path is dense-only, so these models
run layer by layer.

On the CPU each layer times its fused kernel (`FusedExperts.seconds`): the engine reports the experts'
share of its step time. CUDA kernels run asynchronously, so there the experts are not timed.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from inference_engine.distributed import all_reduce, tp_rank, tp_size
from inference_engine.layers.linear import Weight
from inference_engine.model_config import MoEModelConfig
from inference_engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from llmserve_kernels.cpu import moe as cpu_moe
from llmserve_kernels.quantized import Int8Weight
from llmserve_kernels.reference import fused_moe_ref

logger = logging.getLogger(__name__)

# A checkpoint's per-expert tensor: (layer prefix, expert, projection), transformers' names for each family.
_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# transformers 5's fused form: every expert of a projection in one tensor.
_FUSED_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], expert ids [T, k]): softmax over all experts in fp32, then the top k (ties as
    torch.topk breaks them), divided by their sum where `renormalize`. Mixtral's top-k-then-softmax is this
    with `renormalize`."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The experts' weighted sum for every token, through the device's fused kernel (int8 experts with
    `scales`: the CPU's)."""
    if x.device.type == "cuda":
        from llmserve_kernels.triton.fused_moe import fused_moe

        return fused_moe(x, w13, w2, weights, ids)
    out = cpu_moe.fused_moe(x, w13, w2, weights, ids, scales)
    if out is not None:
        return out
    if scales is not None:  # no native library: the int8 weights' values, step by step
        w13 = w13.float() * scales[0].repeat_interleave(w13.shape[2] // scales[0].shape[2], -1)
        w2 = w2.float() * scales[1].repeat_interleave(w2.shape[2] // scales[1].shape[2], -1)
    return fused_moe_ref(x, w13, w2, weights, ids)


_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class FusedExperts(nn.Module):
    """Every expert of a layer, stacked for the fused kernels at `finalize`: w13 [E, 2I, H] (gate rows then
    up rows) and w2 [E, H, I], from the checkpoint's per-expert tensors (or transformers 5's fused ones).
    Experts that all load as int8, gate/up with one group size and down with one (GGUF's Q8_0), stay int8 on
    the CPU with their scales, as do dense experts under the engine's int8 quantization; any other mix is
    dequantized to the model's dtype. With tensor parallelism each rank holds its slice of
    every expert's intermediate features (I / ranks, as a dense MLP is split) and the ranks' outputs are
    summed."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        if inter % self.tp_size:
            raise ValueError(f"the experts' width {inter} does not split over {self.tp_size} ranks")
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter // self.tp_size
        self.device, self.dtype = torch.get_default_device(), torch.get_default_dtype()
        self.parts: dict[
            tuple[int, str], Weight
        ] = {}  # (expert, projection): this rank's slice, until finalize
        self.w13 = self.w2 = torch.empty(0)
        self.scales: tuple[torch.Tensor, torch.Tensor] | None = None
        self.seconds = 0.0  # in the fused kernel, CPU only

    def load_expert(self, expert: int, projection: str, weight: Weight) -> None:
        dim = 1 if projection == "down_proj" else 0  # the intermediate features' dimension
        weight = weight.narrow(dim, self.tp_rank * self.inter, self.inter)
        # dense parts in the model's dtype now (on the CPU until finalize): a bf16 model's fp32 checkpoint
        # is not held whole meanwhile
        self.parts[expert, projection] = weight.to(self.dtype) if isinstance(weight, torch.Tensor) else weight

    def load_fused(self, projection: str, weight: Weight) -> None:
        """transformers 5's [E, 2I, H] gate_up_proj or [E, H, I] down_proj."""
        for expert in range(weight.shape[0]):
            if projection == "down_proj":
                self.load_expert(expert, "down_proj", weight[expert])
            else:
                half = weight.shape[1] // 2
                self.load_expert(expert, "gate_proj", weight[expert, :half])
                self.load_expert(expert, "up_proj", weight[expert, half:])

    def finalize(self, quantize_int8: bool = False) -> None:
        missing = sorted(
            {e for e in range(self.num_experts) for p in _PROJECTIONS if (e, p) not in self.parts}
        )
        if missing:
            raise ValueError(f"checkpoint is missing weights of experts {missing[:5]}")
        experts = [[self.parts.pop((e, p)) for p in _PROJECTIONS] for e in range(self.num_experts)]
        on_cpu = self.device.type == "cpu"
        if quantize_int8 and on_cpu:
            experts = [
                [Int8Weight.quantize(w) if isinstance(w, torch.Tensor) else w for w in ws] for ws in experts
            ]
        groups13 = {getattr(w, "group_size", None) for gate, up, _ in experts for w in (gate, up)}
        groups2 = {getattr(down, "group_size", None) for _, _, down in experts}
        if (
            on_cpu
            and all(isinstance(w, Int8Weight) for parts in experts for w in parts)
            and len(groups13) == len(groups2) == 1
            and self.hidden % next(iter(groups13)) == 0
            and self.inter % next(iter(groups2)) == 0
        ):
            self.w13 = torch.stack([torch.cat([gate.q, up.q]) for gate, up, _ in experts])
            self.w2 = torch.stack([down.q for _, _, down in experts])
            s13 = torch.stack([torch.cat([gate.scale, up.scale]) for gate, up, _ in experts])
            self.scales = (s13, torch.stack([down.scale for _, _, down in experts]))
            return

        def dense(weight: Weight) -> torch.Tensor:
            weight = weight if isinstance(weight, torch.Tensor) else weight.dequantize()
            return weight.to(self.dtype)

        self.w13 = torch.stack([torch.cat([dense(gate), dense(up)]) for gate, up, _ in experts]).to(
            self.device
        )
        self.w2 = torch.stack([dense(down) for _, _, down in experts]).to(self.device)

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in (self.w13, self.w2, *(self.scales or ())))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = fused_experts(x, self.w13, self.w2, weights, ids, self.scales)
        if x.device.type == "cpu":
            self.seconds += time.perf_counter() - start
        return all_reduce(out) if self.tp_size > 1 else out


class SparseMoeBlock(nn.Module):
    """Router, routed experts and (Qwen2-MoE) the shared expert, scaled by its sigmoid gate."""

    def __init__(self, config: MoEModelConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(
                f"experts with hidden_act {config.hidden_act!r} are not supported (supported: silu)."
            )
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size:
            shared = dataclasses.replace(config, intermediate_size=config.shared_expert_intermediate_size)
            self.shared_expert = LlamaMLP(shared)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoeDecoderLayer(LlamaDecoderLayer):
    """The pre-norm Llama layer with a sparse MoE block as its MLP (a dense one on `dense_layers`)."""

    def __init__(self, config: MoEModelConfig, layer: int, rotary, backend, qk_norm: str | None) -> None:
        super().__init__(config, layer, rotary, backend, qk_norm)
        if config.is_moe_layer(layer):
            self.mlp = SparseMoeBlock(config)


class MoeForCausalLM(LlamaForCausalLM):
    """The Llama model with `MoeDecoderLayer`s; families name their checkpoints' tensors in
    `checkpoint_weights`."""

    decoder_layer = MoeDecoderLayer

    def use_native_decoder(self) -> bool:
        logger.info("%s runs layer by layer: the native decoder has no MoE layers", self.config.architecture)
        return False

    @property
    def moe_seconds(self) -> float | None:
        """Seconds this model's experts have spent in the fused CPU kernel; None where they are not timed
        (CUDA)."""
        experts = self.fused_experts
        if not experts or experts[0].device.type != "cpu":
            return None
        return sum(m.seconds for m in experts)

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        # `LlamaForCausalLM.load_weights` converts the names it is passed once more: the families'
        # conversions are renames that leave converted names as they are.
        super().load_weights(self._load_experts(self.checkpoint_weights(weights)))

    def _load_experts(self, weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
        """Loads the expert tensors into their layers' stacks; passes every other tensor on."""
        for name, tensor in weights:
            if match := _EXPERT.match(name):
                prefix, expert, projection = match.groups()
                self.get_submodule(prefix).load_expert(int(expert), projection, tensor)
            elif match := _FUSED_EXPERTS.match(name):
                self.get_submodule(match[1]).load_fused(match[2], tensor)
            else:
                yield name, tensor

    def finalize(self, quantize_int8: bool = False) -> None:
        super().finalize(quantize_int8)
        self.fused_experts = [m for m in self.modules() if isinstance(m, FusedExperts)]
        for experts in self.fused_experts:
            experts.finalize(quantize_int8)
