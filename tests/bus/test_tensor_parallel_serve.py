"""`serve --tensor-parallel-size 2` on the bus: answers equal the unsharded engine's; ranks split across two
"machines" (a `worker --node-rank 1` process beside `serve --nnodes 2`, both on this one) work the same; a
rank killed mid-service takes the replica off the bus and leaves no process behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from benchmarks.random_llama import write_random_llama
from inference_engine import LLM, SamplingParams
from inference_engine.bus.client import EngineClient
from inference_engine.bus.redis_server import free_port

from . import engines

pytestmark = pytest.mark.timeout(300)
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(write_random_llama(tmp_path_factory.mktemp("tp-serve"), layers=2, seed=5))


@pytest.fixture(scope="module")
def expected(model) -> list[list[int]]:
    llm = LLM(model=model, dtype="float32")
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _answers(client: EngineClient, name: str) -> list[list[int]]:
    return [client.generate(name, prompt, PARAMS).result().outputs[0].token_ids for prompt in PROMPTS]


def _ranks(process: subprocess.Popen) -> list[psutil.Process]:
    """The rank processes a launcher started (`python -m inference_engine rank`)."""
    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [c for c in children if "inference_engine rank" in " ".join(c.cmdline())]


def test_sharded_replica_answers_and_dies_with_a_rank(redis_server, model, expected):
    client = EngineClient(redis_server.url, prefix="tp", ack_timeout=120)
    serve = engines.serve(redis_server.url, "tp", "tp2", "--model", model, "--tensor-parallel-size", "2")
    try:
        engines.wait_live(client, "tp2", 1, [serve])
        assert _answers(client, "tp2") == expected
        (rank1,) = _ranks(serve)
        rank1.kill()
        start = time.monotonic()
        serve.wait(20)  # the engine stops by itself
        stopped_after = time.monotonic() - start
        while client.live_replicas("tp2") and time.monotonic() - start < 20:
            time.sleep(0.2)
        assert not client.live_replicas("tp2")
        assert stopped_after < 10
        assert not rank1.is_running()
    finally:
        engines.stop(serve)
        client.close()


def test_ranks_on_two_nodes(redis_server, model, expected):
    port = str(free_port())
    nodes = [
        "--tensor-parallel-size",
        "2",
        "--nnodes",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
    ]
    client = EngineClient(redis_server.url, prefix="tp", ack_timeout=120)
    serve = engines.serve(redis_server.url, "tp", "tp-nodes", "--model", model, *nodes)
    flags = [*nodes, "--model", model, "--dtype", "float32", "--max-model-len", "512"]
    flags += ["--kv-cache-memory-bytes", str(128 * 2**20)]
    worker = subprocess.Popen(
        [sys.executable, "-m", "inference_engine", "worker", "--node-rank", "1", *flags]
    )
    try:
        engines.wait_live(client, "tp-nodes", 1, [serve, worker])
        assert _answers(client, "tp-nodes") == expected
    finally:
        engines.stop(serve)  # rank 0 stops the group: the other node's rank ends, and its launcher
        worker.wait(30)
        client.close()
    assert worker.returncode == 0
    assert not _ranks(worker)


def test_nodes_need_an_agreed_port():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "inference_engine",
            "worker",
            "--node-rank",
            "1",
            "--nnodes",
            "2",
            "--tensor-parallel-size",
            "2",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert result.returncode != 0 and "master_port" in result.stderr
