"""API-key authentication, shared by the REST API and the WebSocket consumer.

Clients send ``Authorization: Bearer <key>`` (what the openai client does). Keys are looked up by their
hash; the raw key never reaches a log line or the database. With ``LLMSERVE["OPEN_ACCESS"]`` the API needs no
key and rate limits apply per client address instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.utils import timezone

from llmserve import conf, lookups, ratelimit
from llmserve.api.errors import ModelNotFound
from llmserve.models import APIKey


class AuthenticationFailed(Exception):
    pass


class RateLimited(Exception):
    def __init__(self, retry_after: float, limit: int) -> None:
        super().__init__(f"Rate limit of {limit} requests per minute exceeded.")
        self.retry_after, self.limit = retry_after, limit


@dataclass
class Principal:
    """Who is calling: an API key, or an anonymous client of an open deployment."""

    key: APIKey | None
    identity: str  # rate-limit bucket; never the raw key
    rate_limit: int

    @property
    def min_priority(self) -> int:
        """The most urgent request priority this caller may ask for."""
        return conf.get("MIN_PRIORITY") if self.key is None else self.key.effective_min_priority()

    def may_use(self, model: str) -> bool:
        """Whether this caller may use `model` (a model or an adapter): a key may be limited to some."""
        return self.key is None or self.key.may_use(model)

    def check_model(self, model: str) -> None:
        """Raise OpenAI's answer for a model the caller may not use: the one for a model that does not exist,
        so a limited key learns nothing of the others."""
        if not self.may_use(model):
            raise model_refused(model)


def model_refused(model: str) -> ModelNotFound:
    return ModelNotFound(
        f"The model `{model}` does not exist or you do not have access to it.", param="model"
    )


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


async def aauthenticate(authorization: str | None, client_address: str | None = None) -> Principal:
    """The caller behind an ``Authorization`` header; raises `AuthenticationFailed` for a missing, unknown or
    revoked key unless the deployment is open."""
    token = bearer_token(authorization)
    if conf.get("OPEN_ACCESS"):
        key = await lookups.api_key(token) if token else None
        if key is None:
            return Principal(None, f"addr:{client_address or '-'}", conf.get("DEFAULT_RATE_LIMIT"))
    else:
        if token is None:
            raise AuthenticationFailed("Missing API key: send it as `Authorization: Bearer <key>`.")
        key = await lookups.api_key(token)
        if key is None:
            raise AuthenticationFailed("Incorrect or revoked API key.")
    if key.needs_touch():
        key.last_used_at = timezone.now()
        await _write_last_use(key)
    return Principal(key, f"key:{key.pk}", key.effective_rate_limit())


@lookups.released
def _write_last_use(key: APIKey) -> None:
    APIKey.objects.filter(pk=key.pk).update(last_used_at=key.last_used_at)


async def acheck_rate(principal: Principal) -> None:
    """Count one request against the caller's limit; raises `RateLimited` beyond it."""
    retry_after = await ratelimit.ahit(principal.identity, principal.rate_limit)
    if retry_after is not None:
        raise RateLimited(retry_after, principal.rate_limit)
