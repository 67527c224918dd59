"""Constraints llguidance cannot bound: refused before anything runs (sizes, ``$ref`` cycles: in microseconds,
on the web tier), or by the engine once its matcher shows that no output satisfies them (through the bus's
error path, so the web tier still answers 400); and a constrained output that ends outside its grammar never
reports ``stop``."""

from __future__ import annotations

import time

import pytest

from inference_engine.errors import InvalidRequestError
from inference_engine.sampler import SampleResult
from inference_engine.sampling_params import SamplingParams, StructuredOutputsParams
from inference_engine.stop_rules import append_token
from inference_engine.structured_outputs.grammars import check
from tests.bus.conftest import client, engine, prefix, raw_redis, redis_server, serve, wait_idle  # noqa: F401

MODEL = "smol"


@pytest.mark.parametrize(
    ("constraint", "said"),
    [
        ({"json": {"$ref": "#"}}, "only leads back to itself"),
        (
            {
                "json": {
                    "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                    "$ref": "#/$defs/a",
                }
            },
            "only leads back to itself",
        ),
        ({"json": {"anyOf": [{"const": f"v{i}"} for i in range(5000)]}}, "5000 alternatives"),
        ({"json": {"enum": list(range(1001))}}, "1001 alternatives"),
        ({"choice": [f"value {i}" for i in range(100_000)]}, "the limit is 1000"),
        ({"regex": "x" * 130_000}, "the limit is 120000"),
        (
            {"json": {"type": "object", "properties": {f"p{i}": {} for i in range(3000)}}},
            "3000 object properties",
        ),
        ({"json": {"type": "array", "items": {"$ref": "#/$defs/missing"}}}, "invalid JSON schema"),
    ],
)
def test_constraints_beyond_budget_are_refused_at_once(constraint, said) -> None:
    started = time.perf_counter()
    with pytest.raises(InvalidRequestError) as refused:
        check(StructuredOutputsParams(**constraint))
    took = time.perf_counter() - started
    assert said in str(refused.value), refused.value
    assert refused.value.param == f"structured_outputs.{next(iter(constraint))}"
    assert "<state>" not in str(refused.value) and "\n" not in str(refused.value)
    assert took < 1.0, f"{took:.2f}s"  # validating 100,000 choices took seconds before the budget


def test_a_recursive_schema_with_no_finite_value_is_refused_by_the_engine(serve, client, engine) -> None:  # noqa: F811
    """Through `allOf` the cycle passes the web tier's check; the engine's first mask shows that nothing can
    match, and the client gets the refusal before any token."""
    serve()
    params = SamplingParams(max_tokens=16, structured_outputs={"json": {"allOf": [{"$ref": "#"}]}})
    with pytest.raises(InvalidRequestError) as refused:
        client.generate(MODEL, "Reply in JSON:", params)
    assert refused.value.param == "structured_outputs.json"
    assert "no output can satisfy it" in str(refused.value)
    wait_idle(engine)


def test_an_end_of_sequence_outside_the_grammar_is_not_a_stop(engine) -> None:  # noqa: F811
    """The sampler's masks allow an end-of-sequence token only where the grammar is complete, or where its
    matcher failed: such an ending is reported as ``length`` (cut short), never ``stop``."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = SamplingParams(max_tokens=8, structured_outputs={"json": schema})
    engine.add_request("eos-outside", "Reply in JSON:", params)
    try:
        deadline = time.monotonic() + 30
        while engine.preparing("eos-outside"):
            assert time.monotonic() < deadline
            engine.step()
        (seq,) = engine.groups["eos-outside"].seqs
        assert seq.grammar is not None and not seq.grammar.is_accepting
        eos = engine.tokenizer.eos_token_id
        append_token(seq, SampleResult(eos, 0.0, None), engine.tokenizer.eos_token_ids, engine.max_model_len)
        assert seq.finish_reason == "length"
    finally:
        engine.abort_request("eos-outside")
    wait_idle(engine)
