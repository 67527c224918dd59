"""Fixtures for engine tests: the bundled model under our engine and under Hugging Face transformers.

Correctness is judged against transformers: same GGUF file, dequantized by its own GGUF code, fp32, greedy.
That dequantization runs once per machine and is kept as a safetensors folder
(`quant_checkpoints.dense_folder`, which the quantized-checkpoint tests start from too).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from inference_engine import LLM, SamplingParams
from inference_engine.model_loader import default_model_path

from .quant_checkpoints import cached_json, dense_folder, dense_model

THREADS = int(os.environ.get("LLMSERVE_TEST_THREADS", "2"))
CACHE = Path(os.environ.get("LLMSERVE_CACHE", Path.home() / ".cache" / "llmserve")) / "test-references"

# Varied prompts: short and long, a shared prefix (longer than one block), Chinese, code, a chat turn.
SHARED = (
    "You are reviewing a pull request for a web service written in Python. The change adds caching to "
    "the user profile endpoint and a background job that refreshes it. "
)
PROMPTS = [
    "The capital of France is",
    "Hi",
    "Once upon a time, in a small village by the sea,",
    SHARED + "Summarise the change in one sentence:",
    SHARED + "List two risks of this change:",
    SHARED + "Should the reviewer approve it? Answer:",
    "请用中文介绍一下大语言模型推理中的KV缓存。",
    "人工智能是",
    "def quicksort(arr):\n    ",
    "import numpy as np\n\n# compute the moving average of a 1-D array\ndef moving_average(x, w):",
    "SELECT name, COUNT(*) FROM orders",
    "1, 1, 2, 3, 5, 8, 13,",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "The three primary colours are",
    "Translate to French: 'Good morning, how are you?' ->",
    " ".join(["The quick brown fox jumps over the lazy dog."] * 6) + " Count the foxes:",
]
MAX_TOKENS = 32


@pytest.fixture(autouse=True, scope="session")
def _threads():
    torch.set_num_threads(THREADS)


@pytest.fixture(scope="session")
def hf_greedy(llm: LLM) -> dict[tuple[int, ...], list[int]]:
    """Hugging Face greedy continuations of PROMPTS (tokenised by our engine), one prompt at a time."""
    pytest.importorskip("transformers")
    return hf_greedy_continuations(llm.get_tokenizer())


def hf_greedy_continuations(tokenizer) -> dict[tuple[int, ...], list[int]]:
    """A minute of transformers on a 2-core CPU, so the result is kept once per machine, under a key of
    everything it depends on: the model file's bytes, the prompts' token ids, the token count and the
    transformers and torch versions."""
    import transformers

    prompt_ids = [tokenizer.encode(prompt) for prompt in PROMPTS]
    key = hashlib.sha256(default_model_path().read_bytes())
    key.update(json.dumps([prompt_ids, MAX_TOKENS, transformers.__version__, torch.__version__]).encode())

    def compute() -> list[list[int]]:
        model = dense_model()
        outputs = []
        with torch.inference_mode():
            for ids in prompt_ids:
                out = model.generate(
                    torch.tensor([ids]),
                    max_new_tokens=MAX_TOKENS,
                    do_sample=False,
                    eos_token_id=tokenizer.eos_token_ids,
                    pad_token_id=tokenizer.eos_token_id,
                )
                outputs.append(out[0, len(ids) :].tolist())
        return outputs

    outputs = cached_json(CACHE / f"hf-greedy-{key.hexdigest()[:16]}.json", compute)
    return {tuple(ids): out for ids, out in zip(prompt_ids, outputs, strict=True)}


def greedy(max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} KV blocks leaked"
    assert all(count == 0 for count in bm.ref_counts)
    assert not llm.engine.has_unfinished_requests()


@pytest.fixture(scope="session")
def llm() -> LLM:
    """The default fp32 engine, shared by tests that do not depend on its configuration."""
    return LLM(dtype="float32", seed=0)


@pytest.fixture(scope="session")
def hf_folder():
    """The bundled model as a Hugging Face folder written by transformers (config.json, safetensors), built
    once per machine and cached (see quant_checkpoints)."""
    pytest.importorskip("transformers")
    return dense_folder()


@pytest.fixture
def clean_llm(llm: LLM):
    yield llm
    assert_all_blocks_free(llm)
