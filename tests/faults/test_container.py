"""The container files, checked statically and fast: the Dockerfile's layers and user, compose.yaml's services
and image variables, the Kubernetes manifests' wiring, and that every container runs a command this checkout
has. scripts/container-check builds and runs them all (minutes, with podman; not part of the suite)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from inference_engine.__main__ import build_parser

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
ENV = {"DJANGO_SECRET_KEY": "x", "POSTGRES_PASSWORD": "y", "PATH": "/usr/local/bin:/usr/bin:/bin"}
SECRET_KEYS = {"django-secret-key", "postgres-password", "database-url"}

sys.path.insert(0, str(K8S))
import podman_play  # noqa: E402


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) in order, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def base_docs() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    return [
        d
        for name in kustomization["resources"]
        for d in yaml.safe_load_all((K8S / "base" / name).read_text())
    ]


def find(docs: list[dict], kind: str, name: str) -> dict:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def containers(doc: dict) -> list[dict]:
    spec = doc["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def assert_runs_this_checkout(command: list[str]) -> None:
    """A container command names a module, management command or script this checkout has."""
    if command[:2] == ["sh", "-c"]:
        assert "manage.py migrate" in command[2], command
        return
    assert command[0] == ".venv/bin/python", command
    if command[1] == "manage.py":
        assert command[2] == "migrate", command
    elif command[1:3] == ["-m", "inference_engine"]:
        args = build_parser().parse_args(command[3:])  # flags the engine really takes
        assert args.command == "supervise", command
    elif command[1:3] == ["-m", "celery"]:
        assert command[3:5] == ["-A", "hostproject"], command
    else:
        assert command[1] == "-m" and importlib.util.find_spec(command[2]) is not None, command


def test_dockerfile_base_user_layers_and_health() -> None:
    steps = dockerfile()
    assert steps[0] == ("ARG", "BASE_IMAGE=python:3.11-slim-bookworm")
    assert steps[1] == ("FROM", "${BASE_IMAGE}")
    kinds = [kind for kind, _ in steps]
    # The .venv (and the model in it) is built before the code is copied, from the files that decide it.
    setup = next(i for i, (kind, args) in enumerate(steps) if kind == "RUN" and "scripts/setup" in args)
    copy_all = steps.index(("COPY", "--chown=llmserve:llmserve . ."))
    assert setup < copy_all
    copied_before = {name for kind, args in steps[:setup] if kind == "COPY" for name in args.split()[1:-1]}
    # ... the files scripts/setup's stamp hashes (it reinstalls when one of them changes).
    hashed = re.search(r"^want=\$\( \(cat ([^;]+);", (ROOT / "scripts/setup").read_text(), re.M)
    assert hashed and copied_before == set(hashed.group(1).split())
    user = max(i for i, kind in enumerate(kinds) if kind == "USER")
    assert steps[user][1] not in ("root", "0") and user < setup
    assert "/health" in dict(steps)["HEALTHCHECK"]
    assert steps[-1] == ("CMD", '["scripts/run", "--host", "0.0.0.0", "--port", "8000"]')
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "var"} <= set(ignored)


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


def test_compose_services_images_and_commands() -> None:
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    assert set(services) == {"postgres", "redis", "web", "worker", "engine", "engine-gpu"}
    # Images from variables, so that local builds stand in where no registry is reachable.
    assert services["postgres"]["image"] == "${POSTGRES_IMAGE:-postgres:16}"
    assert services["redis"]["image"] == "${REDIS_IMAGE:-redis:7}"
    for name in ("web", "worker", "engine"):
        assert services[name]["image"] == "${LLMSERVE_IMAGE:-llmserve}"
        assert services[name]["restart"] == "unless-stopped"
    web = services["web"]["command"][-1]
    assert "python -m hostproject.server" in web and "manage.py migrate" in web
    assert services["web"]["ports"] == ["${PORT:-8000}:8000"]
    assert_runs_this_checkout(services["worker"]["command"])
    for name in ("engine", "engine-gpu"):
        assert_runs_this_checkout(services[name]["command"])
        assert "--spares" in services[name]["command"]


def test_base_lists_every_manifest_and_wires_its_parts() -> None:
    listed = set(yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in (K8S / "base").glob("*.yaml")} - {"kustomization.yaml"}
    docs = base_docs()
    web, service = find(docs, "Deployment", "llmserve-web"), find(docs, "Service", "llmserve-web")
    assert service["spec"]["selector"].items() <= web["spec"]["template"]["metadata"]["labels"].items()
    probe = web["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health"
    for kind, name in (("StatefulSet", "redis"), ("StatefulSet", "postgres"), ("Job", "llmserve-migrate")):
        find(docs, kind, name)
    for kind in ("Deployment", "StatefulSet", "Job"):
        for doc in (d for d in docs if d["kind"] == kind):
            for container in containers(doc):
                if container["image"] == "llmserve":
                    assert_runs_this_checkout(container["command"])
                    env = {e["name"] for e in container.get("env", [])}
                    refs = [r["configMapRef"]["name"] for r in container.get("envFrom", [])]
                    assert refs == ["llmserve-config"]
                    assert (
                        doc["metadata"]["name"] == "llmserve-engine"
                        or {"DATABASE_URL", "DJANGO_SECRET_KEY"} <= env
                    )
                for entry in container.get("env", []):
                    ref = entry.get("valueFrom", {}).get("secretKeyRef")
                    assert ref is None or (ref["name"] == "llmserve-secrets" and ref["key"] in SECRET_KEYS)


def test_engine_autoscaler_reads_a_metric_of_metrics_endpoint() -> None:
    from llmserve import metrics

    hpa = find(base_docs(), "HorizontalPodAutoscaler", "llmserve-engine")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "llmserve-engine"
    metric = hpa["spec"]["metrics"][0]["external"]["metric"]
    names = {metrics.PREFIX + name for name, *_ in metrics._ENGINE_METRICS}
    assert metric["name"] in names
    engine = find(base_docs(), "Deployment", "llmserve-engine")
    served = engine["spec"]["template"]["spec"]["containers"][0]["command"]
    assert metric["selector"]["matchLabels"]["model_name"] == served[served.index("--served-model-name") + 1]


def test_overlays_give_the_secret_and_name_images_the_base_uses() -> None:
    images = {
        c["image"].split(":")[0]
        for d in base_docs()
        if "template" in d.get("spec", {})
        for c in containers(d)
    }
    local = yaml.safe_load((K8S / "overlays" / "local" / "kustomization.yaml").read_text())
    literals = dict(item.split("=", 1) for item in local["secretGenerator"][0]["literals"])
    assert set(literals) == SECRET_KEYS and local["secretGenerator"][0]["name"] == "llmserve-secrets"
    example = (K8S / "overlays" / "cpu" / "secrets.env.example").read_text()
    assert {line.split("=", 1)[0] for line in example.split()} == SECRET_KEYS
    for overlay in ("cpu", "local"):
        named = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())["images"]
        assert {image["name"] for image in named} <= images
    gpu = (K8S / "overlays" / "gpu" / "kustomization.yaml").read_text()
    assert "nvidia.com/gpu: 1" in gpu and "name: llmserve-engine" in gpu


def test_podman_conversion_names_pods_after_services_and_publishes_only_the_asked_port() -> None:
    secret = {"kind": "Secret", "metadata": {"name": "llmserve-secrets"}, "stringData": {"database-url": "x"}}
    played, secrets, left_out = podman_play.convert([*base_docs(), secret], {"llmserve-web": 18000})
    pods = [d for d in played if d["kind"] == "Pod"]
    assert [p["metadata"]["name"] for p in pods] == [
        "redis",
        "postgres",
        "llmserve-migrate",
        "llmserve-web",
        "llmserve-engine",
        "llmserve-worker",
    ]  # StatefulSets, then the Job, then Deployments; Services' names where one selects the pod
    policies = {p["metadata"]["name"]: p["spec"]["restartPolicy"] for p in pods}
    assert (
        policies["llmserve-engine"] == "Always" and policies["llmserve-web"] == "OnFailure"
    )  # init containers
    assert secrets == {"llmserve-secrets": {"database-url": "eA=="}}
    ports = [p for pod in pods for c in pod["spec"]["containers"] for p in c.get("ports", [])]
    assert ports == [{"name": "http", "containerPort": 8000, "hostPort": 18000}]
    postgres = next(p for p in pods if p["metadata"]["name"] == "postgres")
    claim = postgres["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert played[0] == {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": claim},
        "spec": find(base_docs(), "StatefulSet", "postgres")["spec"]["volumeClaimTemplates"][0]["spec"],
    }
    assert sorted(line.split(":")[0] for line in left_out) == [
        "HorizontalPodAutoscaler/llmserve-engine",
        "Service/llmserve-web",
        "Service/postgres",
        "Service/redis",
    ]


def test_overlays_render_with_kustomize(tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl") or str(ROOT / "var" / "container-check" / "bin" / "kubectl")
    if not os.access(kubectl, os.X_OK):
        pytest.skip("kubectl is not installed (scripts/container-check installs one in var/container-check)")
    tree = shutil.copytree(K8S, tmp_path / "kubernetes")
    shutil.copy(tree / "overlays/cpu/secrets.env.example", tree / "overlays/cpu/secrets.env")  # a deployer's
    rendered = {}
    for overlay in ("cpu", "gpu", "local"):
        done = subprocess.run(
            [kubectl, "kustomize", str(tree / "overlays" / overlay)], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        rendered[overlay] = [d for d in yaml.safe_load_all(done.stdout) if d]
        kinds = sorted(d["kind"] for d in rendered[overlay])
        assert kinds.count("Deployment") == 3 and kinds.count("StatefulSet") == 2 and "Secret" in kinds
    engine = find(rendered["gpu"], "Deployment", "llmserve-engine")["spec"]["template"]["spec"]["containers"][
        0
    ]
    assert engine["image"].endswith(":cuda") and engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    web = find(rendered["local"], "Deployment", "llmserve-web")["spec"]["template"]["spec"]["containers"][0]
    assert web["image"] == "localhost/llmserve:cpu"


def test_check_scripts_are_executable() -> None:
    for script in ("scripts/container-check", "deploy/local-images/build"):
        assert os.access(ROOT / script, os.X_OK), script
