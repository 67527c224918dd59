"""``scripts/run``: the whole stack in one command — Redis, the engine with the bundled model, daphne and a
Celery worker — stopped cleanly by Ctrl-C or SIGTERM.

Each service runs in its own process group (its own session), so a terminal's Ctrl-C reaches only this
launcher, which then stops the services in order (web first, Redis last) and kills whatever a group still
holds after a grace period: no stray processes, even from grandchildren (the engine's supervisor starts the
engine; Celery forks its pool).

    python -m hostproject.run [--host 127.0.0.1] [--port 8000]      (PORT= works too)

Environment: ``LLMSERVE_REDIS_URL`` uses that Redis instead of a private one; ``LLMSERVE_ADMIN_USER`` /
``LLMSERVE_ADMIN_PASSWORD`` name the admin login created on the first run (otherwise ``admin`` and a random
password, printed once); ``LLMSERVE_ENGINE_THREADS`` sets the engine's torch threads. Service logs go to
``var/log/``.
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
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOG_DIR = ROOT / "var" / "log"
MODEL_NAME = "SmolLM2-135M-Instruct"  # served name of the bundled default model
READY_TIMEOUT = 600.0  # seconds; the first start on a slow machine loads and converts the model
STOP_GRACE = 20.0  # seconds each service gets to shut down before its process group is killed


class ServiceFailed(RuntimeError):
    pass


class Service:
    """One child process in its own session, with its output in ``var/log/<name>.log``."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], stdout: int | None = None) -> None:
        self.name = name
        self.log_path = LOG_DIR / f"{name}.log"
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                cmd, cwd=ROOT, env=env, start_new_session=True, stdout=stdout or log, stderr=log
            )

    def check(self) -> None:
        if self.process.poll() is not None:
            raise ServiceFailed(
                f"{self.name} exited with {self.process.returncode}; the end of "
                f"{self.log_path}:\n{self.log_tail()}"
            )

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self) -> None:
        """SIGTERM to the service itself (it stops its own children), then SIGKILL to what is left of its
        process group."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                print(f"{self.name} did not stop within {STOP_GRACE:.0f}s; killing it", file=sys.stderr)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # the session's stragglers, if any
        self.process.wait()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _prepare_database() -> None:
    """Migrations, and on the first run an admin login and the bundled model's configuration (so the admin's
    load / unload actions have something to act on)."""
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    from llmserve.models import ModelConfig

    call_command("migrate", interactive=False, verbosity=0)
    users = get_user_model()
    if not users.objects.filter(is_superuser=True).exists():
        username = os.environ.get("LLMSERVE_ADMIN_USER") or "admin"
        password = os.environ.get("LLMSERVE_ADMIN_PASSWORD")
        shown = "(from LLMSERVE_ADMIN_PASSWORD)" if password else None
        password = password or secrets.token_urlsafe(12)
        users.objects.create_superuser(username, "", password)
        print(
            f"Created the admin login: user {username!r}, password {shown or password!r}"
            f"{'' if shown else ' — shown only this once'}",
            flush=True,
        )
    if not ModelConfig.objects.exists():
        ModelConfig.objects.create(name=MODEL_NAME, source=ModelConfig.Source.BUNDLED)


def _wait_ready(base_url: str, services: list[Service]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        for service in services:
            service.check()
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=2) as reply:
                if MODEL_NAME in json.load(reply).get("models", {}):
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise ServiceFailed(f"the stack was not ready within {READY_TIMEOUT:.0f}s; see {LOG_DIR}")


def run(host: str, port: int) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hostproject.settings")
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    if not _port_free(host, port):
        raise ServiceFailed(f"{host}:{port} is in use; choose another port with --port or PORT=")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # The web processes' metrics start from zero with the stack (files of earlier runs would add up).
    metrics_dir = Path(env.setdefault("PROMETHEUS_MULTIPROC_DIR", str(ROOT / "var" / "prometheus")))
    shutil.rmtree(metrics_dir, ignore_errors=True)
    metrics_dir.mkdir(parents=True)
    services: list[Service] = []  # in start order; stopped in reverse
    try:
        if not env.get("LLMSERVE_REDIS_URL"):
            redis = Service(
                "redis", [sys.executable, "-m", "inference_engine", "redis"], env, stdout=subprocess.PIPE
            )
            services.append(redis)
            url = redis.process.stdout.readline().decode().strip()
            if not url:  # it failed before printing its URL
                redis.process.wait(STOP_GRACE)
                redis.check()
            env["LLMSERVE_REDIS_URL"] = os.environ["LLMSERVE_REDIS_URL"] = url
        print(f"Redis: {env['LLMSERVE_REDIS_URL']}", flush=True)

        import django  # now: the settings read the Redis URL from the environment

        django.setup()
        from llmserve import conf

        engine_cmd = [
            sys.executable,
            "-m",
            "inference_engine",
            "supervise",
            "--name",
            conf.get("SUPERVISOR"),
            "--served-model-name",
            MODEL_NAME,
            "--redis-url",
            conf.get("REDIS_URL"),
            "--prefix",
            conf.get("BUS_PREFIX"),
        ]
        if env.get("LLMSERVE_ENGINE_THREADS"):
            engine_cmd += ["--threads", env["LLMSERVE_ENGINE_THREADS"]]
        services.append(Service("engine", engine_cmd, env))  # loads the model while the rest starts
        _prepare_database()
        services.append(
            Service(
                "celery",
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "hostproject",
                    "worker",
                    "--loglevel",
                    "INFO",
                    "--concurrency",
                    "2",
                ],
                env,
            )
        )
        services.append(
            Service(
                "daphne",
                [sys.executable, "-m", "daphne", "-b", host, "-p", str(port), "hostproject.asgi:application"],
                env,
            )
        )
        base_url = f"http://{host}:{port}"
        print(f"Starting the engine with {MODEL_NAME} (logs in {LOG_DIR}) …", flush=True)
        _wait_ready(base_url, services)
        print(
            f"\nllmserve is up:\n  Chat   {base_url}/chat/\n  Admin  {base_url}/admin/\n"
            f"  API    {base_url}/v1/  (OpenAI-compatible; create an API key in the admin)\n"
            "Press Ctrl-C to stop.",
            flush=True,
        )
        while True:
            for service in services:
                service.check()
            time.sleep(0.5)
    finally:
        # No second interrupt may cut the cleanup short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for service in reversed(services):
            service.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT") or 8000))
    args = parser.parse_args(argv)
    # SIGINT too: a shell that starts us in the background has set it to "ignore", and we inherit that.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        run(args.host, args.port)
    except KeyboardInterrupt:
        print("\nStopped.", flush=True)
        return 0
    except ServiceFailed as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
