"""Where a model named as vLLM takes it lives on disk: a local path, or a Hugging Face hub id.

A name that exists on disk is used as is. Anything else is a hub id (`org/name`), resolved through
`huggingface_hub`: checked against the hub and downloaded when the hub is reachable, taken from the local
cache (`$HF_HOME/hub`, or `download_dir`) when it is not or when `HF_HUB_OFFLINE=1`. A GGUF file inside a
hub repo is named by vLLM's `org/name:QUANT` form (the file whose name ends in that quantization type) or
by `gguf_file`. Errors say every place that was tried.
"""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub import HfApi, constants, hf_hub_download, scan_cache_dir, snapshot_download
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import (
    EntryNotFoundError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

# What our loaders read from a Hugging Face repo; anything else there (other weight formats, GGUF files
# of every quantization, ONNX exports) is never downloaded.
TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
]
MODEL_FILES = ["config.json", "generation_config.json", "*.safetensors", *TOKENIZER_FILES]

_QUANT_SUFFIX = re.compile(r"^(?P<repo>[^:]+):(?P<quant>[A-Za-z0-9][A-Za-z0-9_.-]*)$")


def resolve_model(
    model: str,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    gguf_file: str | None = None,
) -> Path:
    """The GGUF file or Hugging Face folder `model` names (downloading it if needed)."""
    path = Path(model).expanduser()
    if path.exists():
        path = path / gguf_file if gguf_file else path
        if path.is_file() and path.suffix == ".gguf":
            return path
        if path.is_dir() and (path / "config.json").exists():
            return path
        raise FileNotFoundError(
            f"model {model!r} is neither a .gguf file nor a Hugging Face folder with config.json ({path})."
        )
    repo_id, quant = _split_quant(model)
    try:
        if gguf_file or quant:
            filename = gguf_file or _gguf_for_quant(repo_id, quant, revision, download_dir)
            return Path(hf_hub_download(repo_id, filename, revision=revision, cache_dir=download_dir))
        folder = Path(
            snapshot_download(repo_id, revision=revision, cache_dir=download_dir, allow_patterns=MODEL_FILES)
        )
    except (HFValidationError, EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise FileNotFoundError(_not_found(model, path, repo_id, revision, download_dir, exc)) from exc
    if not (folder / "config.json").exists():
        raise FileNotFoundError(
            f"hub model {repo_id!r} has no config.json ({folder}); for a GGUF file in it, name the file: "
            f"{repo_id}:QUANT (e.g. {repo_id}:Q4_K_M) or gguf_file=..."
        )
    return folder


def resolve_tokenizer(
    tokenizer: str, *, revision: str | None = None, download_dir: str | None = None
) -> Path:
    """The folder holding tokenizer.json for `tokenizer`: a local folder or a hub id."""
    path = Path(tokenizer).expanduser()
    if not path.exists():
        try:
            path = Path(
                snapshot_download(
                    tokenizer, revision=revision, cache_dir=download_dir, allow_patterns=TOKENIZER_FILES
                )
            )
        except (HFValidationError, EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError) as exc:
            raise FileNotFoundError(
                _not_found(tokenizer, path, tokenizer, revision, download_dir, exc, what="tokenizer")
            ) from exc
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"tokenizer {tokenizer!r} has no tokenizer.json ({path}).")
    return path


def _split_quant(model: str) -> tuple[str, str | None]:
    """vLLM's `org/name:QUANT` form -> ("org/name", "QUANT"); any other name -> (name, None)."""
    match = _QUANT_SUFFIX.match(model)
    return (match["repo"], match["quant"]) if match else (model, None)


def _gguf_for_quant(repo_id: str, quant: str, revision: str | None, download_dir: str | None) -> str:
    """The one GGUF file of the repo whose name ends in `quant`: from the cached snapshot if it is there
    (then `hf_hub_download` still refreshes it when the hub is reachable), else from the hub's listing."""
    files = _cached_files(repo_id, revision, download_dir)
    if not _matching(files, quant):
        try:
            files = [s.rfilename for s in HfApi().model_info(repo_id, revision=revision).siblings or []]
        except (RepositoryNotFoundError, RevisionNotFoundError):
            raise
        except Exception as exc:  # offline, or a transport error (its class depends on the version)
            cached = [f for f in files if f.endswith(".gguf")] or ["none"]
            raise FileNotFoundError(
                f"model {repo_id}:{quant} not found: no GGUF file of {repo_id!r} in the Hugging Face cache "
                f"({_cache_folder(repo_id, download_dir)}) matches {quant!r} (cached: {', '.join(cached)}), "
                f"and {_hub_state(exc)}."
            ) from exc
    matches = _matching(files, quant)
    if len(matches) != 1:
        ggufs = [f for f in files if f.endswith(".gguf")] or ["none"]
        raise FileNotFoundError(
            f"model {repo_id}:{quant}: {'several' if matches else 'no'} GGUF files of {repo_id!r} match "
            f"{quant!r} (its GGUF files: {', '.join(ggufs)}); name one with gguf_file=..."
        )
    return matches[0]


def _matching(files: list[str], quant: str) -> list[str]:
    """GGUF files whose name ends in the quantization type: 'Qwen3-0.6B-Q4_K_M.gguf' for 'q4_k_m'."""
    tail = re.compile(rf"(^|[._-]){re.escape(quant)}\.gguf$", re.IGNORECASE)
    return [f for f in files if tail.search(f.rsplit("/", 1)[-1])]


def _cached_files(repo_id: str, revision: str | None, download_dir: str | None) -> list[str]:
    if not _cache_folder(repo_id, download_dir).is_dir():
        return []
    revision = revision or "main"
    for repo in scan_cache_dir(download_dir or constants.HF_HUB_CACHE).repos:
        if repo.repo_id != repo_id or repo.repo_type != "model":
            continue
        for rev in repo.revisions:
            if revision in rev.refs or rev.commit_hash == revision:
                return sorted(str(f.file_path.relative_to(rev.snapshot_path)) for f in rev.files)
    return []


def _not_found(
    name: str,
    path: Path,
    repo_id: str,
    revision: str | None,
    download_dir: str | None,
    exc: Exception,
    what: str = "model",
) -> str:
    where = f"no file or folder at {path.absolute()}"
    if isinstance(exc, HFValidationError):
        return f"{what} {name!r} not found: {where}, and it is not a Hugging Face hub id ({exc})."
    at = f" at revision {revision!r}" if revision else ""
    if isinstance(exc, LocalEntryNotFoundError):
        cache = f"not in the Hugging Face cache{at} ({_cache_folder(repo_id, download_dir)})"
        return f"{what} {name!r} not found: {where}; {cache}; and {_hub_state(exc)}."
    return f"{what} {name!r} not found: {where}; and on the Hugging Face hub{at}: {exc}"


def _cache_folder(repo_id: str, download_dir: str | None) -> Path:
    return Path(download_dir or constants.HF_HUB_CACHE, repo_folder_name(repo_id=repo_id, repo_type="model"))


def _hub_state(exc: Exception) -> str:
    return "HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else f"the hub could not be reached: {exc}"
