"""``scripts/run``: the whole stack in one command — Redis, the engine with the bundled model, daphne and a
Celery worker — kept running until Ctrl-C or SIGTERM stops it cleanly.

Each service runs in its own process group (its own session), so a terminal's Ctrl-C reaches only this
launcher. A service that dies is restarted as the engine supervisor restarts its engines
(`inference_engine.bus.backoff`): at once the first time, then after 1, 2, 4 ... (at most 30) seconds while
it keeps dying, the count starting over once it has run for a minute; never given up on. Whatever its process
group still holds is killed first (a Celery pool child), except for the engine supervisor's: its engines serve
on and the next supervisor adopts them (`inference_engine.bus.supervisor`). Redis comes back on the same
port; the engines and the web tier reconnect by themselves. On Ctrl-C or SIGTERM the services stop in reverse
order (web first, Redis last), each group killed after a grace period: no stray processes. The web workers
stop together and drain first (`hostproject.server`): the answers they stream finish, for up to
``LLMSERVE_SHUTDOWN_GRACE`` seconds (default 30), while the engine still runs.

The web port is bound here and handed to each web worker (``--web-workers N``, default 1), so several
daphne processes share it and the port keeps accepting connections while a worker restarts; rate limits
are counted in Redis, so they hold across workers.

    python -m hostproject.run [--host 127.0.0.1] [--port 8000] [--web-workers 1]     (PORT= works too)
        [--model PATH_OR_HUB_ID] [--served-model-name NAME] [`python -m inference_engine serve` flags]

``--model`` serves a GGUF file, a Hugging Face folder or a hub id instead of the bundled model, registered as
a model configuration so the admin, ``/v1/models`` and the chat page show it.

Environment: ``LLMSERVE_REDIS_URL`` uses that Redis instead of a private one; ``DATABASE_URL`` that database
instead of SQLite; ``LLMSERVE_ADMIN_USER`` / ``LLMSERVE_ADMIN_PASSWORD`` name the admin login created on the
first run (otherwise ``admin`` and a random password, printed once); ``LLMSERVE_ENGINE_THREADS`` sets the
engine's torch threads, ``LLMSERVE_ENGINE_FLAGS`` more engine flags (e.g. ``--dtype float32 --max-num-seqs
64``); ``LLMSERVE_ENGINE_SPARE=0`` turns off the engine's standby spare (a second process with the model
loaded, which takes over at once when the serving one dies, at the cost of the model's memory twice);
``LLMSERVE_WEB_WORKERS`` sets the web workers. Service logs are appended to files in ``LLMSERVE_LOG_DIR``,
by default ``var/log/<port>/`` (so two stacks of one checkout on two ports keep their own).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from inference_engine.bus.backoff import RestartBackoff
from inference_engine.bus.redis_server import free_port
from inference_engine.bus.supervisor import ADOPT_GROUP_ENV

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "SmolLM2-135M-Instruct"  # served name of the bundled default model
READY_TIMEOUT = 600.0  # seconds; the first start on a slow machine loads and converts the model
STOP_GRACE = 20.0  # seconds each service gets to shut down before its process group is killed (web: + drain)


class ServiceFailed(RuntimeError):
    pass


class Service:
    """One child process in its own session, with its output appended to ``<log_dir>/<name>.log``; restarted
    with backoff when it dies (see the module docstring)."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        env: dict[str, str],
        log_dir: Path,
        pass_fds: tuple[int, ...] = (),
        adopts: bool = False,
    ) -> None:
        """`adopts`: the service is the engine supervisor, whose engines outlive it (their process group is
        left running and named to its successor, which adopts them; it is killed only at the end)."""
        self.name, self.cmd, self.env, self.pass_fds, self.adopts = name, cmd, env, pass_fds, adopts
        self.left_groups: list[int] = []
        self.log_path = log_dir / f"{name}.log"
        self.backoff = RestartBackoff()
        self.restart_at: float | None = None
        self.process = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        self.started = time.monotonic()
        with open(self.log_path, "a") as log:
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(self.cmd)}\n")
            log.flush()
            return subprocess.Popen(
                self.cmd,
                cwd=ROOT,
                env=self.env,
                start_new_session=True,
                stdout=log,
                stderr=log,
                pass_fds=self.pass_fds,
            )

    def keep_alive(self) -> None:
        """Notice a death (kill what is left of the group, schedule the restart) and restart when due."""
        now = time.monotonic()
        if self.restart_at is None:
            if self.process.poll() is None:
                return
            if self.adopts:
                self.left_groups.append(self.process.pid)
                self.env = {**self.env, ADOPT_GROUP_ENV: ",".join(map(str, self.left_groups))}
            else:
                _kill_group(self.process)
            delay = self.backoff.died(now - self.started)
            self.restart_at = now + delay
            print(
                f"{self.name} exited with {self.process.returncode}; restarting in {delay:g}s "
                f"(see {self.log_path})",
                file=sys.stderr,
                flush=True,
            )
        if now >= self.restart_at:
            self.restart_at = None
            self.process = self._spawn()

    def check(self) -> None:
        """During start-up a death is fatal: it is a configuration problem, not a crash to ride out."""
        if self.process.poll() is not None:
            raise ServiceFailed(
                f"{self.name} exited with {self.process.returncode}; the end of "
                f"{self.log_path}:\n{self.log_tail()}"
            )

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM to the service itself (it stops its own children), then SIGKILL to what is left of its
        process group."""
        self.terminate()
        self.finish(grace)

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()

    def finish(self, grace: float = STOP_GRACE) -> None:
        """Wait up to `grace` seconds for a terminated service, then kill what is left of its group."""
        if self.process.poll() is None:
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                print(f"{self.name} did not stop within {grace:.0f}s; killing it", file=sys.stderr)
        _kill_group(self.process)
        for group in self.left_groups:  # what the last supervisor adopted and stopped, or left over
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # the session's stragglers, if any
    process.wait()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise ServiceFailed(f"{host}:{port} is in use; choose another port with --port or PORT=") from None
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def _wait_redis(port: int, service: Service, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        service.check()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            time.sleep(0.05)
    raise ServiceFailed(f"Redis did not answer on port {port} within {timeout:.0f}s")


def _prepare_database(served: str, model: str | None) -> None:
    """Migrations, on the first run an admin login, and the served model's configuration (so the admin's
    load / unload actions have something to act on): the bundled model's on the first run, or the
    ``--model`` given."""
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
    if model is not None:
        path = Path(model).expanduser()
        source = (
            ModelConfig.Source.GGUF
            if path.is_file()
            else ModelConfig.Source.HF_FOLDER
            if path.is_dir()
            else ModelConfig.Source.HUB
        )
        location = str(path.resolve()) if path.exists() else model
        ModelConfig.objects.update_or_create(name=served, defaults={"source": source, "path": location})
    elif not ModelConfig.objects.exists():
        ModelConfig.objects.create(name=MODEL_NAME, source=ModelConfig.Source.BUNDLED)


def served_name(model: str | None, name: str | None) -> str:
    """The name clients use: --served-model-name, else the bundled model's, a file's stem, a folder's
    name or the hub id."""
    if name:
        return name
    if model is None:
        return MODEL_NAME
    path = Path(model).expanduser()
    return path.stem if path.is_file() else path.name if path.is_dir() else model


def _wait_ready(base_url: str, served: str, services: list[Service], log_dir: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        for service in services:
            service.check()
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=2) as reply:
                if served in json.load(reply).get("models", {}):
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise ServiceFailed(f"the stack was not ready within {READY_TIMEOUT:.0f}s; see {log_dir}")


def _raise_file_limit() -> None:
    """Each open connection is a file descriptor: let the services (they inherit it) hold as many as the
    system allows, not the usual soft limit of 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run(
    host: str, port: int, web_workers: int, model: str | None = None, served: str = MODEL_NAME, flags=()
) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hostproject.settings")
    log_dir = Path(os.environ.get("LLMSERVE_LOG_DIR") or ROOT / "var" / "log" / str(port))
    log_dir.mkdir(parents=True, exist_ok=True)
    listener = _listen(host, port)
    _raise_file_limit()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # The web processes' metrics start from zero with the stack (files of earlier runs would add up), one
    # folder per port like the logs.
    metrics_dir = Path(
        env.setdefault("PROMETHEUS_MULTIPROC_DIR", str(ROOT / "var" / "prometheus" / str(port)))
    )
    shutil.rmtree(metrics_dir, ignore_errors=True)
    metrics_dir.mkdir(parents=True)
    python = sys.executable
    services: list[Service] = []  # in start order; stopped in reverse
    try:
        if not env.get("LLMSERVE_REDIS_URL"):
            redis_port = free_port()
            redis = Service(
                "redis", [python, "-m", "inference_engine", "redis", "--port", str(redis_port)], env, log_dir
            )
            services.append(redis)
            _wait_redis(redis_port, redis)
            env["LLMSERVE_REDIS_URL"] = os.environ["LLMSERVE_REDIS_URL"] = f"redis://127.0.0.1:{redis_port}/0"
        print(f"Redis: {env['LLMSERVE_REDIS_URL']}", flush=True)

        import django  # now: the settings read the Redis URL from the environment

        django.setup()
        from llmserve import conf

        engine_cmd = [python, "-m", "inference_engine", "supervise", "--name", conf.get("SUPERVISOR")]
        engine_cmd += ["--served-model-name", served, "--redis-url", conf.get("REDIS_URL")]
        if model is not None:
            engine_cmd += ["--model", model]
        engine_cmd += ["--prefix", conf.get("BUS_PREFIX")]
        if env.get("LLMSERVE_ENGINE_THREADS"):
            engine_cmd += ["--threads", env["LLMSERVE_ENGINE_THREADS"]]
        if env.get("LLMSERVE_ENGINE_SPARE", "1") != "0":
            engine_cmd.append("--spares")
        engine_cmd += shlex.split(env.get("LLMSERVE_ENGINE_FLAGS", "")) + list(flags)
        # The engine loads the model while the rest starts.
        services.append(Service("engine", engine_cmd, env, log_dir, adopts=True))
        _prepare_database(served, model)
        celery_cmd = [python, "-m", "celery", "-A", "hostproject", "worker", "--loglevel", "INFO"]
        services.append(Service("celery", [*celery_cmd, "--concurrency", "2"], env, log_dir))
        fd = listener.fileno()
        web_cmd = [python, "-m", "hostproject.server", "--fd", str(fd), "hostproject.asgi:application"]
        for worker in range(1, web_workers + 1):
            services.append(Service(f"web-{worker}", web_cmd, env, log_dir, pass_fds=(fd,)))
        base_url = f"http://{host}:{port}"
        print(f"Starting the engine with {served} (logs in {log_dir}) …", flush=True)
        _wait_ready(base_url, served, services, log_dir)
        print(
            f"\nllmserve is up:\n  Chat   {base_url}/chat/\n  Admin  {base_url}/admin/\n"
            f"  API    {base_url}/v1/  (OpenAI-compatible; create an API key in the admin)\n"
            "Press Ctrl-C to stop.",
            flush=True,
        )
        while True:
            for service in services:
                service.keep_alive()
            time.sleep(0.2)
    finally:
        # No second interrupt may cut the cleanup short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        web = [service for service in services if service.name.startswith("web-")]
        for service in web:  # together: none keeps taking connections while another drains
            service.terminate()
        drain = float(os.environ.get("LLMSERVE_SHUTDOWN_GRACE", "30")) + STOP_GRACE
        for service in web:
            service.finish(drain)
        for service in reversed(services):
            if service not in web:
                service.stop()
        listener.close()


def _check_engine_flags(flags: list[str], parser: argparse.ArgumentParser) -> None:
    """Anything else on the command line must be an engine flag: checked now, not when the engine starts."""
    from inference_engine.__main__ import build_parser

    engine = build_parser()
    try:
        with contextlib.redirect_stderr(sys.stdout):
            engine.parse_args(["serve", *flags])
    except SystemExit:
        parser.error(f"not an option of scripts/run nor an engine flag: {' '.join(flags)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT") or 8000))
    parser.add_argument(
        "--web-workers", type=int, default=int(os.environ.get("LLMSERVE_WEB_WORKERS") or 1), metavar="N"
    )
    parser.add_argument(
        "--model", help="GGUF file, Hugging Face folder or hub id (default: the bundled model)"
    )
    parser.add_argument("--served-model-name", help="the name clients use")
    args, flags = parser.parse_known_args(argv)
    _check_engine_flags(flags, parser)
    # SIGINT too: a shell that starts us in the background has set it to "ignore", and we inherit that.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        served = served_name(args.model, args.served_model_name)
        run(args.host, args.port, max(1, args.web_workers), args.model, served, flags)
    except KeyboardInterrupt:
        print("\nStopped.", flush=True)
        return 0
    except ServiceFailed as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
