"""The adapters an engine serves by name (`serve --lora-modules`, vLLM's flag): `name=path` or vLLM's JSON
form `{"name": ..., "path": ..., "base_model_name": ...}`. Torch-free: the command line parses them."""

from __future__ import annotations

import json

from inference_engine.errors import InvalidRequestError
from inference_engine.lora.request import LoRARequest


def parse_lora_module(spec: str) -> tuple[str, str]:
    """(name, path) of one `--lora-modules` value. `base_model_name` of the JSON form is accepted as vLLM
    accepts it; the adapter's parent is always the model its engine serves."""
    if spec.lstrip().startswith("{"):
        try:
            data = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"--lora-modules {spec!r} is not valid JSON: {exc}") from None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data.get("path"):
            raise InvalidRequestError(f"--lora-modules {spec!r}: JSON needs string fields name and path.")
        name, path = data["name"], str(data["path"])
    else:
        name, sep, path = spec.partition("=")
        if not sep:
            raise InvalidRequestError(f"--lora-modules {spec!r}: give name=path or a JSON object.")
    if not name or not path:
        raise InvalidRequestError(f"--lora-modules {spec!r}: the name and the path must not be empty.")
    return name, path


def lora_requests(modules: list[tuple[str, str]]) -> dict[str, LoRARequest]:
    """Each adapter's LoRARequest by name, ids 1, 2, ... in order; a name given twice is an error."""
    requests: dict[str, LoRARequest] = {}
    for name, path in modules:
        if name in requests:
            raise InvalidRequestError(f"--lora-modules names the adapter {name!r} twice.")
        requests[name] = LoRARequest(name, len(requests) + 1, path)
    return requests
