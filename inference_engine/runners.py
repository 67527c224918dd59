"""Picks the model runner for the configured device."""

from __future__ import annotations

from typing import TYPE_CHECKING

from inference_engine.config import EngineConfig
from inference_engine.cpu_runner import CPURunner
from inference_engine.cuda_runner import CUDARunner
from inference_engine.model_loader import LoadedModel
from inference_engine.model_runner import ModelRunner, resolve_device

if TYPE_CHECKING:  # tp_workers builds its ranks' runners from this module
    from inference_engine.tp_workers import TPWorkers


def make_runner(config: EngineConfig, loaded: LoadedModel, workers: TPWorkers | None = None) -> ModelRunner:
    """`CUDARunner` where the config's device is a GPU, else `CPURunner`."""
    runner_cls = CUDARunner if resolve_device(config).type == "cuda" else CPURunner
    return runner_cls(config, loaded, workers)
