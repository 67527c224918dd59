import subprocess
import sys

import pytest

from inference_engine.bus import protocol as P
from inference_engine.bus.deltas import DeltaTracker
from inference_engine.errors import EngineOverloadedError, InvalidRequestError
from inference_engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def test_roundtrip_and_typed_errors():
    message = {"type": P.GENERATE, "id": "r1", "prompt": "hé", "params": {"n": 2}}
    assert P.decode(P.encode(message)) == message
    assert P.decode({P.FIELD.encode(): P.encode(message)[P.FIELD].encode()}) == message
    with pytest.raises(EngineOverloadedError, match="busy"):
        P.raise_error(P.error_message(EngineOverloadedError("busy")))
    with pytest.raises(InvalidRequestError):
        P.raise_error(P.error_message(InvalidRequestError("bad")))


def test_logprobs_roundtrip():
    logprobs = [{5: Logprob(-0.1, 1, "a"), 7: Logprob(-2.5, 2, "b")}]
    assert P.decode_logprobs(P.encode_logprobs(logprobs)) == logprobs


def _output(texts, tokens, finished=False):
    outs = [
        CompletionOutput(i, t, ids, finish_reason="stop" if finished else None)
        for i, (t, ids) in enumerate(zip(texts, tokens, strict=True))
    ]
    return RequestOutput("r", None, [1, 2, 3], outs, finished, RequestMetrics(0.0))


def test_delta_tracker_sends_each_token_once():
    tracker = DeltaTracker(prompt_tokens=3)
    first = tracker.messages(_output(["He", ""], [[1], []]), "rep")
    assert first == [
        {
            "type": P.DELTA,
            "replica": "rep",
            "outputs": [{"index": 0, "text": "He", "token_ids": [1], "logprobs": None}],
        }
    ]
    assert tracker.messages(_output(["He", ""], [[1], []]), "rep") == []
    delta, final = tracker.messages(_output(["Hello", "x"], [[1, 2], [9]], finished=True), "rep")
    assert [o["text"] for o in delta["outputs"]] == ["llo", "x"]
    assert final["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    decoded = P.delta_from_message("r", final)
    assert decoded.finished and [o.finish_reason for o in decoded.outputs] == ["stop", "stop"]


def test_client_and_protocol_do_not_import_torch():
    code = (
        "import sys; import inference_engine.bus.client, inference_engine.bus.protocol, "
        "inference_engine.sampling_params; "
        "assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
