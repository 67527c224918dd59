"""The engine on a CUDA GPU against transformers on the same GPU: same random Llama (the bundled model's
shapes, few layers), fp32, greedy, the same tokens, with CUDA graphs and without. Skipped without a GPU;
`benchmarks/gpu_check.py` runs it where one is lent."""

from __future__ import annotations

import pytest
import torch

from benchmarks.random_llama import byte_level_tokenizer, write_random_llama
from inference_engine import LLM

from .conftest import assert_all_blocks_free, greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = ["The quick brown fox", "Paged attention stores", "def main():", "请用中文", "blocks" * 40]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_random_llama(
        tmp_path_factory.mktemp("cuda-model"), heads=9, kv_heads=3, layers=4, tokenizer=byte_level_tokenizer()
    )


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_engine_on_cuda_equals_transformers(folder, enforce_eager):
    import transformers

    llm = LLM(model=str(folder), dtype="float32", device="cuda", enforce_eager=enforce_eager, max_num_seqs=8)
    assert (llm.llm_engine.runner.graphs is None) == enforce_eager
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    tokenizer = llm.get_tokenizer()
    outputs = llm.generate(PROMPTS, greedy(16, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ids = tokenizer.encode(prompt)
        with torch.inference_mode():
            expected = model.generate(
                torch.tensor([ids], device="cuda"), max_new_tokens=16, do_sample=False, eos_token_id=None
            )[0, len(ids) :].tolist()
        assert out.outputs[0].token_ids == expected, prompt
    assert_all_blocks_free(llm)
