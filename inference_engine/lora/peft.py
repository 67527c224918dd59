"""Reads a LoRA adapter as `peft` saves it: `adapter_config.json` and `adapter_model.safetensors`.

Each targeted module `m` has `...m.lora_A.weight` [r, in] and `...m.lora_B.weight` [out, r]; its update is
`scale * B @ A` with `scale = alpha / r` (`alpha / sqrt(r)` with `use_rslora`), where a module's r and alpha
come from `rank_pattern` / `alpha_pattern` when a pattern names it (matched as peft matches them: the key, or
any dotted prefix followed by the key, ends the module's name), else from `r` and `lora_alpha`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from inference_engine.errors import InvalidRequestError

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


@dataclass
class LoRAModule:
    lora_a: torch.Tensor  # [r, in] fp32
    lora_b: torch.Tensor  # [out, r] fp32
    scale: float


@dataclass
class PeftAdapter:
    path: str
    modules: dict[str, LoRAModule]  # by module name, e.g. "model.layers.0.self_attn.q_proj"

    @property
    def rank(self) -> int:
        return max(m.lora_a.shape[0] for m in self.modules.values())


def _pattern_key(patterns: list[str], module: str) -> str | None:
    return next((key for key in patterns if re.match(rf"(.*\.)?({key})$", module)), None)


def load_peft(path: str | Path, max_rank: int) -> PeftAdapter:
    """The adapter in folder `path`, its tensors in fp32; a clear InvalidRequestError for anything this engine
    does not serve (missing files, a bias, DoRA, a rank above `max_rank`, tensors without their pair)."""
    folder = Path(path)
    if not folder.is_dir():
        raise InvalidRequestError(f"LoRA adapter {path}: no such folder.")
    config_file, weights_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for file in (config_file, weights_file):
        if not file.is_file():
            raise InvalidRequestError(f"LoRA adapter {path}: {file.name} is missing.")
    try:
        config = json.loads(config_file.read_text())
        tensors = load_file(weights_file)
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"LoRA adapter {path}: cannot read it ({exc}).") from exc
    if config.get("peft_type", "LORA") != "LORA":
        raise InvalidRequestError(f"LoRA adapter {path}: peft_type {config['peft_type']!r} is not LORA.")
    if config.get("bias", "none") != "none":
        raise InvalidRequestError(
            f"LoRA adapter {path}: bias {config['bias']!r} is not supported (only 'none')."
        )
    if config.get("use_dora"):
        raise InvalidRequestError(f"LoRA adapter {path}: DoRA adapters are not supported.")
    if config.get("modules_to_save"):
        raise InvalidRequestError(f"LoRA adapter {path}: modules_to_save is not supported.")
    r, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    patterns = [*rank_pattern, *alpha_pattern]

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise InvalidRequestError(f"LoRA adapter {path}: unexpected tensor {key!r} (only lora_A/lora_B).")
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    if not pairs:
        raise InvalidRequestError(f"LoRA adapter {path}: {WEIGHTS_FILE} holds no LoRA tensors.")

    modules = {}
    for name, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise InvalidRequestError(
                f"LoRA adapter {path}: {name} has lora_{''.join(pair)} without its pair."
            )
        a, b = pair["A"].float(), pair["B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise InvalidRequestError(
                f"LoRA adapter {path}: {name} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                "which do not make a low-rank pair."
            )
        key = _pattern_key(patterns, name)
        rank = int(rank_pattern.get(key, r))
        if a.shape[0] != rank:
            raise InvalidRequestError(
                f"LoRA adapter {path}: {name} has rank {a.shape[0]} where its config says {rank}."
            )
        if rank > max_rank:
            raise InvalidRequestError(
                f"LoRA adapter {path}: {name} has rank {rank}, above max_lora_rank {max_rank}."
            )
        module_alpha = float(alpha_pattern.get(key, alpha))
        scale = module_alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        modules[name] = LoRAModule(a.contiguous(), b.contiguous(), scale)
    return PeftAdapter(str(path), modules)
