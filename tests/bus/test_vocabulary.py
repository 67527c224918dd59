"""Token ids a request names (logit_bias keys) are checked against the model's vocabulary by the engine, the
only part that knows it, and refused through the bus's error path: the web tier answers 400 naming the field
before streaming anything."""

from __future__ import annotations

import pytest

from inference_engine.errors import InvalidRequestError
from inference_engine.sampling_params import SamplingParams

from .conftest import MODEL, wait_idle


@pytest.mark.parametrize("token", [49152, 10**9, -1])
def test_logit_bias_outside_the_vocabulary_is_refused(serve, client, engine, token) -> None:
    serve()
    with pytest.raises(InvalidRequestError) as refused:
        client.generate(MODEL, "Hello", SamplingParams(max_tokens=2, logit_bias={token: 5.0}))
    assert refused.value.param == "logit_bias" and str(token) in str(refused.value)
    wait_idle(engine)


def test_logit_bias_inside_the_vocabulary_still_works(serve, client, engine) -> None:
    serve()
    last = engine.tokenizer.vocab_size - 1
    result = client.generate(MODEL, "Hello", SamplingParams(max_tokens=2, logit_bias={last: 100.0})).result()
    assert result.outputs[0].token_ids == [last, last]
    wait_idle(engine)
