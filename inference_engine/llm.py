"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import queue
from collections.abc import Callable, Sequence

from tqdm.auto import tqdm

from inference_engine.config import EngineConfig
from inference_engine.engine_loop import EngineLoop, Request
from inference_engine.llm_engine import LLMEngine
from inference_engine.lora.request import LoRARequest
from inference_engine.outputs import EmbeddingRequestOutput, RequestOutput
from inference_engine.pooling import PoolingParams
from inference_engine.sampling_params import SamplingParams

PromptType = str | list[int] | dict


class LLM:
    """Generation in-process. `model`: a GGUF file, a Hugging Face folder or hub id; None = the default.
    With `runner="pooling"` (or vLLM's older `task="embed"`) it serves embeddings (`embed`) instead.

    Safe to call from any number of threads at once: concurrent `generate` / `chat` calls join one
    continuous batch (the engine loop), and each call returns only its own outputs.
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine_loop = EngineLoop.build(EngineConfig(model=model, **kwargs))
        self.llm_engine = self.engine_loop.engine
        self._ids = itertools.count()  # next() on it is atomic under the GIL: ids stay unique across threads

    @property
    def engine(self) -> LLMEngine:
        """Short for `llm_engine`. Touch it directly only while no call is running."""
        return self.llm_engine

    def reset_prefix_cache(self) -> bool:
        return self.engine_loop.call(self.llm_engine.reset_prefix_cache).result()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt at once (continuously batched); returns outputs in input order.

        A prompt is a string, a list of token ids, or {"prompt": ...} / {"prompt_token_ids": [...]}.
        `use_tqdm` may also be a callable that makes the progress bar, as in vLLM. `lora_request`: the
        LoRA adapter of every prompt, or a list with one per prompt (None: the base model).
        """
        prompts = _prompt_list(prompts)
        params = sampling_params or SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts.")
        loras = (
            list(lora_request) if isinstance(lora_request, list | tuple) else [lora_request] * len(prompts)
        )
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts.")
        requests = [
            Request(str(next(self._ids)), prompt_of(prompt), p, priority[i] if priority else 0, loras[i])
            for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True))
        ]
        return self._run(requests, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation or a list of them, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.llm_engine.tokenizer
        prompts = [tokenizer.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (in input order), each in `outputs.embedding`; prompts as `generate`
        takes them. Needs an engine built with runner="pooling"."""
        prompts = _prompt_list(prompts)
        params = pooling_params or PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
        requests = [Request(str(next(self._ids)), prompt_of(prompt), params) for prompt in prompts]
        return self._run(requests, use_tqdm)

    def _run(self, requests: list[Request], use_tqdm: bool | Callable[..., tqdm]) -> list:
        """Hands the requests to the engine loop and waits for their final outputs. However the wait ends
        early (KeyboardInterrupt, an exception from the progress bar), the requests are aborted first."""
        finished_outputs: queue.SimpleQueue[RequestOutput | BaseException] = queue.SimpleQueue()

        def sink(item: RequestOutput | BaseException) -> None:
            if isinstance(item, BaseException) or item.finished:
                finished_outputs.put(item)

        ids = [r.request_id for r in requests]
        finished: dict[str, RequestOutput] = {}
        try:
            self.engine_loop.add(requests, sink).result()
            make_bar = use_tqdm if callable(use_tqdm) else tqdm
            with make_bar(total=len(ids), desc="Processed prompts", disable=use_tqdm is False) as bar:
                while len(finished) < len(ids):
                    item = finished_outputs.get()
                    if isinstance(item, BaseException):
                        raise item
                    finished[item.request_id] = item
                    bar.update(1)
        except BaseException:
            self.engine_loop.abort(ids, sink).result()
            raise
        return [finished[rid] for rid in ids]


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> Sequence[PromptType]:
    """One prompt as a list of one; a list of prompts as it is."""
    if isinstance(prompts, str | dict) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]
    return prompts


def prompt_of(prompt: PromptType) -> str | list[int]:
    """The text or token ids of a prompt in any of vLLM's forms."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        return prompt["prompt"]
    return prompt
