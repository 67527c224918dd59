"""Tiny random checkpoints of every architecture family the engine loads (`benchmarks.random_families`,
with a window of 16 tokens: shorter than prompt + output), cached once per machine with the bundled
tokenizer, and transformers' own fp32 greedy continuations of them."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from benchmarks import random_families

from .quant_checkpoints import CACHE, TOKENIZER_FILES, _cached, _version, cached_json, dense_folder

FAMILY_VERSION = 1
WINDOW = 16
FAMILIES = random_families.families(WINDOW, 64)


def folder(family: str) -> Path:
    """The family's tiny checkpoint, built once per machine and transformers version."""
    return _cached(f"family-{family}-{_version('transformers')}-{FAMILY_VERSION}", lambda f: build(family, f))


def build(family: str, folder: Path) -> None:
    """Writes the family's tiny checkpoint (fp32 safetensors, config, the bundled tokenizer) into folder."""
    random_families.write_family(folder, family, random_families.TINY, window=WINDOW)
    for name in TOKENIZER_FILES:
        shutil.copy(dense_folder() / name, folder / name)


def hf_greedy(family: str, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """transformers' fp32 greedy tokens for each prompt, with the margin between the top two logits at
    each step (a divergence where that margin is tiny is a tie, not an error); kept once per machine."""
    key = json.dumps([prompts, max_tokens])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    path = CACHE / f"family-{family}-{_version('transformers')}-{FAMILY_VERSION}-greedy-{digest}.json"
    return [tuple(r) for r in cached_json(path, lambda: _hf_greedy(folder(family), prompts, max_tokens))]


def _hf_greedy(folder: Path, prompts: list[list[int]], max_tokens: int) -> list:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    results = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=2,
            )
            margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
            results.append((out.sequences[0, len(ids) :].tolist(), margins))
    return results


def compare(outputs: list[list[int]], references: list[tuple[list[int], list[float]]], tie: float = 1e-3):
    """(mismatches, ties): a prompt whose tokens first differ where the reference's top-2 margin is below
    `tie` is a tie; anywhere else a mismatch (prompt index, step, ours, theirs)."""
    mismatches, ties = [], 0
    for i, (ours, (theirs, margins)) in enumerate(zip(outputs, references, strict=True)):
        step = next((s for s, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
        if step is None:
            continue
        if margins[step] < tie:
            ties += 1
        else:
            mismatches.append((i, step, ours[step:], theirs[step:]))
    return mismatches, ties


def config_json(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())
