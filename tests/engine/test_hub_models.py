"""Models named by Hugging Face hub id, found in a Hugging Face cache built here from the bundled model
(no hub is reachable in the tests): the cache layout huggingface_hub writes, `models--org--name/` with
`blobs/`, `snapshots/<commit>/` (links to the blobs) and `refs/<branch or tag>` (a commit hash)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from inference_engine import LLM, SamplingParams
from inference_engine.bus.redis_server import free_port
from inference_engine.model_loader import default_model_path
from inference_engine.model_loader.hub import resolve_model

from .conftest import PROMPTS, assert_all_blocks_free, greedy

ROOT = Path(__file__).resolve().parents[2]
HF_REPO, GGUF_REPO = "org/smollm2", "org/smollm2-GGUF"
MAIN, TAGGED = "1" * 40, "2" * 40  # commit hashes: `main` and the tag `v1`
GGUF_NAME = default_model_path().name  # SmolLM2-135M-Instruct.Q4_1.gguf
CHECK_PROMPTS = [PROMPTS[0], PROMPTS[6], PROMPTS[12]]


def add_to_cache(
    cache: Path, repo_id: str, commit: str, refs: list[str], files: dict[str, Path | bytes]
) -> Path:
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    for name, content in files.items():
        blob = repo / "blobs" / hashlib.sha256(f"{commit}/{name}".encode()).hexdigest()
        if isinstance(content, bytes):
            blob.write_bytes(content)
        else:
            blob.symlink_to(content)  # the bundled files stand in for downloaded blobs, uncopied
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, hf_folder: Path) -> Path:
    """$HF_HOME with the bundled model as an HF repo (branch main, tag v1) and as a GGUF repo."""
    home = tmp_path_factory.mktemp("hf-home")
    hf_files = {p.name: p for p in hf_folder.iterdir() if p.is_file()}
    add_to_cache(home / "hub", HF_REPO, MAIN, ["main"], hf_files)
    add_to_cache(home / "hub", HF_REPO, TAGGED, ["v1"], hf_files)
    gguf_files = {GGUF_NAME: default_model_path(), "SmolLM2-135M-Instruct.Q8_0.gguf": b"not downloaded"}
    add_to_cache(home / "hub", GGUF_REPO, MAIN, ["main"], gguf_files)
    return home


@pytest.fixture(scope="module")
def expected_tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(CHECK_PROMPTS, greedy(8), use_tqdm=False)]


def test_hub_id_loads_from_the_cache_when_the_hub_is_unreachable(hf_home: Path, expected_tokens) -> None:
    """A new process, as a user runs it: HF_HOME names the cache; the hub refuses connections."""
    script = """
import json, sys, torch
torch.set_num_threads(1)
from inference_engine import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", kv_cache_memory_bytes=32 * 2**20)
outputs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
print(json.dumps({"name": llm.llm_engine.model_name, "tokens": [o.outputs[0].token_ids for o in outputs]}))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    hub = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env |= {"HF_HOME": str(hf_home), "HF_ENDPOINT": hub, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script, HF_REPO, json.dumps(CHECK_PROMPTS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result == {"name": HF_REPO, "tokens": expected_tokens}


def test_gguf_file_in_a_cached_hub_repo_with_a_hub_tokenizer(hf_home: Path, expected_tokens) -> None:
    """vLLM's `repo:QUANT` form, `download_dir` for the cache, and `tokenizer` from another repo."""
    llm = LLM(
        model=f"{GGUF_REPO}:q4_1",
        tokenizer=HF_REPO,
        download_dir=str(hf_home / "hub"),
        dtype="float32",
        kv_cache_memory_bytes=32 * 2**20,
    )
    assert llm.llm_engine.model_name == f"{GGUF_REPO}:q4_1"
    outputs = llm.generate(CHECK_PROMPTS, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected_tokens
    assert_all_blocks_free(llm)


def test_revisions_quantizations_and_files_resolve_in_the_cache(hf_home: Path) -> None:
    cache = str(hf_home / "hub")
    snapshots = hf_home / "hub" / "models--org--smollm2" / "snapshots"
    assert resolve_model(HF_REPO, download_dir=cache) == snapshots / MAIN
    assert resolve_model(HF_REPO, revision="v1", download_dir=cache) == snapshots / TAGGED
    assert resolve_model(HF_REPO, revision=MAIN, download_dir=cache) == snapshots / MAIN
    gguf_snapshot = hf_home / "hub" / "models--org--smollm2-GGUF" / "snapshots" / MAIN
    assert resolve_model(f"{GGUF_REPO}:Q4_1", download_dir=cache) == gguf_snapshot / GGUF_NAME
    assert resolve_model(f"{GGUF_REPO}:Q8_0", download_dir=cache).name.endswith("Q8_0.gguf")
    assert resolve_model(GGUF_REPO, gguf_file=GGUF_NAME, download_dir=cache) == gguf_snapshot / GGUF_NAME


def test_missing_models_say_where_they_were_looked_for(hf_home: Path, tmp_path: Path) -> None:
    cache = str(hf_home / "hub")
    with pytest.raises(FileNotFoundError) as missing:
        resolve_model("org/missing", download_dir=cache)
    message = str(missing.value)
    assert str(Path("org/missing").absolute()) in message and "models--org--missing" in message
    with pytest.raises(FileNotFoundError, match=r"no GGUF file of 'org/smollm2-GGUF' in .* matches 'Q5_K_M'"):
        resolve_model(f"{GGUF_REPO}:Q5_K_M", download_dir=cache)
    with pytest.raises(FileNotFoundError, match=r"org/smollm2-GGUF:QUANT"):
        resolve_model(GGUF_REPO, download_dir=cache)
    with pytest.raises(FileNotFoundError, match="revision 'v2'"):
        resolve_model(HF_REPO, revision="v2", download_dir=cache)
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "model.gguf"))):
        resolve_model(str(tmp_path / "model.gguf"))
