"""The GGUF form of the tiny family checkpoints (`families`), written by llama.cpp's own converter
(`convert_hf_to_gguf.py` from the llama-cpp-python source distribution, with the `gguf` package it vendors),
and transformers' greedy tokens for what each file keeps of its checkpoint.

Which families convert, with the bundled model's byte-level BPE tokenizer and transformers 5:

- llama3 (its rope scaling as a `rope_freqs` tensor), llama-linear, llama-yarn, mistral, granite, olmo2:
  as they are.
- qwen3 and gemma3: once their tokenizer_config.json names the class that takes tokenizer.json as it is
  (`PreTrainedTokenizerFast`). Without a `tokenizer_class`, transformers 5 picks the class of the model type,
  which builds its own pre-tokenizer (Qwen2's regex) over the vocabulary or its own special tokens (Gemma):
  the converter then fails to recognise the pre-tokenizer, or finds token ids past the vocabulary.
- Not qwen2: transformers 5 lists qwen2 among the model types whose declared tokenizer class it overrides
  (`MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`), so the SmolLM2 vocabulary always meets Qwen2's regex and
  the converter recognises no pre-tokenizer.
- Not gemma2 nor phi3: their converters read only a SentencePiece `tokenizer.model` (Phi-3 takes a BPE
  tokenizer only where tokenizer_config.json says GPT2Tokenizer, which transformers 5 rebuilds with GPT-2's
  own pre-tokenizer: again unrecognised).

What a file keeps: the converter writes no sliding window for the `llama` architecture (a Mistral file
attends to every token, as llama.cpp serves it), and for Gemma 3 neither `query_pre_attn_scalar` (llama.cpp
scales by 1/sqrt(head_dim)) nor the layer types (llama.cpp's default: every 6th layer global, so all four
layers of the tiny model slide). `READING` lists these; the reference of a file is transformers on the
checkpoint's weights with its config so changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import safetensors.torch
import torch

from . import families
from .quant_checkpoints import CACHE, _cached, _version, cached_json

LLAMA_CPP_PYTHON = "0.3.36"
GGUF_VERSION = 1
OUTTYPES = ("f32", "q8_0")

CONVERTED = ("llama3", "llama-linear", "llama-yarn", "mistral", "qwen3", "gemma3", "olmo2", "granite")
NOT_CONVERTED = {
    "qwen2": "transformers 5 gives the qwen2 model type Qwen2's pre-tokenizer, unknown to the converter",
    # With a SentencePiece tokenizer.model they convert: spm_gguf, test_gguf_spm.
    "gemma2": "with this byte-level tokenizer: the converter needs a SentencePiece tokenizer.model",
    "phi3": "with this byte-level tokenizer: the converter needs a SentencePiece tokenizer.model",
}
# Families whose converted file transformers' own GGUF loader reads as llama.cpp does: it drops the rope
# scaling a file stores (linear, yarn, Llama 3's factors), gives Gemma 3 query_pre_attn_scalar 256, fails on
# the Qwen3 file's tied head and reads neither Granite nor OLMo 2.
TRANSFORMERS_READS = ("mistral",)
# The config fields a converted file reads back otherwise than its checkpoint declares (see above).
READING = {
    "mistral": {"sliding_window": None},
    "gemma3": {"query_pre_attn_scalar": 16, "layer_types": ["sliding_attention"] * 4},
}


def converter() -> Path:
    """llama.cpp's folder in the llama-cpp-python source distribution: convert_hf_to_gguf.py, its
    `conversion` package and `gguf-py`, fetched once per machine with pip."""
    return _cached(f"llama-cpp-python-{LLAMA_CPP_PYTHON}-converter", _fetch_converter) / "llama.cpp"


def _fetch_converter(folder: Path) -> None:
    with tempfile.TemporaryDirectory() as download:
        pip = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "--quiet"]
        subprocess.run([*pip, "-d", download, f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], check=True)
        (sdist,) = Path(download).glob("*.tar.gz")
        root = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        keep = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
        with tarfile.open(sdist) as tar:
            members = []
            for member in tar.getmembers():
                if member.name.startswith(root) and member.name[len(root) :].startswith(keep):
                    member.name = "llama.cpp/" + member.name[len(root) :]
                    members.append(member)
            tar.extractall(folder, members=members, filter="data")


def gguf_path(family: str, outtype: str) -> Path:
    """The family's checkpoint converted to GGUF (`outtype` f32 or q8_0), once per machine."""
    if family in NOT_CONVERTED:
        raise ValueError(f"{family} does not convert: {NOT_CONVERTED[family]}")
    key = f"{_prefix(family)}-gguf-{LLAMA_CPP_PYTHON}-{GGUF_VERSION}"
    return _cached(key, lambda f: _convert(family, f)) / f"{family}.{outtype}.gguf"


def _prefix(family: str) -> str:
    return f"family-{family}-{_version('transformers')}-{families.FAMILY_VERSION}"


def _convert(family: str, folder: Path) -> None:
    source, script = families.folder(family), converter() / "convert_hf_to_gguf.py"
    staging = folder / "staging"
    staging.mkdir()
    for item in source.iterdir():
        if item.name != "tokenizer_config.json":
            (staging / item.name).symlink_to(item)
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"  # tokenizer.json as it is (see above)
    (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    # The converter puts its vendored gguf-py first on sys.path itself; PYTHONPATH says so for this run only.
    env = {**os.environ, "PYTHONPATH": str(script.parent / "gguf-py"), "HF_HUB_OFFLINE": "1"}
    for outtype in OUTTYPES:
        outfile = folder / f"{family}.{outtype}.gguf"
        run = subprocess.run(
            [sys.executable, str(script), "--outtype", outtype, "--outfile", str(outfile), str(staging)],
            env=env,
            capture_output=True,
            text=True,
        )
        if run.returncode != 0:
            raise RuntimeError(f"convert_hf_to_gguf.py failed on {family} ({outtype}):\n{run.stderr[-3000:]}")
    shutil.rmtree(staging)


def reading_folder(family: str) -> Path:
    """The family's checkpoint with its config as the converted file reads back (`READING`)."""
    if family not in READING:
        return families.folder(family)

    def build(folder: Path) -> None:
        source = families.folder(family)
        for item in source.iterdir():
            if item.name != "config.json":
                (folder / item.name).symlink_to(item)
        config = {**families.config_json(source), **READING[family]}
        (folder / "config.json").write_text(json.dumps(config, indent=2))

    return _cached(f"{_prefix(family)}-gguf-reading-{GGUF_VERSION}", build)


def hf_greedy(family: str, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """transformers' fp32 greedy tokens and top-2 margins (as `families.hf_greedy`) for what the family's
    converted file keeps of its checkpoint."""
    if family not in READING:
        return families.hf_greedy(family, prompts, max_tokens)
    digest = hashlib.sha256(json.dumps([prompts, max_tokens]).encode()).hexdigest()[:16]
    path = CACHE / f"{_prefix(family)}-gguf-reading-{GGUF_VERSION}-greedy-{digest}.json"
    compute = lambda: families._hf_greedy(reading_folder(family), prompts, max_tokens)  # noqa: E731
    return [tuple(r) for r in cached_json(path, compute)]


def transformers_gguf_greedy(
    family: str, outtype: str, prompts: list[list[int]], max_tokens: int
) -> list[tuple[list[int], list[float]]]:
    """transformers' fp32 greedy tokens and margins on the converted file as its GGUF loader reads it
    (quantized weights dequantized), for `TRANSFORMERS_READS`."""
    path = gguf_path(family, outtype)
    key = f"{_prefix(family)}-gguf-{LLAMA_CPP_PYTHON}-{GGUF_VERSION}-{outtype}-transformers"

    def build(folder: Path) -> None:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
        # save_pretrained refuses a model loaded from GGUF: its dequantized weights and config, as they are.
        safetensors.torch.save_model(model, str(folder / "model.safetensors"))
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (folder / "config.json").write_text(json.dumps(config, indent=2))

    digest = hashlib.sha256(json.dumps([prompts, max_tokens]).encode()).hexdigest()[:16]
    compute = lambda: families._hf_greedy(_cached(key, build), prompts, max_tokens)  # noqa: E731
    return [tuple(r) for r in cached_json(CACHE / f"{key}-greedy-{digest}.json", compute)]
