"""oneDNN-prepacked bf16 weights give exactly the plain layers' results, for every linear layer kind."""

import pytest
import torch

from inference_engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from inference_engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    prepacking_works,
)

pytestmark = pytest.mark.skipif(
    not prepacking_works(torch.bfloat16), reason="this PyTorch build has no oneDNN prepacked linear"
)


def _randomise(module: torch.nn.Module, gen: torch.Generator) -> torch.nn.Module:
    for param in module.parameters():
        param.data = torch.randn(param.shape, generator=gen).to(torch.bfloat16)
    return module


@pytest.mark.parametrize(
    "make",
    [
        lambda: QKVParallelLinear(96, 16, 6, 2, bias=True),
        lambda: MergedColumnParallelLinear(96, [160, 160]),
        lambda: RowParallelLinear(160, 96, bias=True),
        lambda: RowParallelLinear(96, 96),
    ],
    ids=["qkv-with-bias", "gate-up", "row-with-bias", "row"],
)
@pytest.mark.parametrize("rows", [1, 7, 33, 300])
def test_prepacked_layer_equals_plain(make, rows):
    gen = torch.Generator().manual_seed(rows)
    layer = _randomise(make(), gen)
    x = torch.randn(rows, layer.weight.shape[1], generator=gen).to(torch.bfloat16)
    plain = layer(x)
    layer.prepack()
    assert layer.prepacked
    assert torch.equal(layer(x), plain)


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("rows", [9, 26])
@pytest.mark.parametrize("tied", [True, False])
def test_prepacked_lm_head_equals_plain_and_a_tied_embedding_still_looks_up(tied, rows, padded):
    """Whether padding pays is timed per CPU (padding_pays), so both ways are forced here."""
    gen = torch.Generator().manual_seed(int(tied))
    embed = _randomise(VocabParallelEmbedding(1000, 64), gen)
    head = ParallelLMHead(1000, 64)
    if tied:
        head.weight, head.tied = embed.weight, True
    else:
        _randomise(head, gen)
    hidden = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([0, 5, 999])
    plain_logits, plain_rows = head(hidden), embed(ids)
    head.prepack()
    assert head.packed is not None
    head.padded_steps = range(17, 33) if padded else range(0)
    assert torch.equal(head(hidden), plain_logits)
    assert torch.equal(embed(ids), plain_rows)


def test_runner_times_the_prompt_attention_path_at_start_up(monkeypatch):
    """Timed while the engine starts, with the model's head shapes, not in the first long prompt's step."""
    from inference_engine import LLM, model_runner

    calls = []
    monkeypatch.setattr(model_runner, "native_query_max", lambda *shape: calls.append(shape) or 32)
    LLM(dtype="bfloat16", kv_cache_memory_bytes=1 << 24)
    assert calls == [(9, 3, 64, torch.bfloat16, torch.get_num_threads())]
