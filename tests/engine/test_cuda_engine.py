"""The engine on a CUDA GPU against transformers on the same GPU: a random Llama of the bundled model's
shapes (few layers), greedy, several engines in one process. fp32 gives the same tokens, with CUDA graphs
and without, with n-gram speculation and with int8 weights (against transformers on the same dequantized
weights); bf16 may depart from transformers' bf16 only at a near tie. The device sampler's seeds,
penalties, logit bias and structured outputs run on the GPU too. Skipped without a GPU;
`benchmarks/gpu_check.py` runs it where one is lent."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.random_llama import byte_level_tokenizer, write_random_llama
from inference_engine import LLM, SamplingParams
from llmserve_kernels.quantized import Int8Weight

from .conftest import assert_all_blocks_free, greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEVICE = "cuda"
PROMPTS = ["The quick brown fox", "Paged attention stores", "def main():", "请用中文", "blocks" * 40]
NEW_TOKENS = 16
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "disable_by_batch_size": None,
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The final norm scaled down so that the top tokens' logits sit a few nats apart: sampling then has
    choices, logprobs carry information, and fp32 greedy decoding still has no near ties."""
    folder = write_random_llama(
        tmp_path_factory.mktemp("cuda-model"), heads=9, kv_heads=3, layers=4, tokenizer=byte_level_tokenizer()
    )
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"] *= 0.01
    save_file(weights, folder / "model.safetensors")
    return folder


def _engine(folder, **kwargs) -> LLM:
    """Each engine takes 5 % of the device: several live in this process at once."""
    kwargs = {"dtype": "float32", "gpu_memory_utilization": 0.05, **kwargs}
    return LLM(model=str(folder), device=DEVICE, max_num_seqs=8, **kwargs)


def _transformers(folder, dtype: torch.dtype):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(DEVICE).eval()


def _hf_generate(model, ids: list[int]):
    with torch.inference_mode():
        return model.generate(
            torch.tensor([ids], device=DEVICE),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            output_scores=True,
            return_dict_in_generate=True,
        )


def _hf_greedy(model, tokenizer) -> list[tuple[list[int], torch.Tensor]]:
    """Each prompt's greedy tokens and the log-probabilities of every token at each step."""
    outputs = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        out = _hf_generate(model, ids)
        logprobs = torch.cat(out.scores).float().log_softmax(-1).cpu()
        outputs.append((out.sequences[0, len(ids) :].tolist(), logprobs))
    return outputs


@pytest.fixture(scope="module")
def hf_fp32(folder):
    return _transformers(folder, torch.float32)


@pytest.fixture(scope="module")
def expected(hf_fp32, llm):
    return _hf_greedy(hf_fp32, llm.get_tokenizer())


@pytest.fixture(scope="module")
def llm(folder) -> LLM:
    """fp32 with CUDA graphs: the configuration the sampler and structured-output tests share."""
    return _engine(folder)


def _assert_greedy_equals(llm: LLM, expected: list[tuple[list[int], torch.Tensor]]) -> None:
    """The same tokens, and the top 3 tokens' logprobs within fp32 rounding of transformers' at every step
    (the tokens alone could hide an attention error that leaves each argmax in place)."""
    outputs = llm.generate(PROMPTS, greedy(NEW_TOKENS, ignore_eos=True, logprobs=3), use_tqdm=False)
    for prompt, out, (tokens, logprobs) in zip(PROMPTS, outputs, expected, strict=True):
        assert out.outputs[0].token_ids == tokens, prompt
        for step, top in enumerate(out.outputs[0].logprobs):
            for token, ours in top.items():
                assert ours.logprob == pytest.approx(logprobs[step, token].item(), abs=1e-3), (prompt, step)
    assert_all_blocks_free(llm)


def test_engine_with_cuda_graphs_equals_transformers(llm, expected):
    assert llm.llm_engine.runner.graphs is not None
    _assert_greedy_equals(llm, expected)


def test_eager_engine_equals_transformers(folder, expected, llm):
    eager = _engine(folder, enforce_eager=True)
    assert eager.llm_engine.runner.graphs is None
    _assert_greedy_equals(eager, expected)
    # Its share of the device, as large as the first engine's: that engine's cache is not charged to it.
    assert eager.llm_engine.runner.num_blocks >= 0.9 * llm.llm_engine.runner.num_blocks


def test_ngram_speculation_on_cuda_keeps_greedy_outputs(folder, expected):
    llm = _engine(folder, speculative_config=NGRAM)
    _assert_greedy_equals(llm, expected)
    assert llm.llm_engine.proposer.num_draft_tokens > 0


def test_int8_weights_on_cuda_equal_transformers_on_the_dequantized_weights(folder, hf_fp32):
    """int8 goes through the Triton dequantize-and-multiply kernel (IEEE fp32 dots): the reference is the
    same per-channel int8 weights, dequantized into transformers' model."""
    llm = _engine(folder, quantization="int8")
    reference = _transformers(folder, torch.float32)
    with torch.no_grad():
        for module in reference.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(Int8Weight.quantize(module.weight.cpu()).dequantize())
    _assert_greedy_equals(llm, _hf_greedy(reference, llm.get_tokenizer()))


def test_bf16_departs_from_transformers_bf16_only_at_a_near_tie(folder):
    """bf16 sums in another order than cuBLAS's, so the argmax may flip where two tokens are within
    rounding; where the outputs first differ, each side's token must be in the other's top 5."""
    llm = _engine(folder, dtype="bfloat16")
    model = _transformers(folder, torch.bfloat16)
    tokenizer = llm.get_tokenizer()
    outputs = llm.generate(PROMPTS, greedy(NEW_TOKENS, ignore_eos=True, logprobs=5), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ids = tokenizer.encode(prompt)
        hf = _hf_generate(model, ids)
        theirs = hf.sequences[0, len(ids) :].tolist()
        ours = out.outputs[0].token_ids
        for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            if a != b:
                assert a in hf.scores[step][0].topk(5).indices.tolist(), (prompt, step)
                assert b in out.outputs[0].logprobs[step], (prompt, step)
                break
    assert_all_blocks_free(llm)


def test_seeded_sampling_on_the_device_repeats_and_honours_its_parameters(llm):
    def params(seed: int, **kwargs) -> SamplingParams:
        return SamplingParams(
            temperature=2.0,
            top_p=0.9,
            top_k=50,
            min_p=0.02,
            repetition_penalty=1.2,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            seed=seed,
            max_tokens=NEW_TOKENS,
            ignore_eos=True,
            logprobs=3,
            **kwargs,
        )

    first = llm.generate(PROMPTS, [params(7)] * len(PROMPTS), use_tqdm=False)
    # Alone, then beside other requests: a seeded request draws the same tokens whatever shares its batch.
    again = llm.generate(PROMPTS[:1], params(7), use_tqdm=False)[0]
    other = llm.generate(PROMPTS, [params(8)] * len(PROMPTS), use_tqdm=False)
    assert again.outputs[0].token_ids == first[0].outputs[0].token_ids
    assert [o.outputs[0].token_ids for o in other] != [o.outputs[0].token_ids for o in first]
    for out in first:
        for chosen, top in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True):
            assert chosen in top and all(-1e9 < p.logprob <= 0 for p in top.values())

    forced = llm.generate(PROMPTS[:2], params(1, logit_bias={5: 100.0}), use_tqdm=False)
    assert all(set(o.outputs[0].token_ids) == {5} for o in forced)
    assert_all_blocks_free(llm)


def test_structured_outputs_on_the_device(llm):
    pattern = r"[a-c]{3}-[0-9]{2}"
    outputs = llm.generate(
        PROMPTS,
        [
            SamplingParams(
                temperature=1.0, seed=i, max_tokens=NEW_TOKENS, structured_outputs={"regex": pattern}
            )
            for i in range(len(PROMPTS))
        ],
        use_tqdm=False,
    )
    for out in outputs:
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
    assert_all_blocks_free(llm)
