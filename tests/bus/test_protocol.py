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
    assert P.parse(P.encode(message)) == P.Generate("r1", {"n": 2}, prompt="hé")
    with pytest.raises(EngineOverloadedError, match="busy"):
        raise P.parse(P.encode(P.Error.of(EngineOverloadedError("busy")))).exception()
    with pytest.raises(InvalidRequestError):
        raise P.parse(P.encode(P.Error.of(InvalidRequestError("bad")))).exception()


@pytest.mark.parametrize(
    "message",
    [
        P.Generate("r", {"max_tokens": 3}, messages=[{"role": "user", "content": "hi"}], priority=10),
        P.Generate("r", {}, prompt_token_ids=[1, 2], arrival_time=1.5),
        P.Tokenize("t", prompt="abc"),
        P.Detokenize("d", [5, 6]),
        P.Ack(4, "rep"),
        P.Delta([{"index": 0, "text": "a", "token_ids": [1], "logprobs": None}], "rep"),
        P.Final([{"index": 0, "finish_reason": "stop", "stop_reason": None}], {"prompt_tokens": 1}, "rep"),
        P.Error("overloaded", "busy"),
        P.Result(token_ids=[1], count=1, max_model_len=512),
        P.Result(text="x"),
        P.Load("m", None, {"max_num_seqs": 4}),
        P.Unload("m"),
    ],
)
def test_every_message_type_roundtrips(message):
    """Server and client speak through these classes; None fields stay off the wire."""
    assert P.parse(P.encode(message)) == message
    assert None not in P.decode(P.encode(message)).values()


def test_unknown_message_type_is_refused():
    with pytest.raises(ValueError, match="unknown bus message type"):
        P.parse(P.encode({"type": "nonsense"}))


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
    assert first == [P.Delta([{"index": 0, "text": "He", "token_ids": [1], "logprobs": None}], "rep")]
    assert tracker.messages(_output(["He", ""], [[1], []]), "rep") == []
    delta, final = tracker.messages(_output(["Hello", "x"], [[1, 2], [9]], finished=True), "rep")
    assert [o["text"] for o in delta.outputs] == ["llo", "x"]
    assert final.usage == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
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
