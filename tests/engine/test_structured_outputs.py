"""Structured outputs on the bundled model: JSON schemas, regexes and choices hold on every output, greedy
and sampled; bad constraints are refused with the field at fault; a grammar that compiles slowly does not
hold up other requests."""

from __future__ import annotations

import json
import random
import re
import threading
import time

import jsonschema
import pytest
import torch

from inference_engine import LLM, SamplingParams
from inference_engine.errors import InvalidRequestError
from inference_engine.sampler import TokenBitmask, apply_token_bitmask
from inference_engine.sampling_params import StructuredOutputsParams

from .conftest import assert_all_blocks_free

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def llm() -> LLM:
    # Dense weights: the quantized path dequantizes per call, and these tests decode a few thousand tokens.
    llm = LLM(quantization="none", dtype="float32", seed=0, max_model_len=1024)
    yield llm
    llm.engine.shutdown()


def _field(rng: random.Random, depth: int) -> dict:
    """One property's schema: every kind bounded, so that an output always fits in max_tokens."""
    kinds = ["string", "enum", "integer", "number", "boolean", "array", "nullable", "const"]
    if depth < 2:
        kinds.append("object")
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(3, 12)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", "low", "high", "yes", "no"], 3)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -1.5, "maximum": rng.choice([1, 2.5, 100])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        items = rng.choice(
            [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["a", "b", "c"]}, {"type": "boolean"}]
        )
        low = rng.randint(0, 2)
        return {"type": "array", "items": items, "minItems": low, "maxItems": low + rng.randint(0, 2)}
    if kind == "nullable":
        return {"type": ["integer", "null"], "minimum": 0, "maximum": 99}
    if kind == "const":
        return {"const": rng.choice(["v1", 7, True])}
    return _object(rng, depth + 1)


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(["id", "name", "colour", "size", "tags", "owner", "score", "ok", "kind", "note"], 3)
    properties = {name: _field(rng, depth) for name in names}
    required = sorted(rng.sample(names, rng.randint(1, len(names))))
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


SCHEMAS = [_object(random.Random(i), 0) for i in range(50)]


def _prompt(llm: LLM, task: str) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": task}])


def _json_requests(llm: LLM, sampled: bool) -> list[tuple[dict, str, str]]:
    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS):
        prompts.append(_prompt(llm, f"Reply with a JSON object matching this schema: {json.dumps(schema)}"))
        sampling = {"temperature": 0.9, "top_p": 0.95, "seed": i} if sampled else {"temperature": 0.0}
        constraint = StructuredOutputsParams(json=schema)
        params.append(SamplingParams(max_tokens=200, structured_outputs=constraint, **sampling))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(s, o.outputs[0].text, o.outputs[0].finish_reason) for s, o in zip(SCHEMAS, outputs, strict=True)]


@pytest.mark.parametrize(
    "sampled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["greedy", "sampled"]
)
def test_fifty_json_schemas_hold(llm, sampled) -> None:
    assert len({json.dumps(s, sort_keys=True) for s in SCHEMAS}) == 50
    for schema, text, reason in _json_requests(llm, sampled):
        assert reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
    assert_all_blocks_free(llm)


def test_fifty_regexes_hold(llm) -> None:
    patterns = [
        r"[0-9]{3}-[0-9]{4}",
        r"(yes|no), because [a-z ]{5,20}\.",
        r"[A-Z][a-z]{2,8} [A-Z][a-z]{2,8}",
        r"#[0-9a-f]{6}",
        r"v[0-9]\.[0-9]{1,2}\.[0-9]{1,2}",
    ]
    cases = [(patterns[i % len(patterns)], i) for i in range(50)]
    prompts = [_prompt(llm, "Give an example of a phone number, a colour, a name or a version.")] * 50
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 1.0,
            seed=i,
            max_tokens=40,
            structured_outputs=StructuredOutputsParams(regex=pattern),
        )
        for pattern, i in cases
    ]
    for (pattern, _), output in zip(cases, llm.generate(prompts, params, use_tqdm=False), strict=True):
        text = output.outputs[0].text
        assert output.outputs[0].finish_reason == "stop" and re.fullmatch(pattern, text), (pattern, text)


def test_fifty_choices_hold(llm) -> None:
    options = [["yes", "no"], ["Paris", "London", "Rome"], ["positive", "negative"], ["a b", "a", "ab"]]
    cases = [options[i % len(options)] for i in range(50)]
    prompts = [_prompt(llm, f"Question {i}: pick one of {cases[i]}.") for i in range(50)]
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 1.5, seed=i, structured_outputs={"choice": choice})
        for i, choice in enumerate(cases)
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    picked = [o.outputs[0].text for o in outputs]
    assert all(text in choice for text, choice in zip(picked, cases, strict=True)), picked
    assert len(set(picked)) > 3  # sampled rows do not all pick the same option


def test_grammar_n_samples_and_json_object(llm) -> None:
    grammar = 'start: "The answer is " ("yes" | "no") "."'
    params = [
        SamplingParams(temperature=1.0, seed=3, n=3, structured_outputs={"grammar": grammar}),
        SamplingParams(temperature=0.0, max_tokens=120, structured_outputs={"json_object": True}),
        SamplingParams(temperature=0.0, structured_outputs={"grammar": 'root ::= "A" | "B"'}),  # GBNF
    ]
    prompts = [_prompt(llm, "Is the sky blue?"), _prompt(llm, 'Reply {"answer": "yes"} in JSON.')] * 2
    outputs = llm.generate(prompts[:3], params, use_tqdm=False)
    assert all(o.text in ("The answer is yes.", "The answer is no.") for o in outputs[0].outputs)
    assert len(outputs[0].outputs) == 3
    assert isinstance(json.loads(outputs[1].outputs[0].text), dict)
    assert outputs[2].outputs[0].text in ("A", "B")


@pytest.mark.parametrize(
    ("constraint", "param"),
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "structured_outputs.json"),
        ({"json": {"type": "array", "uniqueItems": True}}, "structured_outputs.json"),
        ({"regex": "[a-"}, "structured_outputs.regex"),
        ({"grammar": "start: foo"}, "structured_outputs.grammar"),
        ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ],
)
def test_bad_constraints_are_refused_with_their_field(llm, constraint, param) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        llm.generate("Hi", SamplingParams(max_tokens=4, structured_outputs=constraint), use_tqdm=False)
    assert refused.value.param == param
    assert_all_blocks_free(llm)


def test_a_slow_grammar_does_not_hold_up_other_requests(llm, monkeypatch) -> None:
    """Compiling runs on its own thread: while a grammar takes its time, other requests keep decoding, and
    the constrained one starts once its grammar is there."""
    engine = llm.engine
    release = threading.Event()
    build = engine.structured._build

    def slow_build(spec):
        release.wait(30)
        return build(spec)

    monkeypatch.setattr(engine.structured, "_build", slow_build)
    schema = {"type": "object", "properties": {"slow": {"type": "boolean"}}, "required": ["slow"]}
    params = SamplingParams(
        temperature=0.0, structured_outputs={"json": schema, "disable_additional_properties": True}
    )
    engine.add_request("slow", "Reply in JSON:", params)
    engine.add_request("plain", "The capital of France is", SamplingParams(temperature=0.0, max_tokens=8))
    assert engine.preparing("slow")
    finished = {}
    for _ in range(8):  # the plain request finishes while the grammar is still compiling
        finished |= {o.request_id: o for o in engine.step() if o.finished}
    assert "plain" in finished and engine.preparing("slow")
    release.set()
    deadline = time.monotonic() + 60
    while "slow" not in finished and time.monotonic() < deadline:
        finished |= {o.request_id: o for o in engine.step() if o.finished}
    assert json.loads(finished["slow"].outputs[0].text)["slow"] in (True, False)
    assert_all_blocks_free(llm)


def test_constrained_requests_propose_no_drafts(llm) -> None:
    """With n-gram speculation on, constrained sequences decode one token a step (a draft their grammar
    forbids cannot be verified) and give what decoding without speculation gives."""
    schema = {"type": "array", "items": {"enum": ["la", "lo"]}, "maxItems": 12}
    params = SamplingParams(temperature=0.0, max_tokens=80, structured_outputs={"json": schema})
    prompt = "Sing la la la lo la la la lo la la la lo as a JSON list:"
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    speculative = LLM(quantization="none", dtype="float32", speculative_config=ngram)
    text = speculative.generate(prompt, params, use_tqdm=False)[0].outputs[0].text
    assert speculative.engine.proposer.num_draft_tokens == 0
    speculative.engine.shutdown()
    assert text == llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text
    jsonschema.validate(json.loads(text), schema)


def test_token_bitmask_masks_exactly_the_forbidden_tokens() -> None:
    generator = torch.Generator().manual_seed(0)
    vocab = 100
    logits = torch.randn(5, vocab, generator=generator)
    allowed = torch.rand(2, vocab, generator=generator) < 0.3
    bits = torch.zeros(2, (vocab + 31) // 32, dtype=torch.int64)
    for row in range(2):
        for token in allowed[row].nonzero().flatten().tolist():
            bits[row, token // 32] |= 1 << (token % 32)
    bits = bits.to(torch.int32)  # bit 31 wraps to the sign bit, as llguidance writes it
    masked = logits.clone()
    apply_token_bitmask(masked, TokenBitmask([3, 1], bits))
    expected = logits.clone()
    expected[3][~allowed[0]] = float("-inf")
    expected[1][~allowed[1]] = float("-inf")
    assert torch.equal(masked, expected)
