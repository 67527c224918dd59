"""Acceptance: lm-evaluation-harness's ``local-completions`` model, unmodified, with its remote tokenizer,
against daphne and the engine (fp32): a multiple-choice task from a JSON file written here and a
generate_until task. The loglikelihoods it computes match transformers' on the same model in fp32."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.engine.quant_checkpoints import dense_model

pytestmark = pytest.mark.timeout(600)

QUESTIONS = [
    ("The capital of France is", ["Paris", "Berlin", "a banana", "the ocean"], 0),
    ("Two plus two equals", ["four", "seven", "blue", "Tuesday"], 0),
    ("The colour of the clear daytime sky is", ["green", "blue", "loud", "square"], 1),
    ("Water freezes at zero degrees", ["Celsius", "Fahrenheit", "Kelvin", "north"], 0),
]
GENERATE = [
    ("Q: What is the capital of France?\nA:", "Paris"),
    ("Q: How many legs does a cat have?\nA:", "4"),
]


def _write_tasks(folder: Path) -> None:
    (folder / "mc.json").write_text(
        "\n".join(json.dumps({"question": q, "choices": c, "answer": a}) for q, c, a in QUESTIONS)
    )
    (folder / "gen.json").write_text("\n".join(json.dumps({"question": q, "answer": a}) for q, a in GENERATE))
    (folder / "llmserve_mc.yaml").write_text(
        f"""task: llmserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "mc.json"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
"""
    )
    (folder / "llmserve_gen.yaml").write_text(
        f"""task: llmserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "gen.json"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  temperature: 0
metric_list:
  - metric: exact_match
"""
    )


@pytest.fixture(scope="module")
def hf_model():
    """The bundled model as transformers dequantizes its GGUF file, from the safetensors copy kept once per
    machine (transformers' own GGUF loading takes some 20 s a time on a 2-core CPU)."""
    pytest.importorskip("transformers")
    torch.set_num_threads(1)  # other processes (engine, daphne) share the cores
    return dense_model()


def _hf_loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([context + continuation])
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), -1)
    positions = range(len(context) - 1, len(context) + len(continuation) - 1)
    return sum(float(logprobs[p, t]) for p, t in zip(positions, continuation, strict=True))


def test_lm_eval_local_completions(stack, tmp_path, monkeypatch, hf_model) -> None:
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", stack.api_key)  # local-completions sends it as the bearer token
    _write_tasks(tmp_path)
    lm = get_model("local-completions")(
        base_url=stack.base_url + "/v1/completions",
        model=stack.model,
        tokenizer_backend="remote",
        auth_token=stack.api_key,
        batch_size=4,  # lists of prompts (token ids) in one request
        max_length=512,
        max_retries=1,
    )
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=["llmserve_mc", "llmserve_gen"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True,
    )

    mc = results["samples"]["llmserve_mc"]
    assert len(mc) == len(QUESTIONS)
    pairs = [
        (args[0], args[1], resp[0][0])
        for s in mc
        for args, resp in zip(s["arguments"], s["resps"], strict=True)
    ]
    assert len(pairs) == sum(len(c) for _, c, _ in QUESTIONS)
    for context, continuation, loglikelihood in pairs:
        context_ids, continuation_ids = lm._encode_pair(context, continuation)
        expected = _hf_loglikelihood(hf_model, context_ids, continuation_ids)
        assert math.isfinite(loglikelihood)
        # The engine serves the file quantized: its fp32 kernels round activations to 16 bits per block of
        # 32, some 1e-4 of a logit, which shows in unlikely continuations (' a banana': about -19.4).
        tolerance = 1e-3 * len(continuation_ids) + 2e-4 * abs(expected)
        assert abs(loglikelihood - expected) <= tolerance, (context, continuation)
    assert results["results"]["llmserve_mc"]["acc,none"] >= 0.5  # a 135M model knows some of these

    generated = results["samples"]["llmserve_gen"]
    assert len(generated) == len(GENERATE)
    texts = [s["resps"][0][0] for s in generated]
    assert all(isinstance(t, str) and "\n" not in t for t in texts)
    assert any(t.strip() for t in texts)
