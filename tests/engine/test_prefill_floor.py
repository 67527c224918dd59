"""benchmarks/latency.py's prefill floor: its count of a prompt's arithmetic against PyTorch's own count of a
Hugging Face forward of the bundled model's architecture (eager attention, logits of the last token only)."""

import dataclasses

import pytest
import torch

from benchmarks.latency import prefill_flops


@pytest.mark.parametrize("tokens", [1, 30, 100])
def test_prefill_flops_match_a_counted_transformers_forward(llm, tokens):
    transformers = pytest.importorskip("transformers")
    from torch.utils.flop_counter import FlopCounterMode

    # Two layers: the count is per layer, and a whole model's forward would only take longer.
    config = dataclasses.replace(llm.engine.runner.model_config, num_hidden_layers=2)
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        tie_word_embeddings=config.tie_word_embeddings,
    )
    model = transformers.LlamaForCausalLM(hf_config).eval()
    model.config._attn_implementation = "eager"  # attention as two batched matmuls over every pair
    ids = torch.randint(0, config.vocab_size, (1, tokens))
    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        model(ids, logits_to_keep=1)
    counts = counter.get_flop_counts()["Global"]
    aten = torch.ops.aten
    ours = prefill_flops(config, tokens)
    assert ours["linear"] + ours["head"] == counts[aten.mm] + counts.get(aten.addmm, 0)
    # Eager attention scores every pair and masks the later ones; a prompt's own needs only the causal half.
    assert ours["attention"] == pytest.approx(counts[aten.bmm] * (tokens + 1) / (2 * tokens), rel=1e-12)
