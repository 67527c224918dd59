"""GGUF files with a SentencePiece vocabulary (`tokenizer.ggml.model` "llama", as llama.cpp's converter
writes Llama 2, Mistral v0.1, Gemma and Phi-3 files): the tokenizer the loader rebuilds from the pieces,
scores and types encodes to the SentencePiece model's own ids and decodes them back, and the engine on a
converted checkpoint gives transformers' fp32 greedy tokens on the original (`spm_gguf`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random

import pytest
import sentencepiece
import torch

from inference_engine import LLM, SamplingParams
from inference_engine.model_loader import gguf_file, gguf_loader, load_model
from inference_engine.model_loader.hf_config import model_config

from . import families, spm_gguf
from .conftest import assert_all_blocks_free
from .quant_checkpoints import CACHE, cached_json
from .test_families import MAX_TOKENS
from .test_families import TEXTS as PROMPTS

TEXTS = [
    "The river carries water from distant mountains.",
    "  two leading spaces and   three inside ",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n\tprint(i * i)",
    "今天天气很好，我们去公园散步。",
    "罕见字龘靐 and an emoji 🎉, café, naïve, Ωμέγα",  # characters the model does not cover: bytes
    "Order 1234567 cost 3.25 dollars on 2024-05-17.",
    "SELECT name FROM items WHERE price < 100;",
    "",
    " ",
    "\n\n",
]
MARKED = "<start_of_turn>user\nhi there<end_of_turn>\n"


def _tokenizers(family: str):
    original = sentencepiece.SentencePieceProcessor(
        model_file=str(spm_gguf.folder(family) / "tokenizer.model")
    )
    ours = gguf_loader._tokenizer(gguf_file.read(spm_gguf.gguf_path(family)))
    return original, ours


@pytest.mark.parametrize("family", sorted(spm_gguf.SPACE_PREFIX))
def test_spm_gguf_tokenizer_encodes_and_decodes_as_sentencepiece(family):
    original, ours = _tokenizers(family)
    fallback = 0
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == original.encode(text), text
        assert ours.decode(ids) == original.decode(ids) == text
        assert ours.encode(text) == [original.bos_id(), *ids]  # llama.cpp's default: a BOS
        fallback += sum(ours.id_to_token(i).startswith("<0x") for i in ids)
    assert fallback > 0  # the byte fallback was exercised
    # Gemma's model puts no space before the text, Llama 2's does (the file says so: add_space_prefix).
    first = ours.id_to_token(ours.encode("the river", add_special_tokens=False)[0])
    assert first.startswith("\u2581") == spm_gguf.SPACE_PREFIX[family]


@pytest.mark.parametrize("family", sorted(spm_gguf.SPACE_PREFIX))
def test_spm_gguf_tokenizer_on_the_training_lines_and_random_text(family):
    """Where merge order matters most: the lines the model learnt its merges from, and random strings of
    letters, digits, punctuation, whitespace, Chinese and uncovered characters."""
    original, ours = _tokenizers(family)
    rng = random.Random(0)
    alphabet = (
        "abcdefghijklmnopqrstuvwxyz  ABCXYZ0123456789.,;:()[]{}\n\t _-+=*/今天天气很好我们去公园散步龘éΩ🎉"
    )
    texts = [line for line in spm_gguf.corpus() if "<" not in line]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(1000)]
    for text in texts:
        ids = original.encode(text)
        assert ours.encode(text, add_special_tokens=False) == ids, text
        assert ours.decode(ids) == original.decode(ids), text


@pytest.mark.parametrize("family", sorted(spm_gguf.SPACE_PREFIX))
def test_spm_gguf_turn_markers_are_special_tokens(family):
    """The turn markers are whole tokens, as in the original model, and special (dropped on decoding).
    Where the model puts no space before the text, the ids are SentencePiece's own; where it does, the text
    after a marker gets that space too, as llama.cpp tokenizes it (SentencePiece, which reads no markers out
    of the text first, puts it only before the whole)."""
    original, ours = _tokenizers(family)
    ids = ours.encode(MARKED, add_special_tokens=False)
    start, end = (original.piece_to_id(t) for t in spm_gguf.USER_DEFINED)
    assert ids.count(start) == ids.count(end) == 1
    assert ids[0] == start
    assert ours.id_to_token(ids[1]).startswith("\u2581") == spm_gguf.SPACE_PREFIX[family]
    if not spm_gguf.SPACE_PREFIX[family]:
        assert ids == original.encode(MARKED)
        assert ours.decode(ids, skip_special_tokens=False) == original.decode(ids) == MARKED
    assert ours.decode(ids) == original.decode([i for i in ids if i not in (start, end)])


@pytest.mark.parametrize("family", sorted(spm_gguf.SPACE_PREFIX))
def test_spm_gguf_config_is_the_checkpoints(family):
    """The file's metadata gives the checkpoint's ModelConfig (as the file reads back: `spm_gguf.READING`),
    Phi-3's longrope factors from their tensors included."""
    reader = gguf_file.read(spm_gguf.gguf_path(family))
    meta = {name: value for name, value in reader.fields.items() if not name.startswith("tokenizer.ggml.")}
    ours = model_config(gguf_loader.hf_config_dict(reader, meta), [2])
    theirs = model_config(json.loads((spm_gguf.reading_folder(family) / "config.json").read_text()), [2])
    for field in dataclasses.fields(ours):
        a, b = getattr(ours, field.name), getattr(theirs, field.name)
        if field.name == "rms_norm_eps":  # stored as float32
            assert a == pytest.approx(b, rel=1e-6)
        elif field.name == "rope_scaling" and family == "phi3":
            # The file states the attention factor transformers derives from the two context lengths.
            assert a.pop("attention_factor") == pytest.approx(
                math.sqrt(1 + math.log(256 / 64) / math.log(64))
            )
            assert a == {k: v for k, v in b.items() if k != "partial_rotary_factor"}
        elif field.name == "layer_types" and a is not None and b is None:  # every layer slides
            assert a == ["sliding_attention"] * ours.num_hidden_layers and ours.sliding_window
        else:
            assert a == b, field.name


def _matches_transformers(family: str, backend: str, texts: list[str]) -> None:
    path = spm_gguf.gguf_path(family)
    llm = LLM(model=str(path), dtype="float32", quantization="none", attention_backend=backend, seed=0)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in texts]
    digest = hashlib.sha256(json.dumps([prompts, MAX_TOKENS]).encode()).hexdigest()[:16]
    compute = lambda: families._hf_greedy(spm_gguf.reading_folder(family), prompts, MAX_TOKENS)  # noqa: E731
    references = [tuple(r) for r in cached_json(CACHE / f"{path.parent.name}-greedy-{digest}.json", compute)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    mismatches, ties = families.compare([o.outputs[0].token_ids for o in outputs], references)
    print(
        f"{family} SentencePiece GGUF f32 ({backend}): "
        f"{len(prompts) - len(mismatches) - ties} equal, {ties} ties"
    )
    assert not mismatches, mismatches
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("family", sorted(spm_gguf.SPACE_PREFIX))
def test_spm_gguf_matches_transformers(family):
    """The Llama 2 style file (the `llama` architecture with linear rope scaling), the Gemma 2 one (a window
    shorter than prompt + output, both soft-caps) and the Phi-3 one (fused projections, partial rotation,
    longrope, a window) on our engine give transformers' fp32 greedy tokens on the checkpoint each was
    converted from (as the file reads it back: `spm_gguf.READING`)."""
    _matches_transformers(family, "auto", PROMPTS)


# The Triton interpreter runs each kernel launch in Python: these run with `-m slow` (the suite runs Gemma 2
# on Triton from its checkpoint in test_families, and Gemma 3's GGUF file in test_families_gguf).
@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(spm_gguf.SPACE_PREFIX))
def test_spm_gguf_matches_transformers_on_triton(family):
    _matches_transformers(family, "triton", PROMPTS[:2])


@pytest.mark.parametrize("family", sorted(spm_gguf.SPACE_PREFIX))
def test_spm_gguf_q8_0_kept_quantized_matches_dequantized(family):
    path = str(spm_gguf.gguf_path(family, "q8_0"))
    dense = LLM(model=path, dtype="float32", quantization="none", seed=0)
    prompts = [dense.get_tokenizer().encode(text) for text in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    references = []
    for out in dense.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False):
        top = [sorted((lp.logprob for lp in step.values()), reverse=True) for step in out.outputs[0].logprobs]
        references.append((out.outputs[0].token_ids, [t[0] - t[1] for t in top]))
    del dense
    loaded = load_model(path)
    assert loaded.quantization == "gguf"
    assert not isinstance(dict(loaded.weights)["model.layers.0.self_attn.q_proj.weight"], torch.Tensor)
    llm = LLM(model=path, dtype="float32", seed=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    mismatches, ties = families.compare([o.outputs[0].token_ids for o in outputs], references)
    print(f"{family} SentencePiece GGUF Q8_0: {len(prompts) - len(mismatches) - ties} equal, {ties} ties")
    assert not mismatches, mismatches
    assert_all_blocks_free(llm)
