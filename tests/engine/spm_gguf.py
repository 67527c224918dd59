"""Tiny checkpoints with a SentencePiece BPE tokenizer (`tokenizer.model`, trained here on a few hundred
varied lines), as Llama 2, Mistral v0.1, Gemma and Phi-3 ship theirs, and their GGUF form written by
llama.cpp's converter (`family_gguf.converter`), f32 and Q8_0, cached once per machine.

- `llama-linear` with a Llama 2 style model (a space before the text, `add_dummy_prefix`), converted to the
  `llama` architecture;
- `gemma2` with a Gemma style model (no space before the text: the converter writes `add_space_prefix`
  false for Gemma);
- `phi3` with a Llama 2 style model (its converter wants `tokenizer_class` in tokenizer_config.json).

The models keep text as it is (identity normalization, spaces kept), as those checkpoints' models do and as
llama.cpp tokenizes: what the GGUF file stores must encode to the model's own ids.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import random_families

from . import families
from .family_gguf import LLAMA_CPP_PYTHON, OUTTYPES, converter
from .quant_checkpoints import _cached, _version

SPM_VERSION = 3
GGUF_VERSION = 2
VOCAB_SIZE = 800
# family -> whether its model puts a space before the text (SentencePiece's add_dummy_prefix).
SPACE_PREFIX = {"llama-linear": True, "gemma2": False, "phi3": True}
USER_DEFINED = ["<start_of_turn>", "<end_of_turn>"]
# The config fields a converted file reads back otherwise than its checkpoint declares: llama.cpp scales
# Gemma 2's attention by 1/sqrt(head_dim) whatever query_pre_attn_scalar says (as `family_gguf.READING`).
READING = {"gemma2": {"query_pre_attn_scalar": random_families.TINY["head_dim"]}}

_SENTENCE = (
    "the river carries water from distant mountains to the quiet sea while farmers watch clouds gather "
    "over green valleys and children learn to count stars at night in small villages near old bridges"
)
_WORDS = _SENTENCE.split(" ")
_CODE = [
    "def add(a, b):\n    return a + b",
    "for i in range(10):\n    print(i * i)",
    "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y",
    "if (count > 0 && ready) { total += count; }",
    "SELECT name, price FROM items WHERE price < 100 ORDER BY name;",
    "const total = values.reduce((a, b) => a + b, 0);",
]
_CHINESE = [
    "今天天气很好，我们去公园散步。",
    "这个模型可以生成中文和英文的文本。",
    "学习编程需要耐心和练习。",
    "河流从山上流向大海。",
    "我喜欢在晚上读书和写字。",
]


def corpus() -> list[str]:
    """A few hundred lines: English, code, Chinese, numbers, and the user-defined markers in use."""
    lines = []
    for i in range(240):
        words = [_WORDS[(i * 7 + k * 3) % len(_WORDS)] for k in range(6 + i % 9)]
        lines.append(" ".join(words).capitalize() + ".")
        if i % 2 == 0:
            lines.append(_CODE[i % len(_CODE)])
        if i % 3 == 0:
            lines.append(_CHINESE[i % len(_CHINESE)])
        if i % 4 == 0:
            lines.append(
                f"Order {i * 37} cost {i * 3.25:.2f} dollars on 2024-{1 + i % 12:02d}-{1 + i % 28:02d}."
            )
        if i % 10 == 0:
            lines.append(f"<start_of_turn>user {words[0]} {words[1]}<end_of_turn>")
    return lines


def train(folder: Path, space_prefix: bool) -> Path:
    """folder/tokenizer.model: a SentencePiece BPE model with byte fallback, ids 0-2 for unk, bos, eos
    (as the tiny checkpoints' configs say)."""
    import sentencepiece

    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()),
        model_prefix=str(folder / "tokenizer"),
        model_type="bpe",
        vocab_size=VOCAB_SIZE,
        character_coverage=0.995,  # rare characters fall back to bytes
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=space_prefix,
        user_defined_symbols=USER_DEFINED,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    (folder / "tokenizer.vocab").unlink()
    return folder / "tokenizer.model"


def folder(family: str) -> Path:
    """The family's tiny checkpoint (`benchmarks.random_families`) with a vocabulary of the trained
    model's size and the model as its tokenizer."""

    def build(target: Path) -> None:
        shape = {**random_families.TINY, "vocab_size": VOCAB_SIZE}
        random_families.write_family(target, family, shape, window=families.WINDOW)
        train(target, SPACE_PREFIX[family])
        # As the chat checkpoints declare their turn markers: special added tokens (the converter reads only
        # this to type them; SentencePiece's own user-defined pieces would be written as normal pieces).
        added = {str(3 + i): {"content": t, "special": True} for i, t in enumerate(USER_DEFINED)}
        (target / "tokenizer_config.json").write_text(
            json.dumps({"tokenizer_class": "LlamaTokenizer", "added_tokens_decoder": added})
        )

    return _cached(
        f"spm-{family}-{_version('transformers')}-{_version('sentencepiece')}-{SPM_VERSION}", build
    )


def gguf_path(family: str, outtype: str = "f32") -> Path:
    """The checkpoint converted to GGUF (`outtype` f32 or q8_0) by llama.cpp's converter, once per machine."""

    def build(target: Path) -> None:
        script = converter() / "convert_hf_to_gguf.py"
        env = {**os.environ, "PYTHONPATH": str(script.parent / "gguf-py"), "HF_HUB_OFFLINE": "1"}
        for kind in OUTTYPES:
            outfile = target / f"{family}.{kind}.gguf"
            run = subprocess.run(
                [
                    sys.executable,
                    str(script),
                    "--outtype",
                    kind,
                    "--outfile",
                    str(outfile),
                    str(folder(family)),
                ],
                env=env,
                capture_output=True,
                text=True,
            )
            if run.returncode != 0:
                raise RuntimeError(
                    f"convert_hf_to_gguf.py failed on {family} ({kind}):\n{run.stderr[-3000:]}"
                )

    return (
        _cached(f"{_key(family)}-gguf-{LLAMA_CPP_PYTHON}-{GGUF_VERSION}", build) / f"{family}.{outtype}.gguf"
    )


def reading_folder(family: str) -> Path:
    """The checkpoint with its config as the converted file reads back (`READING`)."""
    if family not in READING:
        return folder(family)

    def build(target: Path) -> None:
        source = folder(family)
        for item in source.iterdir():
            if item.name != "config.json":
                (target / item.name).symlink_to(item)
        config = {**json.loads((source / "config.json").read_text()), **READING[family]}
        (target / "config.json").write_text(json.dumps(config, indent=2))

    return _cached(f"{_key(family)}-reading", build)


def _key(family: str) -> str:
    return f"spm-{family}-{_version('transformers')}-{_version('sentencepiece')}-{SPM_VERSION}"
