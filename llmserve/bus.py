"""The app's door to the engines: bus clients built from the LLMSERVE settings.

Views and consumers call `async_client()`, Celery tasks and management commands `client()`. The async client
is kept per event loop (a redis.asyncio pool belongs to the loop that created it); the sync one per process.
Both are rebuilt when the LLMSERVE setting changes.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from django.core.signals import setting_changed
from django.dispatch import receiver

from inference_engine.bus.client import AsyncEngineClient, ClientSettings, EngineClient
from llmserve import conf

_async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncEngineClient] = (
    weakref.WeakKeyDictionary()
)
_sync_client: EngineClient | None = None


def client_settings() -> ClientSettings:
    return ClientSettings(
        prefix=conf.get("BUS_PREFIX"),
        ack_timeout=float(conf.get("ACK_TIMEOUT")),
        stream_timeout=float(conf.get("STREAM_TIMEOUT")),
        max_queue=int(conf.get("MAX_QUEUE")),
        max_connections=int(conf.get("REDIS_MAX_CONNECTIONS")),
        pool_timeout=float(conf.get("REDIS_POOL_TIMEOUT")),
        routing=conf.get("ROUTING"),
        routing_load_margin=int(conf.get("ROUTING_LOAD_MARGIN")),
    )


def async_client() -> AsyncEngineClient:
    """The bus client of the running event loop."""
    loop = asyncio.get_running_loop()
    found = _async_clients.get(loop)
    if found is None:
        found = _async_clients[loop] = AsyncEngineClient(conf.get("REDIS_URL"), settings=client_settings())
    return found


def async_clients() -> list[AsyncEngineClient]:
    """The async clients of this process's event loops (a server draining on shutdown reads them)."""
    return list(_async_clients.values())


def client() -> EngineClient:
    """The process's synchronous bus client (thread-safe)."""
    global _sync_client
    if _sync_client is None:
        _sync_client = EngineClient(conf.get("REDIS_URL"), settings=client_settings())
    return _sync_client


@receiver(setting_changed)
def _reset(*, setting: str, **kwargs: Any) -> None:
    global _sync_client
    if setting == "LLMSERVE":
        _async_clients.clear()
        if _sync_client is not None:
            _sync_client.close()
        _sync_client = None
