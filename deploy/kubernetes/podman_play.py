"""Turns rendered manifests (`kubectl kustomize deploy/kubernetes/overlays/local`) into what podman runs
with `podman kube play` on one machine, for scripts/container-check.

Podman (4.3, Debian bookworm's) plays Pods, Deployments, PersistentVolumeClaims and ConfigMaps, so:

- each Deployment, StatefulSet and Job becomes one Pod with its pod template (one replica), named after the
  Service that selects it, so that the Service's name resolves to it on the podman network as in the
  cluster; StatefulSets and then Jobs come first, since a pod's init containers run before the next pod
  is played (the web and worker pods wait for the migration Job's pod);
- a pod with init containers restarts its containers on failure only (podman 4.3 applies the pod's restart
  policy to the init containers as well, and would start them again once they are done);
- a StatefulSet's volumeClaimTemplates become PersistentVolumeClaims (podman volumes);
- a Secret becomes a podman secret (`podman secret create NAME FILE` with the JSON written here), which
  podman's secretKeyRef reads;
- Services and HorizontalPodAutoscalers are left out: no load balancing, no autoscaling; podman would
  publish every containerPort on the host, so only the ports of the Services that --publish names stay.

    python deploy/kubernetes/podman_play.py rendered.yaml OUT_DIR [--publish SERVICE=HOSTPORT]

writes OUT_DIR/play.yaml and OUT_DIR/secret-NAME.json, and prints what it left out.
"""

from __future__ import annotations

import argparse
import base64
import copy
import json
import sys
from pathlib import Path
from typing import Any

import yaml

Doc = dict[str, Any]
WORKLOADS = ("StatefulSet", "Job", "Deployment")  # the order their pods are played in
LEFT_OUT = {
    "Service": "pods are named after their Service instead",
    "HorizontalPodAutoscaler": "no metrics pipeline: podman scales nothing",
}


def _selects(service: Doc, labels: dict[str, str]) -> bool:
    selector = service.get("spec", {}).get("selector") or {}
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


def _secret(doc: Doc) -> dict[str, str]:
    """The Secret's keys with base64 values, the JSON podman's secretKeyRef decodes."""
    data = dict(doc.get("data") or {})
    for key, value in (doc.get("stringData") or {}).items():
        data[key] = base64.b64encode(str(value).encode()).decode()
    return data


def _pod(workload: Doc, services: list[Doc], publish: dict[str, int]) -> tuple[Doc, list[Doc]]:
    template = copy.deepcopy(workload["spec"]["template"])
    labels = template.get("metadata", {}).get("labels", {})
    service = next((s for s in services if _selects(s, labels)), None)
    name = service["metadata"]["name"] if service else workload["metadata"]["name"]
    spec = template["spec"]
    if workload["kind"] != "Job":  # podman's restart policy covers init containers too: they must not rerun
        spec["restartPolicy"] = "OnFailure" if spec.get("initContainers") else "Always"
    claims = []
    for claim in workload["spec"].get("volumeClaimTemplates", []):
        claim_name = f"{claim['metadata']['name']}-{workload['metadata']['name']}-0"
        claims.append(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": claim_name},
                "spec": claim["spec"],
            }
        )
        volume = {"name": claim["metadata"]["name"], "persistentVolumeClaim": {"claimName": claim_name}}
        spec.setdefault("volumes", []).append(volume)
    if service and name in publish:
        for port in service["spec"].get("ports", []):
            for container in spec["containers"]:
                for container_port in container.get("ports", []):
                    if container_port["containerPort"] == port.get("targetPort", port["port"]):
                        container_port["hostPort"] = publish[name]
    for container in spec["containers"]:  # podman publishes every containerPort on the host
        container["ports"] = [port for port in container.get("ports", []) if "hostPort" in port]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}, "spec": spec}
    return pod, claims


def convert(docs: list[Doc], publish: dict[str, int] | None = None) -> tuple[list[Doc], dict, list[str]]:
    """(documents to play, {secret name: JSON data}, "Kind/name: why" for each document left out)."""
    publish = publish or {}
    services = [d for d in docs if d["kind"] == "Service"]
    played: list[Doc] = [d for d in docs if d["kind"] == "ConfigMap"]
    secrets = {d["metadata"]["name"]: _secret(d) for d in docs if d["kind"] == "Secret"}
    left_out = []
    for kind in WORKLOADS:
        for doc in (d for d in docs if d["kind"] == kind):
            pod, claims = _pod(doc, services, publish)
            played[:0] = claims  # volumes before any pod
            played.append(pod)
    for doc in docs:
        kind = doc["kind"]
        if kind not in (*WORKLOADS, "ConfigMap", "Secret"):
            left_out.append(
                f"{kind}/{doc['metadata']['name']}: {LEFT_OUT.get(kind, 'not a kind podman plays')}"
            )
    return played, secrets, left_out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("rendered", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--publish", action="append", default=[], metavar="SERVICE=HOSTPORT")
    args = parser.parse_args(argv)
    publish = {name: int(port) for name, port in (item.split("=") for item in args.publish)}
    docs = [d for d in yaml.safe_load_all(args.rendered.read_text()) if d]
    played, secrets, left_out = convert(docs, publish)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "play.yaml").write_text(yaml.safe_dump_all(played, sort_keys=False))
    for name, data in secrets.items():
        (args.out / f"secret-{name}.json").write_text(json.dumps(data))
    for line in left_out:
        print(f"left out {line}", file=sys.stderr)


if __name__ == "__main__":
    main()
