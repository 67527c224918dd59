"""The app's settings: one ``LLMSERVE = {...}`` dict in the host project's settings, read through
`llmserve_settings()`.

The accessor is cached (views read it on every request) and the cache is dropped on Django's
``setting_changed`` signal, so ``override_settings(LLMSERVE=...)`` works in tests.

Keys (all optional; defaults in `DEFAULTS`):

``REDIS_URL``            Redis of the request bus. ``None`` falls back to ``$LLMSERVE_REDIS_URL``; a system
                         check (llmserve.E001/E002) reports a missing or unreachable one.
``BUS_PREFIX``           Namespace of the bus's Redis keys; must match the engines' ``--prefix``.
``OPEN_ACCESS``          ``True`` serves the API without API keys. Default ``False``: every API call needs
                         a key.
``DEFAULT_RATE_LIMIT``   Requests per minute per API key when the key sets none; ``0`` = unlimited. Counted in
                         the bus's Redis, so every web and worker process shares one limit.
``MAX_BODY_BYTES``       Largest accepted request body (413 beyond it).
``MAX_PROMPT_CHARS``     Largest prompt (or sum of message contents) in characters (400 beyond it); the engine
                         separately refuses prompts longer than the model's context.
``MAX_TOKENS_DEFAULT``   ``max_tokens`` when a request gives none; ``None`` (default): until the context is
                         full, as vLLM does. A number bounds how long one request may hold a batch slot.
``ACK_TIMEOUT``          Seconds to wait for an engine to accept a request before answering 503.
``STREAM_TIMEOUT``       Seconds of silence from a running request before giving up on it.
``MAX_QUEUE``            Bus backlog per model (requests queued or running) beyond which requests get 429 with
                         ``Retry-After``; below it a request waits for an engine slot (up to ``ACK_TIMEOUT``).
``REDIS_MAX_CONNECTIONS`` Redis connections of one bus client (one per web process and event loop, one per
                         Celery worker process). Requests share them: a request waiting for an engine holds
                         none.
``REDIS_POOL_TIMEOUT``   Seconds a request waits for a free Redis connection before 429 with ``Retry-After``.
``ROUTING``              How the web tier picks an engine replica: ``"prefix"`` (the replica that served the
                         request's longest prefix, unless it is busier than the least-loaded one by
                         ``ROUTING_LOAD_MARGIN`` requests) or ``"shared"`` (whichever replica reads first).
``ROUTING_LOAD_MARGIN``  See ``ROUTING``.
``RETRY_AFTER``          Seconds suggested in ``Retry-After`` for 429 (overload) and 503 answers.
``LOOKUP_CACHE_SECONDS`` Seconds a web process keeps an API key or a model's admin entry after reading it
                         (`llmserve.lookups`): changes saved in another process take effect within this time,
                         changes saved in this one at once. ``0`` reads the database on every request.
``SUPERVISOR``           Name of the engine supervisor that admin load / unload actions address.
``ALLOW_RUNTIME_LORA_UPDATING`` ``True`` serves ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
                         (vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) to callers with an API key. Default
                         ``False``: both answer 404.
``ENGINE_THREADS``       Torch threads of engines started by ``manage.py llmserve_engine`` (``None``: torch's
                         choice).
``CHAT_LOGIN_REQUIRED``  ``True`` (default): the WebSocket chat serves logged-in users and API keys only.
                         ``False``: anonymous visitors may chat too, rate-limited per client address.
``BULK_PRIORITY``        Bus priority of bulk job requests (lower runs first; interactive requests use 0).
``BULK_RUNNER_TIMEOUT``  Seconds without a heartbeat after which a bulk task counts as dead and its items pass
                         to another task (a task redelivered after its worker died takes them over at once).
``BULK_SLICE_SECONDS``   How long one bulk task claims new items before handing over to a fresh task; keep
                         it well under the broker's ``visibility_timeout`` so that only dead tasks are
                         redelivered.
``BULK_MAX_FILE_BYTES``  Largest file accepted by ``POST /v1/files``.
``WS_CONNECTIONS_PER_KEY`` Open chat WebSockets per API key (or signed-in user, or address), across every web
                         worker (counted in the bus's Redis); the next is refused with close code 4429.
``REJECT_UNKNOWN_FIELDS`` ``True`` refuses request fields the API does not know (400 ``unknown_parameter``).
                         Default ``False``: they are ignored and logged once per name, as vLLM does.
``GRAMMAR_WORKERS``      Threads of each web process that check requests' output constraints (JSON schemas,
                         regexes, grammars, choices, forced tool calls) off its event loop.
``GRAMMAR_TIMEOUT``      Seconds one request's constraint may take to check before a 400.
``GRAMMAR_PER_KEY``      Constraint checks one API key (or user, or address) may have running at once in a web
                         process; the next gets 429. ``0`` = unlimited.
``GRAMMAR_SECONDS_PER_MINUTE`` Seconds of constraint checking one key may use a minute in a web process; then
                         429 until the minute ends. ``0`` = unlimited.
``LORA_DIR``             Folder where LoRA adapters uploaded in the admin are extracted (engines read them
                         there, so on a shared disk when they run on other hosts). ``None``: ``lora/`` under
                         ``MEDIA_ROOT``.
``MIN_PRIORITY``         The most urgent ``priority`` an API request may ask for (lower runs earlier; requests
                         that give none run at 0, bulk jobs at ``BULK_PRIORITY``). Default 0: a client may
                         only defer its own requests.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

REDIS_URL_ENV = "LLMSERVE_REDIS_URL"  # the same variable the engine processes read

DEFAULTS: dict[str, Any] = {
    "REDIS_URL": None,
    "BUS_PREFIX": "llmserve",
    "OPEN_ACCESS": False,
    "DEFAULT_RATE_LIMIT": 600,
    "MAX_BODY_BYTES": 2 * 2**20,  # under Django's DATA_UPLOAD_MAX_MEMORY_SIZE (2.5 MiB)
    "MAX_PROMPT_CHARS": 256 * 1024,
    "MAX_TOKENS_DEFAULT": None,
    "ACK_TIMEOUT": 60.0,
    "STREAM_TIMEOUT": 60.0,
    "MAX_QUEUE": 1024,
    "REDIS_MAX_CONNECTIONS": 32,
    "REDIS_POOL_TIMEOUT": 30.0,
    "ROUTING": "prefix",
    "ROUTING_LOAD_MARGIN": 4,
    "RETRY_AFTER": 1,
    "LOOKUP_CACHE_SECONDS": 5.0,
    "SUPERVISOR": "default",
    "ALLOW_RUNTIME_LORA_UPDATING": False,
    "ENGINE_THREADS": None,
    "CHAT_LOGIN_REQUIRED": True,
    "BULK_PRIORITY": 10,
    "BULK_RUNNER_TIMEOUT": 10.0,
    "BULK_SLICE_SECONDS": 60.0,
    "BULK_MAX_FILE_BYTES": 50 * 2**20,
    "WS_CONNECTIONS_PER_KEY": 32,
    "REJECT_UNKNOWN_FIELDS": False,
    "MIN_PRIORITY": 0,
    "GRAMMAR_WORKERS": 2,
    "GRAMMAR_TIMEOUT": 5.0,
    "GRAMMAR_PER_KEY": 2,
    "GRAMMAR_SECONDS_PER_MINUTE": 20.0,
    "LORA_DIR": None,
}


class UnknownSettingError(KeyError):
    pass


@lru_cache(maxsize=1)
def llmserve_settings() -> dict[str, Any]:
    """The effective settings: `DEFAULTS` overlaid with ``settings.LLMSERVE``.

    Unknown keys are kept (so the system check can name them) but never silently used.
    """
    configured = getattr(settings, "LLMSERVE", {}) or {}
    merged = {**DEFAULTS, **configured}
    if not merged["REDIS_URL"]:
        merged["REDIS_URL"] = os.environ.get(REDIS_URL_ENV) or None
    return merged


def get(name: str) -> Any:
    """One setting by name; a typo is an error rather than a silent default."""
    if name not in DEFAULTS:
        raise UnknownSettingError(name)
    return llmserve_settings()[name]


@receiver(setting_changed)
def _reset(*, setting: str, **kwargs: Any) -> None:
    if setting == "LLMSERVE":
        llmserve_settings.cache_clear()
