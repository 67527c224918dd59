"""The container path, built and run with podman on this machine (scripts/container-check runs this).

Builds the image (cold, then after a change to the build context), then runs it three ways: one container
with its default command (scripts/run), the compose stack (podman-compose), and the Kubernetes manifests
(`podman kube play`, through deploy/kubernetes/podman_play.py). Each way: wait for /health, an API key,
a chat completion, a streamed chat, a WebSocket chat and a 3-line Batch API job through the openai client,
then the engine's container killed (SIGKILL) and seen back (restarted by its restart policy, /health
answering again, a chat completion served). Everything it started is removed at the end, whatever happens;
the images stay for the next run. One line per step, with its time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import yaml
from websockets.sync.client import connect

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "deploy" / "kubernetes"))
import podman_play  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
IMAGE = "localhost/llmserve:cpu"
STANDINS = {
    "BASE_IMAGE": "localhost/standin-python:3.11",
    "POSTGRES_IMAGE": "localhost/standin-postgres:15",
    "REDIS_IMAGE": "localhost/standin-redis:7",
}
# The image's layers by a word of the instruction that made them.
LAYERS = (
    ("for package in", ".venv with the model"),
    ("gcc", "C compiler"),
    ("python3-venv", "Python"),
    ("ADD file", "Debian"),
    ("COPY dir", "code"),
)
PROJECT = "llmserve-check"  # compose project, kube network and container names start with it
START_TIMEOUT = 900.0  # seconds to healthy: a first start builds the CPU kernels and times them
TOOLS = Path(sys.executable).parent


def step(name: str, started: float, detail: str = "") -> None:
    print(f"{name:<46} {time.monotonic() - started:8.1f} s  {detail}".rstrip(), flush=True)


@contextlib.contextmanager
def timed(name: str) -> Iterator[list[str]]:
    """Times the block and prints its line; the block may append a detail to the list it gets."""
    started, detail = time.monotonic(), []
    yield detail
    step(name, started, " ".join(detail))


def run(*command: str, env: dict | None = None, check: bool = True, quiet: bool = True) -> str:
    done = subprocess.run(
        command, env={**os.environ, **(env or {})}, capture_output=quiet, text=True, stdin=subprocess.DEVNULL
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return (done.stdout or "").strip()


def podman(*args: str, check: bool = True) -> str:
    return run("podman", *args, check=check)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(what: str, probe: Callable[[], bool], timeout: float, every: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(every)


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
            return json.load(reply)["models"].get(MODEL, {}).get("replicas", 0) >= 1
    except (OSError, ValueError, KeyError, urllib.error.URLError):
        return False


# -- the image -----------------------------------------------------------------------------------------------


def build_args() -> list[str]:
    """podman build's arguments here: the local base, the CPU torch wheel pip finds on this host, and the
    host's CA bundle for pip (no image registry; the package registries only through the host's network)."""
    args = ["--format", "docker", "--network", "host", "--build-arg", f"BASE_IMAGE={STANDINS['BASE_IMAGE']}"]
    args += ["-v", "/etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/host-ca.crt:ro"]
    args += ["--build-arg", "PIP_CERT=/etc/ssl/certs/host-ca.crt"]
    wheels = sorted(Path("/opt/wheels").glob("torch-2.13.0+cpu-*.whl"))
    if wheels:
        args += ["-v", f"{wheels[0].parent}:/wheels:ro", "--build-arg", "PIP_FIND_LINKS=/wheels"]
        args += ["--build-arg", "TORCH_SPEC=torch==2.13.0+cpu"]
    else:  # PyTorch's own index serves the CPU build
        args += ["--build-arg", "TORCH_SPEC=torch==2.13.0+cpu"]
        args += ["--build-arg", "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu"]
    return args


def build_image() -> None:
    with timed("base images (debootstrap, stand-ins)") as detail:
        made = run(str(ROOT / "deploy" / "local-images" / "build")).split()
        detail.append(", ".join(made))
    # Cold: without the image and the build's cached layers (a --no-cache build's layers would not serve as
    # the next build's cache).
    podman("rmi", "-f", IMAGE, check=False)
    podman("image", "prune", "-f")
    with timed("image build, cold"):
        podman("build", *build_args(), "-t", IMAGE, str(ROOT))
    change = ROOT / "container-check-change.txt"  # a new file in the build context, as a code change is
    try:
        change.write_text(f"{time.time()}\n")
        with timed("image build after a code change"):
            podman("build", *build_args(), "-t", IMAGE, str(ROOT))
    finally:
        change.unlink(missing_ok=True)
    image_size()


def image_size() -> None:
    with timed("image size") as detail:
        detail.append(f"{json.loads(podman('image', 'inspect', IMAGE))[0]['Size'] / 1e9:.2f} GB:")
        for layer in json.loads(podman("history", "--format", "json", IMAGE)):
            name = next((n for key, n in LAYERS if key in layer["CreatedBy"]), "")
            if layer["size"] > 1e6 and name:
                detail.append(f"{name} {layer['size'] / 1e6:.0f} MB,")
        largest = podman(
            "run", "--rm", "--entrypoint", "sh", IMAGE, "-c",
            "du -sm .venv/lib/python3*/site-packages/* | sort -rn | head -5",
        )  # fmt: skip
        packages = (line.split("\t") for line in largest.splitlines())
        detail.append("in .venv: " + ", ".join(f"{Path(path).name} {mb} MB" for mb, path in packages))


# -- the requests each way gets -----------------------------------------------------------------------------


def exercise(port: int, key: str) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, timeout=300, max_retries=0)
    messages = [{"role": "user", "content": "Name three colours."}]
    with timed("  chat completion") as detail:
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16)
        assert reply.choices[0].message.content, reply
        detail.append(f"{reply.usage.completion_tokens} tokens")
    with timed("  streamed chat") as detail:
        pieces = [
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=16, stream=True
            )
            if chunk.choices
        ]
        assert "".join(pieces), pieces
        detail.append(f"{len(pieces)} chunks")
    with timed("  WebSocket chat") as detail:
        url = f"ws://127.0.0.1:{port}/ws/chat/"
        with connect(url, subprotocols=[f"llmserve.key.{key}"], open_timeout=30) as socket_:
            assert json.loads(socket_.recv(timeout=30))["type"] == "ready"
            chat = {
                "type": "chat",
                "id": 1,
                "model": MODEL,
                "messages": messages,
                "params": {"max_tokens": 16},
            }
            socket_.send(json.dumps(chat))
            text, event = "", {}
            while event.get("type") not in ("end", "error"):
                event = json.loads(socket_.recv(timeout=300))
                text += event.get("text", "") if event.get("type") == "delta" else ""
        assert event["type"] == "end" and text, event
        detail.append(f"finish_reason {event.get('finish_reason')}")
    with timed("  Batch API job, 3 lines") as detail:
        lines = [
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"Count to {i} in French (un, deux, trois…)."}],
                    "max_tokens": 8,
                },
            }
            for i in range(1, 4)
        ]
        upload = client.files.create(
            file=("batch.jsonl", "\n".join(json.dumps(line) for line in lines).encode()), purpose="batch"
        )
        batch = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        wait_for(
            "batch",
            lambda: (
                client.batches.retrieve(batch.id).status in ("completed", "failed", "expired", "cancelled")
            ),
            600,
        )
        batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed" and batch.output_file_id, batch
        results = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
        assert sorted(r["custom_id"] for r in results) == ["line-1", "line-2", "line-3"], results
        assert all(r["response"]["status_code"] == 200 for r in results), results
        detail.append(f"{batch.request_counts.completed} completed")


def api_key(container: str) -> str:
    return podman("exec", container, ".venv/bin/python", "manage.py", "llmserve_createkey", PROJECT).split()[
        -1
    ]


def kill_engine(container: str, port: int, key: str) -> None:
    """SIGKILL to the container's first process, as a crash would; its restart policy brings it back."""
    restarts = lambda: int(podman("inspect", "--format", "{{.RestartCount}}", container) or 0)  # noqa: E731
    before = restarts()
    with timed("  engine container killed, restarted") as detail:
        os.kill(int(podman("inspect", "--format", "{{.State.Pid}}", container)), signal.SIGKILL)
        wait_for("restart", lambda: restarts() > before, 120, every=0.5)
        detail.append(f"restart {restarts()}")
    with timed("  /health without a live engine"):
        wait_for("/health to notice", lambda: not healthy(port), 60, every=0.5)
    with timed("  healthy again"):
        wait_for("/health", lambda: healthy(port), START_TIMEOUT)
    with timed("  chat completion after the restart"):
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=key, timeout=300, max_retries=0
        )
        messages = [{"role": "user", "content": "Hello"}]
        assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8).choices[0].message


# -- the three ways -----------------------------------------------------------------------------------------


def one_container(teardown: list[Callable[[], None]]) -> None:
    name, port = f"{PROJECT}-one", free_port()
    teardown.append(lambda: podman("rm", "-f", "-t", "0", name, check=False))
    with timed("one container: start to healthy"):
        podman("run", "-d", "--name", name, "--restart", "always", "-p", f"{port}:8000", IMAGE)
        wait_for("/health", lambda: healthy(port), START_TIMEOUT)
    key = api_key(name)
    exercise(port, key)
    kill_engine(name, port, key)


def compose(teardown: list[Callable[[], None]]) -> None:
    port = free_port()
    env = {
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(32),
        "POSTGRES_PASSWORD": secrets.token_urlsafe(16),
        "LLMSERVE_IMAGE": IMAGE,
        "PORT": str(port),
        **STANDINS,
    }
    command = [str(TOOLS / "podman-compose"), "-p", PROJECT, "-f", str(ROOT / "compose.yaml")]
    teardown.append(lambda: run(*command, "down", "-v", "-t", "0", env=env, check=False))
    with timed("compose: start to healthy"):
        run(*command, "up", "-d", "--no-build", env=env)
        wait_for("/health", lambda: healthy(port), START_TIMEOUT)

    def container(service: str) -> str:
        labels = ["--filter", f"label=io.podman.compose.project={PROJECT}"]
        labels += ["--filter", f"label=com.docker.compose.service={service}"]
        return podman("ps", *labels, "--format", "{{.Names}}").split()[0]

    key = api_key(container("web"))
    exercise(port, key)
    kill_engine(container("engine"), port, key)


def kubernetes(teardown: list[Callable[[], None]]) -> None:
    port, network = free_port(), PROJECT
    work = Path(tempfile.mkdtemp(prefix=f"{PROJECT}-"))
    teardown.append(lambda: shutil.rmtree(work, ignore_errors=True))
    with timed("kubernetes: render, convert for podman") as detail:
        rendered = run(str(TOOLS / "kubectl"), "kustomize", str(ROOT / "deploy/kubernetes/overlays/local"))
        docs = [d for d in yaml.safe_load_all(rendered) if d]
        played, secret_data, left_out = podman_play.convert(docs, {"llmserve-web": port})
        (work / "play.yaml").write_text(yaml.safe_dump_all(played, sort_keys=False))
        detail.append(f"{len(docs)} manifests; left out: " + "; ".join(left_out))
    pods = [d["metadata"]["name"] for d in played if d["kind"] == "Pod"]
    claims = [d["metadata"]["name"] for d in played if d["kind"] == "PersistentVolumeClaim"]

    def down() -> None:
        for pod in pods:
            podman("pod", "rm", "-f", "-t", "0", pod, check=False)
        for name in claims:
            podman("volume", "rm", "-f", name, check=False)
        for name in secret_data:
            podman("secret", "rm", name, check=False)
        podman("network", "rm", "-f", network, check=False)

    kube_network = "podman-default-kube-network"  # made by the first `kube play`, whatever --network says
    if subprocess.run(["podman", "network", "exists", kube_network]).returncode != 0:
        teardown.append(lambda: podman("network", "rm", kube_network, check=False))
    teardown.append(down)
    for name, data in secret_data.items():
        (work / f"{name}.json").write_text(json.dumps(data))
        podman("secret", "create", name, str(work / f"{name}.json"))
    podman("network", "create", network)
    with timed("kubernetes: start to healthy"):
        podman("kube", "play", "--network", network, str(work / "play.yaml"))
        wait_for("/health", lambda: healthy(port), START_TIMEOUT)
    key = api_key("llmserve-web-web")
    exercise(port, key)
    kill_engine("llmserve-engine-engine", port, key)


WAYS = {"one": one_container, "compose": compose, "kubernetes": kubernetes}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--skip-build", action="store_true", help=f"use the {IMAGE} image already built")
    parser.add_argument("--only", nargs="+", choices=list(WAYS), default=list(WAYS))
    args = parser.parse_args()
    started = time.monotonic()
    teardown: list[Callable[[], None]] = []
    try:
        if not args.skip_build:
            build_image()
        for name in args.only:
            try:
                WAYS[name](teardown)
            finally:  # one way at a time: the machine may not hold two stacks
                with timed(f"{name}: torn down"):
                    while teardown:
                        teardown.pop()()
    finally:
        while teardown:
            teardown.pop()()
    step("container check passed", started)


if __name__ == "__main__":
    main()
