"""Folders written by sentence-transformers' own `save` serve as embedding models with their own pooling: the
bundled model's fp32 weights wrapped in a SentenceTransformer (MEAN pooling; LAST pooling with a Normalize
module), saved, served through LLM(runner="pooling"), and compared with SentenceTransformer.encode of the same
folder. Such a folder holds the decoder's base model (`LlamaModel`, no head) and sentence-transformers'
current Pooling config (`pooling_mode`); encoder-only checkpoints are refused by name.
"""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.embeddings import save_sentence_transformer
from inference_engine import LLM, PoolerConfig
from inference_engine.errors import InvalidRequestError

from . import families
from .conftest import assert_all_blocks_free
from .test_embeddings import KV_BYTES, TEXTS

pytest.importorskip("sentence_transformers")


def _cosines(ours: list[list[float]], theirs: torch.Tensor) -> list[float]:
    a = torch.nn.functional.normalize(torch.tensor(ours, dtype=torch.float64), dim=-1)
    return (a * torch.nn.functional.normalize(theirs.double(), dim=-1)).sum(-1).tolist()


BUNDLED = pytest.mark.slow  # about 540 MB of fp32 weights written and read back per case


@pytest.mark.parametrize(
    ("checkpoint", "mode", "pooling", "normalize"),
    [
        ("qwen3", "lasttoken", "LAST", True),
        ("qwen3", "mean", "MEAN", False),
        pytest.param("bundled", "lasttoken", "LAST", True, marks=BUNDLED),
        pytest.param("bundled", "mean", "MEAN", False, marks=BUNDLED),
    ],
)
def test_a_saved_sentence_transformers_folder_matches_its_encode(
    request, tmp_path, checkpoint, mode, pooling, normalize
) -> None:
    """The bundled model's fp32 weights (with -m slow), and by default a tiny random Qwen3 (Qwen3-Embedding's
    architecture, its head untied: a saved base model has none)."""
    source = request.getfixturevalue("hf_folder") if checkpoint == "bundled" else families.folder(checkpoint)
    folder = tmp_path / "saved"
    model = save_sentence_transformer(source, folder, mode, normalize)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [{"qwen3": "Qwen3Model"}.get(checkpoint, "LlamaModel")]  # no head
    expected = model.encode(TEXTS, batch_size=len(TEXTS), convert_to_tensor=True)
    llm = LLM(str(folder), dtype="float32", runner="pooling", kv_cache_memory_bytes=KV_BYTES)
    assert llm.engine.pooler.config == PoolerConfig(pooling, normalize, None)
    outs = llm.embed(TEXTS, use_tqdm=False)
    lengths = [len(o.prompt_token_ids) for o in outs]
    assert min(lengths) >= 5 and max(lengths) <= 300, lengths
    assert lengths == model.preprocess(TEXTS)["attention_mask"].sum(1).tolist()  # the same tokens each
    vectors = [o.outputs.embedding for o in outs]
    assert min(_cosines(vectors, expected)) >= 0.9999
    norms = torch.tensor(vectors).norm(dim=-1)
    if normalize:
        assert torch.allclose(norms, torch.ones_like(norms), atol=1e-5)
    else:  # unnormalised: the same length as sentence-transformers' vector too
        assert torch.allclose(norms, expected.norm(dim=-1), rtol=1e-3)
    assert_all_blocks_free(llm)
    if checkpoint == "qwen3":  # untied and headless: its logits would be wrong, so it may not generate
        del llm
        with pytest.raises(InvalidRequestError, match=r"without a language-model head.*use runner 'pooling'"):
            LLM(str(folder), dtype="float32", kv_cache_memory_bytes=KV_BYTES)


def test_encoder_only_checkpoints_are_refused_by_name(tmp_path) -> None:
    """A BERT checkpoint (BGE, E5 and GTE's small models are BERTs) is refused before its weights are read."""
    bert = {"architectures": ["BertModel"], "model_type": "bert", "is_decoder": False, "hidden_size": 384}
    (tmp_path / "config.json").write_text(json.dumps(bert))
    with pytest.raises(ValueError, match=r"BertModel \(model_type 'bert'\) is an encoder-only model"):
        LLM(str(tmp_path), runner="pooling")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "xlm-roberta"}))
    with pytest.raises(ValueError, match=r"xlm-roberta.*encoder-only"):
        LLM(str(tmp_path), runner="pooling")
