"""Engine configuration: the knobs of vLLM's engine arguments that this engine implements."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from inference_engine.errors import InvalidRequestError
from inference_engine.pooling import PoolerConfig
from inference_engine.reasoning_parsers import PARSERS as REASONING_PARSERS
from inference_engine.tool_parsers import PARSERS

RUNNERS = ("generate", "pooling")
TASKS = {"generate": "generate", "embed": "pooling"}  # vLLM's older `task`, as the runner it selects
QUANTIZATION_METHODS = ("awq", "gptq", "gguf", "int8", "none")
CHECKPOINT_METHODS = ("awq", "gptq", "gguf")  # what a checkpoint itself can declare


@dataclass
class EngineConfig:
    model: str | None = None  # a GGUF file, a Hugging Face folder or hub id; None = the bundled default
    served_model_name: str | None = None
    tokenizer: str | None = None  # a tokenizer folder or hub id; None = the model's own
    tokenizer_revision: str | None = None
    download_dir: str | None = None  # the Hugging Face cache for hub models; None = $HF_HOME/hub
    gguf_file: str | None = None  # a GGUF file inside the model's hub repo or folder
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    attention_backend: str = "auto"  # "auto" | "torch" | "triton"
    quantization: str | None = None  # QUANTIZATION_METHODS; None = what the checkpoint declares
    revision: str | None = None  # a hub model's branch, tag or commit
    tensor_parallel_size: int = 1
    # Where the ranks of a tensor-parallel group meet (rank 0's machine); without a port, a free one on
    # this machine (possible only when every rank runs here).
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    nnodes: int = 1  # machines the ranks are spread over (the others run `python -m inference_engine worker`)
    # vLLM's form: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min"/"_max": n}
    speculative_config: dict | None = None
    # Decode steps one engine step may run in one native call while no other request waits and no running
    # sequence edits its logits (vLLM's --num-scheduler-steps): less Python between tokens, which then
    # stream in bursts.
    num_scheduler_steps: int = 1
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None = the model's own context length
    max_num_batched_tokens: int = 2048  # token budget per step; longer prompts are prefilled in chunks
    block_size: int = 16
    gpu_memory_utilization: float = 0.9  # share of device memory the engine may use (CUDA)
    kv_cache_memory_bytes: int | None = None  # explicit KV budget; the default on CPU is 1 GiB
    swap_space: float = 0.0  # GiB of CPU memory for swapped-out KV blocks; 0 = preempt by recompute
    # GiB of host memory for the prefix cache's second tier: full blocks the KV pool evicts, copied back when
    # a prompt reaches them again instead of prefilled (inference_engine/kv_offload.py); 0 = none. None: 4 GiB
    # of pinned memory per rank on CUDA, none on the CPU (whose KV pool already lives in the same RAM).
    kv_offload_gib: float | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    enforce_eager: bool = False  # CUDA: run every step eagerly instead of replaying captured CUDA graphs
    max_pending_requests: int = 4096  # admission bound: beyond it add_request raises EngineOverloadedError
    log_stats_interval: float = 10.0  # seconds between stats log lines; 0 disables
    tool_call_parser: str = "hermes"  # the model's tool-call format (vLLM's --tool-call-parser)
    reasoning_parser: str | None = None  # the model's reasoning block (vLLM's --reasoning-parser); None: none
    # "generate" samples tokens; "pooling" serves embeddings (`LLM.embed`, /v1/embeddings) and nothing else.
    runner: str = "generate"
    task: str | None = None  # vLLM's older name for the runner: "embed" = runner "pooling"
    # vLLM's --pooler-config: {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize", "dimensions"} (a dict
    # or a PoolerConfig); what it leaves out comes from the checkpoint (see `pooling`).
    pooler_config: dict | None = None
    # LoRA adapters (vLLM's --enable-lora): adapters in device slots at once, their largest rank, and how many
    # loaded adapters CPU memory keeps (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    @property
    def distributed_init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"

    def __post_init__(self) -> None:
        if self.task is not None:
            if self.task not in TASKS:
                raise InvalidRequestError(f"unknown task {self.task!r} (known: {', '.join(TASKS)}).")
            self.runner, self.task = TASKS[self.task], None
        if self.runner not in RUNNERS:
            raise InvalidRequestError(f"unknown runner {self.runner!r} (choose from {', '.join(RUNNERS)}).")
        if self.pooler_config is not None:
            self.pooler_config = PoolerConfig.of(self.pooler_config).to_dict()
        if self.block_size not in (8, 16, 32):
            raise InvalidRequestError(f"block_size must be 8, 16 or 32, got {self.block_size}.")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise InvalidRequestError(f"unknown dtype {self.dtype!r}.")
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise InvalidRequestError(
                f"unknown quantization {self.quantization!r} (choose from {', '.join(QUANTIZATION_METHODS)})."
            )
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise InvalidRequestError(f"unknown attention_backend {self.attention_backend!r}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidRequestError("gpu_memory_utilization must be in (0, 1].")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < self.block_size:
            raise InvalidRequestError("max_num_seqs must be >= 1 and max_num_batched_tokens >= block_size.")
        if self.tensor_parallel_size < 1 or self.nnodes < 1 or self.tensor_parallel_size % self.nnodes:
            raise InvalidRequestError("tensor_parallel_size must be a positive multiple of nnodes.")
        if self.nnodes > 1 and self.master_port is None:
            raise InvalidRequestError("ranks on several machines need an agreed master_addr and master_port.")
        if not 1 <= self.num_scheduler_steps <= 64:
            raise InvalidRequestError("num_scheduler_steps must be in [1, 64].")
        if self.swap_space < 0:
            raise InvalidRequestError("swap_space must be non-negative.")
        if self.kv_offload_gib is not None and self.kv_offload_gib < 0:
            raise InvalidRequestError("kv_offload_gib must be non-negative.")
        if self.tool_call_parser not in PARSERS:
            raise InvalidRequestError(
                f"unknown tool_call_parser {self.tool_call_parser!r} (known: {', '.join(PARSERS)})."
            )
        if self.enable_lora and (self.max_loras < 1 or self.max_lora_rank < 1):
            raise InvalidRequestError("max_loras and max_lora_rank must be >= 1.")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise InvalidRequestError("LoRA adapters are not supported with tensor parallelism yet.")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise InvalidRequestError(
                f"unknown reasoning_parser {self.reasoning_parser!r} (known: {', '.join(REASONING_PARSERS)})."
            )


def engine_flags(engine_args: dict[str, Any]) -> list[str]:
    """`serve` flags for EngineConfig options (names with underscores or dashes), as the supervisor and
    `manage.py llmserve_engine` build command lines: booleans as --x / --no-x, objects as JSON, lists as the
    flag and then each value (``lora_modules``: ``--lora-modules a=PATH b=PATH``; objects among them as
    JSON), an empty list as nothing."""
    flags = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        elif isinstance(value, list | tuple):
            if value:
                flags += [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def resolve_quantization(requested: str | None, declared: str | None, checkpoint: str) -> str:
    """The quantization a model loads with: `requested` (EngineConfig.quantization) against what the
    checkpoint `declared` ("awq" | "gptq" | "gguf", None for a dense one), as vLLM resolves it.

    None takes the declared method ("none" for a dense checkpoint). "none" loads any checkpoint dense
    (quantized weights dequantized); "int8" quantizes a dense or GGUF checkpoint's linear weights on
    load. A method the checkpoint is not stored in is an error: the engine does not convert between them.
    """
    if declared not in (None, *CHECKPOINT_METHODS):
        raise InvalidRequestError(
            f"{checkpoint} is quantized with {declared!r}, which this engine cannot load "
            f"(supported: {', '.join(CHECKPOINT_METHODS)} checkpoints, or dense ones)."
        )
    if requested is None:
        return declared or "none"
    if requested == "none" or requested == declared:
        return requested
    if requested == "int8" and declared in (None, "gguf"):
        return requested
    if declared is None:
        raise InvalidRequestError(
            f"quantization {requested!r} needs a checkpoint stored in that format, but {checkpoint} is not "
            f"quantized; load it as it is, or with quantization 'int8' to quantize it on load."
        )
    raise InvalidRequestError(
        f"quantization {requested!r} does not match {checkpoint}, which is stored as {declared!r}: "
        f"use {declared!r} (or leave quantization unset), or 'none' to load it dequantized."
    )
