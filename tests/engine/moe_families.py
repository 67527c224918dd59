"""Tiny random mixture-of-experts checkpoints of every MoE family the engine loads (8 experts, top-2, three
layers), written by transformers with the family's quirks on: Mixtral with a sliding window, Qwen2-MoE with
its shared expert and a dense layer (`mlp_only_layers`), Qwen3-MoE renormalising its top-k weights, OLMoE.
Cached once per machine with the bundled tokenizer, as `families` caches the dense families."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from .families import _hf_greedy
from .quant_checkpoints import CACHE, TOKENIZER_FILES, _cached, _version, cached_json, dense_folder

MOE_VERSION = 1
WINDOW = 16
SHAPE = dict(
    vocab_size=49152,  # the bundled model's tokenizer
    hidden_size=64,
    intermediate_size=96,  # dense layers (Qwen2-MoE's mlp_only_layers); Mixtral's and OLMoE's experts
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    num_experts_per_tok=2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    rms_norm_eps=1e-6,
)
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, sliding_window=WINDOW)),
    "qwen2moe": (
        "Qwen2MoeConfig",
        dict(
            num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=80, mlp_only_layers=[1]
        ),
    ),
    # Qwen2-MoE without a dense layer: the form llama.cpp's converter writes (GGUF tests only).
    "qwen2moe-sparse": (
        "Qwen2MoeConfig",
        dict(num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=80),
    ),
    "qwen3moe": ("Qwen3MoeConfig", dict(num_experts=8, moe_intermediate_size=32, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", dict(num_experts=8)),
}


def folder(family: str) -> Path:
    """The family's tiny checkpoint, built once per machine and transformers version."""
    return _cached(f"moe-{family}-{_version('transformers')}-{MOE_VERSION}", lambda f: build(family, f))


def build(family: str, folder: Path) -> None:
    """Writes the family's tiny checkpoint (fp32 safetensors, config, the bundled tokenizer) into folder.
    Weights are drawn wider than transformers' initialisation, so that logits and router choices have
    margins (as `benchmarks.random_families` draws them)."""
    import transformers

    cls_name, quirks = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, cls_name)(**SHAPE, **quirks)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.uniform_(0.5, 1.5) if "norm" in name else param.normal_(0.0, 0.15)
    model.to(torch.float32).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(dense_folder() / name, folder / name)


def hf_greedy(family: str, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """transformers' fp32 greedy tokens for each prompt with the top-2 logit margin at each step (as
    `families.hf_greedy`), kept once per machine."""
    key = json.dumps([prompts, max_tokens])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    path = CACHE / f"moe-{family}-{_version('transformers')}-{MOE_VERSION}-greedy-{digest}.json"
    return [tuple(r) for r in cached_json(path, lambda: _hf_greedy(folder(family), prompts, max_tokens))]


# The GGUF form, written by llama.cpp's converter (as `family_gguf` converts the dense families). Its `llama`
# architecture (Mixtral's) stores no sliding window: the reference of that file is the checkpoint without one.
GGUF_READING = {"mixtral": {"sliding_window": None}}


def gguf_path(family: str, outtype: str) -> Path:
    """The family's checkpoint converted to GGUF (`outtype` f32 or q8_0), once per machine."""
    from .family_gguf import LLAMA_CPP_PYTHON

    key = f"moe-{family}-{_version('transformers')}-{MOE_VERSION}-gguf-{LLAMA_CPP_PYTHON}"
    return _cached(key, lambda f: _convert(family, f)) / f"{family}.{outtype}.gguf"


def _convert(family: str, target: Path) -> None:
    """Runs llama.cpp's converter on the checkpoint as `family_gguf` runs it on the dense families (its
    tokenizer_config.json naming the class that takes tokenizer.json as it is)."""
    from .family_gguf import OUTTYPES, converter

    source, script = folder(family), converter() / "convert_hf_to_gguf.py"
    staging = target / "staging"
    staging.mkdir()
    for item in source.iterdir():
        if item.name != "tokenizer_config.json":
            (staging / item.name).symlink_to(item)
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    env = {**os.environ, "PYTHONPATH": str(script.parent / "gguf-py"), "HF_HUB_OFFLINE": "1"}
    for outtype in OUTTYPES:
        command = [
            sys.executable,
            str(script),
            "--outtype",
            outtype,
            "--outfile",
            str(target / f"{family}.{outtype}.gguf"),
        ]
        run = subprocess.run([*command, str(staging)], env=env, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"convert_hf_to_gguf.py failed on {family} ({outtype}):\n{run.stderr[-3000:]}")
    shutil.rmtree(staging)


def gguf_hf_greedy(
    family: str, prompts: list[list[int]], max_tokens: int
) -> list[tuple[list[int], list[float]]]:
    """transformers' fp32 greedy tokens and margins for what the converted file keeps of its checkpoint."""
    if family not in GGUF_READING:
        return hf_greedy(family, prompts, max_tokens)
    prefix = f"moe-{family}-{_version('transformers')}-{MOE_VERSION}-gguf-reading"

    def build(target: Path) -> None:
        source = folder(family)
        for item in source.iterdir():
            if item.name != "config.json":
                (target / item.name).symlink_to(item)
        config = {**json.loads((source / "config.json").read_text()), **GGUF_READING[family]}
        (target / "config.json").write_text(json.dumps(config, indent=2))

    digest = hashlib.sha256(json.dumps([prompts, max_tokens]).encode()).hexdigest()[:16]
    compute = lambda: _hf_greedy(_cached(prefix, build), prompts, max_tokens)  # noqa: E731
    return [tuple(r) for r in cached_json(CACHE / f"{prefix}-greedy-{digest}.json", compute)]
