"""The adapters an engine serves by name, changed at run time (vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter, which reach each replica over the bus).

An unloaded name is refused at once for new requests (ModelNotFoundError), while the requests already holding
or waiting for its slot keep their `LoRARequest` and finish with the adapter; its weights stay where they are
until the slot and the CPU LRU need the room. A reloaded name gets a new id, so it never shares prefix-cache
blocks or a slot with the adapter it replaces.
"""

from __future__ import annotations

from inference_engine.errors import InvalidRequestError, ModelNotFoundError
from inference_engine.lora.request import LoRARequest
from inference_engine.lora.slots import LoRAManager


class AdapterRegistry:
    """`modules` (name -> LoRARequest, e.g. from `--lora-modules`) edited in place by `load` / `unload`."""

    def __init__(self, modules: dict[str, LoRARequest], manager: LoRAManager | None) -> None:
        self.modules, self.manager = modules, manager
        self._next_id = max((r.lora_int_id for r in modules.values()), default=0) + 1

    def load(self, name: str, path: str) -> LoRARequest:
        """Reads and checks the adapter, then serves it as `name`; raises InvalidRequestError (nothing
        changed) for an adapter this engine cannot serve. Loading a name again with the same path is a no-op,
        with another path an error (unload it first)."""
        if self.manager is None:
            raise InvalidRequestError("this engine serves no LoRA adapters: start it with --enable-lora.")
        if not name or not path:
            raise InvalidRequestError("lora_name and lora_path must not be empty.")
        current = self.modules.get(name)
        if current is not None:
            if current.lora_path == path:
                return current
            raise InvalidRequestError(
                f"The lora adapter '{name}' has already been loaded (from {current.lora_path}); "
                "unload it first."
            )
        request = LoRARequest(name, self._next_id, path)
        self.manager.load(request)
        self._next_id += 1
        self.modules[name] = request
        return request

    def unload(self, name: str) -> LoRARequest:
        request = self.modules.pop(name, None)
        if request is None:
            raise ModelNotFoundError(f"The lora adapter '{name}' cannot be found.")
        if self.manager is not None:
            self.manager.forget(request.lora_int_id)
        return request
