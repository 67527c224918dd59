"""The container files, checked statically (no Docker engine runs here): compose.yaml parses with Compose's
own parser where one is installed, and every service runs a command this checkout has."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from inference_engine.__main__ import build_parser

ROOT = Path(__file__).resolve().parents[2]
ENV = {"DJANGO_SECRET_KEY": "x", "POSTGRES_PASSWORD": "y", "PATH": "/usr/local/bin:/usr/bin:/bin"}


def compose_command() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def test_compose_file_parses() -> None:
    command = compose_command()
    if command is None:
        pytest.skip("neither `docker compose` nor docker-compose is installed")
    done = subprocess.run(
        [*command, "--profile", "gpu", "config", "--services"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert set(done.stdout.split()) == {"postgres", "redis", "web", "worker", "engine", "engine-gpu"}
    missing = subprocess.run([*command, "config"], cwd=ROOT, env={"PATH": ENV["PATH"]}, capture_output=True)
    assert missing.returncode != 0  # the secret key and database password must be given


def test_services_run_commands_of_this_checkout() -> None:
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    web = services["web"]["command"][-1]
    assert "python -m hostproject.server" in web and "manage.py migrate" in web
    assert importlib.util.find_spec("hostproject.server") is not None
    assert services["worker"]["command"][1:4] == ["-m", "celery", "-A"]
    for name in ("engine", "engine-gpu"):
        command = services[name]["command"]
        assert command[1:3] == ["-m", "inference_engine"]
        args = build_parser().parse_args(command[3:])  # flags the engine really takes
        assert args.command == "supervise" and args.spares
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "RUN scripts/setup" in dockerfile and '"scripts/run"' in dockerfile
