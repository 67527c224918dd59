"""Acceptance: schemathesis drives every endpoint of the published OpenAPI document against daphne and the
engine, with valid and invalid inputs: no 5xx, every error body in OpenAI's shape, every answer as the
document describes it. Bounded: a few examples per operation and method, small generations."""

from __future__ import annotations

import time

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import response_schema_conformance  # noqa: E402

pytestmark = pytest.mark.timeout(300)

EXAMPLES = 6  # per operation and generation mode
BUDGET = 60.0  # seconds for the whole run, shared by operation and mode (each gets one example at least)
# Generation lengths the fuzzer chose are capped, absent ones set.
LENGTH_FIELDS = {
    "/v1/completions": "max_tokens",
    "/v1/chat/completions": "max_tokens",
    "/v1/responses": "max_output_tokens",
}


def openai_error_shape(ctx, response, case) -> None:
    """Every refusal is ``{"error": {"message", "type", "param", "code"}}`` with a JSON content type."""
    if response.status_code < 400:
        return
    assert response.headers.get("content-type", [""])[0].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def _prepared(case, mode, model: str) -> None:
    """Valid requests name the served model (else all of them end at 404), with bounded generations."""
    if not isinstance(case.body, dict):
        return
    if mode is GenerationMode.POSITIVE and "model" in case.body:
        case.body["model"] = model
    field = LENGTH_FIELDS.get(case.operation.path)
    if field is None:
        return
    length = case.body.get(field)
    if length is None or (isinstance(length, int) and not isinstance(length, bool) and length > 4):
        case.body[field] = 4
    n = case.body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 2:
        case.body["n"] = 2


def _fuzz(operation, mode, stack, headers: dict[str, str], seen: dict[str, set[int]], until: float) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def run(case) -> None:
        if operation.label in seen and time.monotonic() > until:
            return
        _prepared(case, mode, stack.model)
        response = case.call(base_url=stack.base_url, headers=headers, timeout=60)
        seen.setdefault(operation.label, set()).add(response.status_code)
        case.validate_response(
            response, checks=[not_a_server_error, openai_error_shape, response_schema_conformance]
        )

    try:
        run()
    except Unsatisfiable:
        assert mode is GenerationMode.NEGATIVE  # an operation with no input has no invalid input


def test_every_endpoint_against_the_openapi_document(stack) -> None:
    key = stack.manage("llmserve_createkey", "fuzzer", "--rate-limit", "0").strip()
    schema = schemathesis.openapi.from_url(stack.base_url + "/openapi.json")
    headers = {"Authorization": f"Bearer {key}"}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 19
    seen: dict[str, set[int]] = {}
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz(operation, mode, stack, headers, seen, time.monotonic() + BUDGET / (2 * len(operations)))
    assert len(seen) == len(operations)
    assert stack.engine.poll() is None and stack.daphne.poll() is None
