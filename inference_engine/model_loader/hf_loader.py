"""Hugging Face folders: config.json, *.safetensors and tokenizer.json (+ tokenizer_config.json).

A folder whose config.json declares an AWQ or GPTQ `quantization_config` has its packed linear layers
converted to `Int4Weight` by `hf_quant`, one layer at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from safetensors import safe_open

from inference_engine.config import resolve_quantization
from inference_engine.model_loader import LoadedModel, Weight, hf_quant
from inference_engine.model_loader.hf_config import model_config
from inference_engine.tokenizer import load_hf_tokenizer

_PACKED_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def load(folder: Path, quantization: str | None = None) -> LoadedModel:
    raw = json.loads((folder / "config.json").read_text())
    declared = hf_quant.declared_method(raw)
    method = resolve_quantization(quantization, declared, f"the checkpoint {folder.name}")
    eos = raw.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    config = model_config(raw, eos_ids)  # refuses an unsupported model before anything else is read
    tokenizer = load_hf_tokenizer(folder, eos_ids)
    config.eos_token_ids = tokenizer.eos_token_ids
    qconfig = (
        hf_quant.QuantConfig(declared, raw["quantization_config"]) if declared in hf_quant.METHODS else None
    )
    weights = _weights(folder, qconfig, dequantize=method == "none")
    if config.architecture not in (raw.get("architectures") or []):  # a base model: its body's names
        weights = ((f"model.{name}", weight) for name, weight in weights)
    return LoadedModel(
        name=folder.name, config=config, tokenizer=tokenizer, weights=weights, quantization=method
    )


def _weights(
    folder: Path, qconfig: hf_quant.QuantConfig | None, dequantize: bool
) -> Iterator[tuple[str, Weight]]:
    """Checkpoint tensors by name; a quantized layer's packed tensors (`<prefix>.qweight` and the rest)
    come out as one `<prefix>.weight`, whichever safetensors files hold them."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}.")
    handles = [safe_open(str(file), framework="pt") for file in files]
    where = {name: f for f in handles for name in f.keys()}  # noqa: SIM118 - safe_open is not a dict
    layers = sorted({name.rpartition(".")[0] for name in where if name.endswith(".qweight")})
    if layers and qconfig is None:
        raise ValueError(
            f"{folder.name} holds packed weights (qweight) but config.json has no quantization_config."
        )
    packed = {f"{layer}.{part}" for layer in layers for part in _PACKED_PARTS}
    for name, f in where.items():
        if name not in packed:
            yield name, f.get_tensor(name)
    for layer in layers:
        names = {part: f"{layer}.{part}" for part in _PACKED_PARTS if f"{layer}.{part}" in where}
        missing = {"qzeros", "scales"} - set(names)
        if missing:
            raise ValueError(f"{folder.name}: the packed layer {layer} lacks {sorted(missing)}.")
        weight = hf_quant.convert_layer({p: where[n].get_tensor(n) for p, n in names.items()}, qconfig)
        yield f"{layer}.weight", weight.dequantize() if dequantize else weight
