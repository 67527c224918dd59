"""System checks: misconfiguration is reported by ``manage.py check`` (and at server start), not at the first
request.

llmserve.E001  no Redis URL for the request bus
llmserve.E002  the bus's Redis does not answer
llmserve.E003  unknown key in the LLMSERVE setting (a typo would otherwise be silently ignored)
llmserve.E004  a setting has the wrong type or range

The Redis checks run with every management command, as Django's own checks do; a command that must work
without the bus (e.g. ``migrate`` on a machine without Redis) takes ``--skip-checks``.
"""

from __future__ import annotations

from typing import Any

from django.core import checks

from llmserve import conf

_POSITIVE_NUMBERS = (
    "MAX_BODY_BYTES",
    "MAX_PROMPT_CHARS",
    "ACK_TIMEOUT",
    "STREAM_TIMEOUT",
    "MAX_QUEUE",
    "REDIS_MAX_CONNECTIONS",
    "REDIS_POOL_TIMEOUT",
    "RETRY_AFTER",
    "GRAMMAR_WORKERS",
    "GRAMMAR_TIMEOUT",
)


@checks.register(checks.Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    values = conf.llmserve_settings()
    errors: list[checks.CheckMessage] = []
    for key in sorted(set(values) - set(conf.DEFAULTS)):
        errors.append(
            checks.Error(
                f"Unknown key {key!r} in the LLMSERVE setting.",
                hint=f"Known keys: {', '.join(sorted(conf.DEFAULTS))}.",
                id="llmserve.E003",
            )
        )
    for key in _POSITIVE_NUMBERS:
        value = values[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            errors.append(
                checks.Error(
                    f"LLMSERVE[{key!r}] must be a positive number, got {value!r}.", id="llmserve.E004"
                )
            )
    for key in ("OPEN_ACCESS", "REJECT_UNKNOWN_FIELDS", "ALLOW_RUNTIME_LORA_UPDATING"):
        if not isinstance(values[key], bool):
            errors.append(
                checks.Error(
                    f"LLMSERVE[{key!r}] must be True or False, got {values[key]!r}.", id="llmserve.E004"
                )
            )
    floor = values["MIN_PRIORITY"]
    if isinstance(floor, bool) or not isinstance(floor, int):
        errors.append(
            checks.Error(f"LLMSERVE['MIN_PRIORITY'] must be an integer, got {floor!r}.", id="llmserve.E004")
        )
    default_max = values["MAX_TOKENS_DEFAULT"]
    if default_max is not None and (
        isinstance(default_max, bool) or not isinstance(default_max, int) or default_max < 1
    ):
        errors.append(
            checks.Error(
                f"LLMSERVE['MAX_TOKENS_DEFAULT'] must be None or an integer >= 1, got {default_max!r}.",
                id="llmserve.E004",
            )
        )
    for key in ("DEFAULT_RATE_LIMIT", "GRAMMAR_PER_KEY"):
        value = values[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            errors.append(
                checks.Error(f"LLMSERVE[{key!r}] must be an integer >= 0, got {value!r}.", id="llmserve.E004")
            )
    per_minute = values["GRAMMAR_SECONDS_PER_MINUTE"]
    if isinstance(per_minute, bool) or not isinstance(per_minute, int | float) or per_minute < 0:
        errors.append(
            checks.Error(
                f"LLMSERVE['GRAMMAR_SECONDS_PER_MINUTE'] must be a number >= 0, got {per_minute!r}.",
                id="llmserve.E004",
            )
        )
    return errors


@checks.register("llmserve")
def check_redis(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    url = conf.get("REDIS_URL")
    if not url:
        return [
            checks.Error(
                "No Redis URL for the llmserve request bus.",
                hint=f"Set LLMSERVE['REDIS_URL'] (or ${conf.REDIS_URL_ENV}) to the Redis the engines use, "
                "e.g. redis://127.0.0.1:6379/0.",
                id="llmserve.E001",
            )
        ]
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
        try:
            client.ping()
        finally:
            client.close()
    except (redis.RedisError, ValueError) as exc:
        return [
            checks.Error(
                f"The llmserve Redis at {_redact(url)} does not answer: {exc}",
                hint="Start Redis (or `python -m inference_engine redis`) or fix the URL.",
                id="llmserve.E002",
            )
        ]
    return []


def _redact(url: str) -> str:
    """The URL without its password, fit for messages and logs."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password:
        host = parts.hostname or ""
        netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
        parts = parts._replace(netloc=netloc)
    return urlunsplit(parts)
