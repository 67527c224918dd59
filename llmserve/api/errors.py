"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the matching HTTP status.

The openai client maps the status to its exception class (400 BadRequestError, 401 AuthenticationError,
404 NotFoundError, 429 RateLimitError, 5xx InternalServerError), so the status is part of the contract.
"""

from __future__ import annotations

from django.http import JsonResponse

from inference_engine.errors import (
    EngineError,
    EngineOverloadedError,
    EngineUnavailableError,
    InvalidRequestError,
    ModelNotFoundError,
)
from llmserve import conf


class APIError(Exception):
    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param = message, param
        if code is not None:
            self.code = code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JsonResponse:
        response = JsonResponse(self.body(), status=self.status)
        if self.retry_after is not None:
            response["Retry-After"] = str(max(1, round(self.retry_after)))
        return response


class BadRequest(APIError):
    code = "invalid_value"


class Unauthorized(APIError):
    status, type, code = 401, "authentication_error", "invalid_api_key"


class NotFound(APIError):
    status, code = 404, "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(APIError):
    status, code = 405, "method_not_allowed"


class LengthRequired(APIError):
    status, code = 411, "length_required"


class PayloadTooLarge(APIError):
    status, code = 413, "request_too_large"


class UnsupportedMediaType(APIError):
    status, code = 415, "unsupported_media_type"


class TooManyRequests(APIError):
    status, type, code = 429, "rate_limit_error", "rate_limit_exceeded"


class ServiceUnavailable(APIError):
    status, type, code = 503, "server_error", "engine_unavailable"


class InternalError(APIError):
    status, type, code = 500, "server_error", "internal_error"


def model_not_served(model: str, configured: bool) -> APIError:
    """A model no live engine serves: 503 if the admin knows it (it is down), else 404 (a wrong name)."""
    if configured:
        return ServiceUnavailable(
            f"The model `{model}` is configured but no engine is serving it right now.",
            param="model",
            retry_after=conf.get("RETRY_AFTER"),
        )
    return ModelNotFound(f"The model `{model}` does not exist.", param="model")


def from_engine_error(exc: EngineError) -> APIError:
    """The API error for a typed engine error that came back over the bus."""
    if isinstance(exc, InvalidRequestError):
        return BadRequest(str(exc), param=getattr(exc, "param", None))
    if isinstance(exc, ModelNotFoundError):
        return ModelNotFound(str(exc), param="model")
    if isinstance(exc, EngineOverloadedError):
        return TooManyRequests(
            f"The engine is overloaded: {exc}", code="engine_overloaded", retry_after=conf.get("RETRY_AFTER")
        )
    if isinstance(exc, EngineUnavailableError):
        return ServiceUnavailable(str(exc), retry_after=conf.get("RETRY_AFTER"))
    return InternalError(f"The engine failed: {exc}")
