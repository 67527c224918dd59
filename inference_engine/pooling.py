"""Embeddings: how a pooling runner turns a prompt's final hidden states into one vector.

An embedding request is a prompt without a completion: it is prefilled in the shared batch like any other
prompt (chunked when long) and ends with its pooled hidden state instead of a sampled token. The hidden
states are the model's output after its final norm (what `compute_logits` would read). LAST takes the
prompt's last position (decoder embedding models such as Qwen3-Embedding), CLS its first, MEAN the average
over every position, summed chunk by chunk. `normalize` scales the vector to unit length; `dimensions` keeps
its first entries and normalises again (Matryoshka embeddings), only for models that declare support.

Defaults come, as in vLLM, from the checkpoint's sentence-transformers files where present (`modules.json`
naming a Pooling module and its `config.json`, and a Normalize module) and otherwise are LAST pooling,
normalised. This module is torch-free at import: the web tier reads `PoolingParams` through the bus protocol.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inference_engine.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

    from inference_engine.config import EngineConfig
    from inference_engine.sequence import Sequence
    from inference_engine.step_inputs import PreparedStep

POOLING_TYPES = ("LAST", "MEAN", "CLS")

# sentence-transformers' Pooling modes we run, as its `pooling_mode` names them (from version 6), and the
# flags of older versions' configs (`pooling_mode_<flag>: true`) by the mode each selects.
_ST_MODES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}
_ST_FLAGS = {
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}


@dataclass
class PoolerConfig:
    """vLLM's `--pooler-config`: fields left None take the checkpoint's defaults (`resolve`)."""

    pooling_type: str | None = None  # "LAST" | "MEAN" | "CLS"
    normalize: bool | None = None
    dimensions: int | None = None  # output size where a request does not ask for one (Matryoshka models)

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            self.pooling_type = str(self.pooling_type).upper()
            if self.pooling_type not in POOLING_TYPES:
                raise InvalidRequestError(
                    f"unknown pooling_type {self.pooling_type!r} (choose from {', '.join(POOLING_TYPES)})."
                )
        if self.dimensions is not None and int(self.dimensions) < 1:
            raise InvalidRequestError("pooler_config dimensions must be at least 1.")

    @classmethod
    def of(cls, value: PoolerConfig | dict | str | None) -> PoolerConfig:
        """From a PoolerConfig, a dict or its JSON (the `--pooler-config` flag); None: all defaults."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"pooler_config is not JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise InvalidRequestError("pooler_config must be an object.")
        unknown = set(value) - {f.name for f in fields(cls)}
        if unknown:
            raise InvalidRequestError(f"unknown pooler_config field(s): {', '.join(sorted(unknown))}.")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def resolve(self, checkpoint: str | Path | None) -> PoolerConfig:
        """Every field set: this config's own, else the checkpoint folder's sentence-transformers defaults,
        else LAST pooling, normalised."""
        found = sentence_transformers_defaults(checkpoint) if checkpoint else PoolerConfig()
        return PoolerConfig(
            pooling_type=self.pooling_type or found.pooling_type or "LAST",
            normalize=self.normalize if self.normalize is not None else found.normalize is not False,
            dimensions=self.dimensions,
        )


@dataclass
class PoolingParams:
    """What one embedding request asks for (vLLM's `PoolingParams`)."""

    dimensions: int | None = None  # Matryoshka: keep the first `dimensions` entries, normalise again
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: as many as fit)

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise InvalidRequestError("dimensions must be an integer of at least 1.", param="dimensions")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or (k < 1 and k != -1)):
            raise InvalidRequestError(
                "truncate_prompt_tokens must be -1 or a positive integer.", param="truncate_prompt_tokens"
            )

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PoolingParams:
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise InvalidRequestError(f"unknown pooling parameter(s): {', '.join(sorted(unknown))}.")
        return cls(**data)


def sentence_transformers_defaults(checkpoint: str | Path) -> PoolerConfig:
    """The pooling a sentence-transformers folder declares (fields None where it declares nothing)."""
    folder = Path(checkpoint)
    modules_file = folder / "modules.json"
    if not folder.is_dir() or not modules_file.is_file():
        return PoolerConfig()
    modules = json.loads(modules_file.read_text())
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
    pooling_type = None
    if "Pooling" in kinds:
        config = json.loads((folder / kinds["Pooling"] / "config.json").read_text())
        modes = config.get("pooling_mode", [mode for flag, mode in _ST_FLAGS.items() if config.get(flag)])
        modes = [modes] if isinstance(modes, str) else list(modes)
        if len(modes) != 1:
            raise InvalidRequestError(
                f"{folder}: its Pooling module must select exactly one mode (it selects {modes})."
            )
        pooling_type = _ST_MODES.get(modes[0])
        if pooling_type is None:
            raise InvalidRequestError(
                f"{folder}: sentence-transformers' pooling {modes[0]!r} is not supported."
            )
    return PoolerConfig(pooling_type=pooling_type, normalize="Normalize" in kinds)


def checkpoint_folder(config: EngineConfig) -> Path | None:
    """The Hugging Face folder the engine's model is (a hub id's snapshot), where its sentence-transformers
    files and config.json are; None for a GGUF file or the bundled default."""
    if config.model is None or config.gguf_file is not None:
        return None
    path = Path(config.model).expanduser()
    if path.exists():
        return path if path.is_dir() else None
    from inference_engine.model_loader import hub  # the model loaded from there: this finds it in the cache

    folder = hub.resolve_model(config.model, revision=config.revision, download_dir=config.download_dir)
    return folder if folder.is_dir() else None


def matryoshka_dimensions(checkpoint: str | Path | None) -> tuple[bool, list[int] | None]:
    """Whether the model's config.json declares Matryoshka embeddings (`is_matryoshka` or
    `matryoshka_dimensions`, as vLLM reads them), and the sizes it lists (None: any)."""
    config_file = Path(checkpoint) / "config.json" if checkpoint else None
    if config_file is None or not config_file.is_file():
        return False, None
    raw = json.loads(config_file.read_text())
    dims = raw.get("matryoshka_dimensions")
    return bool(raw.get("is_matryoshka") or dims), list(dims) if dims else None


@dataclass
class Pooler:
    """The engine's pooling: its resolved config and what the model allows a request to ask for."""

    config: PoolerConfig  # resolved: every field but dimensions set
    hidden_size: int
    is_matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None

    @classmethod
    def build(cls, pooler_config: dict | None, folder: Path | None, hidden_size: int) -> Pooler:
        """`folder`: the checkpoint's (`checkpoint_folder`), None where there is none."""
        resolved = PoolerConfig.of(pooler_config).resolve(folder)
        pooler = cls(resolved, hidden_size, *matryoshka_dimensions(folder))
        if resolved.dimensions is not None:
            pooler.check_dimensions(resolved.dimensions)
        return pooler

    def check_dimensions(self, dimensions: int) -> None:
        """vLLM's rule: only a Matryoshka model changes its output size, and only to a size it lists."""
        if not self.is_matryoshka:
            raise InvalidRequestError(
                "this model does not support matryoshka representation; changing the output dimensions "
                "would give poor embeddings.",
                param="dimensions",
            )
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            raise InvalidRequestError(
                f"this model supports only the matryoshka dimensions {self.matryoshka_dimensions}.",
                param="dimensions",
            )
        if dimensions > self.hidden_size:
            raise InvalidRequestError(
                f"dimensions must be at most the model's hidden size, {self.hidden_size}.", param="dimensions"
            )

    def state(self, params: PoolingParams, num_tokens: int) -> PoolingState:
        """A new request's pooling, its `dimensions` checked."""
        dimensions = params.dimensions or self.config.dimensions
        if params.dimensions is not None:
            self.check_dimensions(params.dimensions)
        return PoolingState(self.config.pooling_type, bool(self.config.normalize), dimensions, num_tokens)


@dataclass(eq=False)
class PoolingState:
    """One request's pooling across its prompt chunks. `add` takes the fp32 sum of the hidden rows `rows`
    names for a chunk; a chunk starting at position 0 starts over (a preempted prompt is recomputed)."""

    pooling_type: str
    normalize: bool
    dimensions: int | None
    num_tokens: int
    pooled: torch.Tensor | None = None

    def rows(self, start: int, count: int) -> tuple[int, int] | None:
        """The rows (first, end) this pooling reads of a chunk of `count` positions from `start`, counted
        from the chunk's first row; None: none."""
        if self.pooling_type == "MEAN":
            return 0, count
        if self.pooling_type == "CLS":
            return (0, 1) if start == 0 else None
        return (count - 1, count) if start + count == self.num_tokens else None

    def add(self, part: torch.Tensor, start: int) -> None:
        if self.pooled is None or start == 0 or self.pooling_type != "MEAN":
            self.pooled = part.clone()
        else:
            self.pooled += part

    def embedding(self) -> list[float]:
        vector = self.pooled.float()
        if self.pooling_type == "MEAN":
            vector = vector / self.num_tokens
        if self.dimensions is not None:
            vector = vector[: self.dimensions]
        if self.normalize or self.dimensions is not None:
            vector = vector / vector.norm().clamp_min(1e-12)
        return vector.tolist()


def pool_rows(hidden: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """[len(spans), hidden] fp32: each span's sum of the rows [first, end) of `hidden`, on its device."""
    import torch

    return torch.stack([hidden[first:end].float().sum(0) for first, end in spans])


def check_pooling_prompt(num_tokens: int, max_model_len: int, capacity: int) -> None:
    """An embedding prompt uses the whole context (it generates nothing) and must fit the KV cache."""
    if num_tokens == 0:
        raise InvalidRequestError("the input is empty.", param="input")
    if num_tokens > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens, but the input has {num_tokens} "
            "tokens; shorten it or set truncate_prompt_tokens.",
            param="input",
        )
    if num_tokens > capacity:
        raise InvalidRequestError(
            f"The input needs {num_tokens} tokens of KV cache but the engine's whole cache holds {capacity}.",
            param="input",
        )


def split_pooling(seqs: list[Sequence], step: PreparedStep) -> list[tuple[Sequence, int, tuple[int, int]]]:
    """The pooling sequences' share of a prepared step of `seqs`: (sequence, its chunk's first position, the
    rows of the step's hidden states its pooling reads). They sample nothing: their rows leave the sampled."""
    spans, row = [], 0
    for seq, count, start in zip(seqs, step.meta.query_lens, step.meta.context_lens, strict=True):
        state = seq.group.pooling
        if state is not None and (rows := state.rows(start, count)) is not None:
            spans.append((seq, start, (row + rows[0], row + rows[1])))
        row += count
    if any(seq.group.pooling is not None for seq in step.sample_seqs):
        kept = [
            (r, s) for r, s in zip(step.sample_rows, step.sample_seqs, strict=True) if s.group.pooling is None
        ]
        step.sample_rows, step.sample_seqs = [r for r, _ in kept], [s for _, s in kept]
    return spans
