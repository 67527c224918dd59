"""`scripts/run` from a clean checkout (no database, no secret key, no admin, no Redis): the stack comes up,
the printed admin login opens the chat page, the chat answers, and Ctrl-C leaves no process behind.

The checkout is a copy of the working tree whose `.venv` links to this one's, so scripts/setup finds it
installed; a real fresh install (pip, model download) is what CI's first `scripts/run` does."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from http.cookiejar import CookieJar
from pathlib import Path

import pytest

from benchmarks.random_llama import write_random_llama
from inference_engine.bus.redis_server import free_port

from .wsclient import ChatSocket

ROOT = Path(__file__).resolve().parents[2]
ADMIN = ("chatadmin", "run-test-password-1")
pytestmark = pytest.mark.timeout(420)


def _setup_is_current() -> bool:
    return subprocess.run([ROOT / "scripts/setup", "--check"], cwd=ROOT).returncode == 0


def _clean_checkout(target: Path) -> Path:
    names = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, names):
        if (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)
    (target / ".venv").symlink_to(ROOT / ".venv")
    return target


def _clean_env() -> dict[str, str]:
    """This process's environment without the tests' own settings (a fresh shell's, as far as we care)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("LLMSERVE_", "DJANGO_", "CELERY_"))}


def _processes_of(checkout: Path) -> list[str]:
    """Live processes running from the checkout (command line or working directory inside it)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if str(checkout) in cmdline or cwd.startswith(str(checkout)):
            found.append(f"{proc.name}: {cmdline}")
    return found


def _login(base_url: str) -> tuple[str, str]:
    """Log in through the login form; returns the chat page and the session cookie."""
    jar = CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    form = opener.open(f"{base_url}/chat/", timeout=30).read().decode()  # redirected to the login page
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form).group(1)
    data = urllib.parse.urlencode(
        {"csrfmiddlewaretoken": token, "username": ADMIN[0], "password": ADMIN[1], "next": "/chat/"}
    ).encode()
    page = opener.open(f"{base_url}/accounts/login/?next=/chat/", data, timeout=30).read().decode()
    session = next(c.value for c in jar if c.name == "sessionid")
    return page, f"sessionid={session}"


async def _chat(base_url: str, cookie: str, expect_model: str | None = None) -> dict:
    ws = await ChatSocket.open(
        base_url.replace("http", "ws") + "/ws/chat/",
        origin=base_url,
        protocols=["llmserve.chat"],
        cookie=cookie,
    )
    ready = await ws.receive()
    assert ready["type"] == "ready" and ready["models"], ready
    if expect_model is not None:
        assert [m["id"] for m in ready["models"]] == [expect_model], ready
    ws.send(
        {
            "type": "chat",
            "id": 1,
            "model": ready["models"][0]["id"],
            "params": {"max_tokens": 8},
            "messages": [{"role": "user", "content": "Say hello."}],
        }
    )
    kinds = []
    while (message := await ws.receive(120))["type"] in ("start", "delta"):
        kinds.append(message["type"])
    ws.close()
    assert kinds[0] == "start" and "delta" in kinds, kinds
    return message


@contextlib.contextmanager
def _running_stack(checkout: Path, *args: str) -> Iterator[tuple[str, list[str]]]:
    """`scripts/run --port P *args` from the checkout until it prints its URLs; yields the base URL and
    its output so far. Afterwards: Ctrl-C, and no process, no listening port left behind."""
    port = free_port()
    env = _clean_env()
    env.update(
        LLMSERVE_ADMIN_USER=ADMIN[0],
        LLMSERVE_ADMIN_PASSWORD=ADMIN[1],
        LLMSERVE_ENGINE_THREADS="1",
        OMP_NUM_THREADS="1",
    )
    run = subprocess.Popen(
        [str(checkout / "scripts" / "run"), "--port", str(port), *args],
        cwd=checkout,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )  # its own process group, as a terminal gives it
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(run.stdout), daemon=True)
    reader.start()
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not any("Press Ctrl-C" in line for line in output):
            assert run.poll() is None, "".join(output)
            assert time.monotonic() < deadline, "".join(output)
            time.sleep(0.5)
        yield base_url, output
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGINT)  # Ctrl-C
        run.wait(120)
        reader.join(10)
    assert run.returncode == 0, "".join(output)
    assert "Stopped." in "".join(output)
    assert not _processes_of(checkout)
    with socket.socket() as sock:  # nothing listens on the web port any more
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # our own closed connections linger
        sock.bind(("127.0.0.1", port))


@pytest.mark.skipif(not _setup_is_current(), reason="run scripts/setup: .venv is stale")
def test_run_command_from_a_clean_checkout(tmp_path: Path) -> None:
    checkout = _clean_checkout(tmp_path / "llmserve")
    with _running_stack(checkout) as (base_url, output):
        text = "".join(output)
        for url in (f"Chat   {base_url}/chat/", f"Admin  {base_url}/admin/", f"API    {base_url}/v1/"):
            assert url in text, text
        assert f"Created the admin login: user {ADMIN[0]!r}" in text and ADMIN[1] not in text
        page, cookie = _login(base_url)
        assert "llmserve/chat.js" in page
        end = asyncio.run(_chat(base_url, cookie))
        assert end["type"] == "end" and end["usage"]["completion_tokens"] > 0, end
        # launcher, redis, supervisor, engine, celery (+ its pool), daphne
        assert len(_processes_of(checkout)) >= 6


@pytest.mark.skipif(not _setup_is_current(), reason="run scripts/setup: .venv is stale")
def test_run_command_serves_any_model(tmp_path: Path) -> None:
    """--model with a Hugging Face folder and engine flags: registered as a model configuration, listed by
    /v1/models and the chat page, and it answers."""
    checkout = _clean_checkout(tmp_path / "llmserve")
    folder = write_random_llama(tmp_path / "tiny-llama", layers=2, seed=1)
    args = ("--model", str(folder), "--served-model-name", "tiny", "--max-num-seqs", "8")
    with _running_stack(checkout, *args) as (base_url, output):
        assert "Starting the engine with tiny" in "".join(output)
        key = subprocess.run(
            [str(checkout / ".venv" / "bin" / "python"), "manage.py", "llmserve_createkey", "run-test"],
            cwd=checkout,
            env=_clean_env(),
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        request = urllib.request.Request(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(request, timeout=30) as reply:
            assert [m["id"] for m in json.load(reply)["data"]] == ["tiny"]
        _, cookie = _login(base_url)
        end = asyncio.run(_chat(base_url, cookie, expect_model="tiny"))
        assert end["type"] == "end" and end["usage"]["completion_tokens"] > 0, end
