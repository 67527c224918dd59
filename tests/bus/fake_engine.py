"""A torch-free stand-in with `LLMEngine`'s interface, so the bus can be tested without a model."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from inference_engine.errors import EngineOverloadedError, InvalidRequestError
from inference_engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from inference_engine.sampling_params import SamplingParams


class FakeTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


@dataclass
class FakeConfig:
    max_num_seqs: int = 8
    max_model_len: int = 64
    max_pending_requests: int = 100


@dataclass
class _Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    generated: list[list[int]]


class FakeEngine:
    """Emits one letter per step per sequence, derived from the prompt: deterministic and checkable."""

    model_name = "fake"

    def __init__(self, step_delay: float = 0.005, **config) -> None:
        self.config = FakeConfig(**config)
        self.max_model_len = self.config.max_model_len
        self.tokenizer = FakeTokenizer()
        self.step_delay = step_delay
        self.requests: dict[str, _Req] = {}
        self.started: list[str] = []
        self.generation_tokens = 0

    def add_request(self, request_id, prompt, params, priority=0, arrival_time=None) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if len(ids) > self.config.max_model_len:
            raise InvalidRequestError(f"prompt of {len(ids)} tokens exceeds max_model_len.")
        if request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request_id}")
        if len(self.requests) >= self.config.max_pending_requests:
            raise EngineOverloadedError("full")
        self.requests[request_id] = _Req(request_id, ids, params, [[] for _ in range(params.n)])
        self.started.append(request_id)
        return ids

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            self.requests.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @staticmethod
    def expected_text(prompt_ids: list[int], index: int, length: int) -> str:
        return "".join(chr(97 + (sum(prompt_ids) + index + k) % 26) for k in range(length))

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_delay)
        outputs = []
        for req in list(self.requests.values()):
            completions = []
            for i, gen in enumerate(req.generated):
                gen.append(97 + (sum(req.prompt_ids) + i + len(gen)) % 26)
                done = len(gen) >= (req.params.max_tokens or 16)
                completions.append(CompletionOutput(i, self.tokenizer.decode(gen), list(gen),
                                                    finish_reason="length" if done else None))
                self.generation_tokens += 1
            finished = all(c.finished for c in completions)
            outputs.append(RequestOutput(req.rid, None, req.prompt_ids, completions, finished,
                                         RequestMetrics(time.time())))
            if finished:
                del self.requests[req.rid]
        return outputs

    def stats(self) -> dict:
        return {"num_running": len(self.requests), "num_waiting": 0, "num_swapped": 0,
                "kv_usage": len(self.requests) / 100, "num_free_blocks": 100 - len(self.requests),
                "num_blocks": 100, "num_preemptions": 0, "prompt_tokens_total": 0,
                "generation_tokens_total": self.generation_tokens}
