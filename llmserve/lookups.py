"""The rows every API request reads, API keys and model entries, kept for a few seconds after a read.

An async view reads the database on a worker thread: each read is a trip to that thread and back plus the
query, 1-2 ms apiece (measured through daphne on PostgreSQL), which a lone user waits for before the engine
even sees the request. Kept for ``LLMSERVE["LOOKUP_CACHE_SECONDS"]``, a client's requests after its first
read neither. A change saved in this process (the admin, a model's ``save()``) is seen at once: saving or
deleting a key or a model entry empties the cache, and the admin's bulk revocation does too. A change made in
another process (another web server, a management command) is seen within those seconds: a key revoked
there still works that long here. 0 reads the database on every request.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from cachetools import TTLCache
from django.core.signals import setting_changed
from django.db import close_old_connections
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from llmserve import conf
from llmserve.models import APIKey, ModelConfig, hash_key

T = TypeVar("T")

_MAX_ENTRIES = 4096  # keys and model names a process remembers at once (least recently used go first)
_MISSING = object()

_lock = threading.Lock()  # signals may fire on other threads than the event loop's
_cache: TTLCache | None = None
_generation = 0  # bumped by `forget`: a read that started before it is not kept


def released(query: Callable[[Any], T]) -> Callable[[Any], Awaitable[T]]:
    """`query` run on the request's thread, its database connection given back right after: the request goes
    on to wait on the engine, in the queue or streaming, and would hold the connection all along (each ASGI
    request has its own thread and connection). Every query of a generation request goes through here, so the
    request holds none whichever of them ran and whichever the cache spared."""

    @sync_to_async
    def run(argument: Any) -> T:
        try:
            return query(argument)
        finally:
            close_old_connections()

    return run


async def api_key(raw_key: str) -> APIKey | None:
    """The usable (not revoked) key behind a raw key, or None. Unknown keys are not remembered, so a guess
    costs a query each time and never fills the cache."""
    return await _recent(("key", hash_key(raw_key)), _read_api_key, raw_key, keep_none=False)


async def model_config(name: str) -> ModelConfig | None:
    """The model's admin entry, if any (None is remembered too: most served models have none)."""
    return await _recent(("model", name), _read_model_config, name, keep_none=True)


def forget() -> None:
    """Empties the cache; reads in progress are not kept."""
    global _generation
    with _lock:
        _generation += 1
        if _cache is not None:
            _cache.clear()


async def _recent(
    key: tuple[str, str], read: Callable[[str], Awaitable[Any]], argument: str, keep_none: bool
) -> Any:
    global _cache
    seconds = float(conf.get("LOOKUP_CACHE_SECONDS"))
    if seconds <= 0:
        return await read(argument)
    with _lock:
        if _cache is None or _cache.ttl != seconds:
            _cache = TTLCache(_MAX_ENTRIES, seconds)
        found, generation = _cache.get(key, _MISSING), _generation
    if found is not _MISSING:
        return found
    value = await read(argument)
    with _lock:
        if generation == _generation and (value is not None or keep_none):
            _cache[key] = value
    return value


_read_api_key = released(APIKey.objects.get_usable)


@released
def _read_model_config(name: str) -> ModelConfig | None:
    return ModelConfig.objects.filter(name=name).first()


@receiver(post_save, sender=APIKey)
@receiver(post_delete, sender=APIKey)
@receiver(post_save, sender=ModelConfig)
@receiver(post_delete, sender=ModelConfig)
def _changed(**kwargs: Any) -> None:
    forget()


@receiver(setting_changed)
def _reset(*, setting: str, **kwargs: Any) -> None:
    if setting in ("LLMSERVE", "DATABASES"):
        forget()
