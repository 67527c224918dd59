"""Errors shared by the engine and its clients.

They live in a torch-free module so that the web tier can catch exactly what the engine raises,
after the bus has carried it across the process boundary by name.
"""


class EngineError(Exception):
    """Base class; `code` is the stable name the bus uses to carry the error across processes."""

    code = "engine_error"


class InvalidRequestError(EngineError, ValueError):
    """The request can never be served as given (bad parameter, prompt too long, ...). `param` names the
    request field at fault where one is (the API's error ``param``)."""

    code = "invalid_request"

    def __init__(self, message: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFoundError(EngineError, LookupError):
    code = "model_not_found"


class EngineOverloadedError(EngineError):
    """Admission is full; retrying later may succeed."""

    code = "overloaded"


class RequestAbortedError(EngineError):
    code = "aborted"


class EngineUnavailableError(EngineError):
    """No engine answered in time, or the engine serving the request died mid-stream."""

    code = "engine_unavailable"


ERRORS_BY_CODE: dict[str, type[EngineError]] = {
    cls.code: cls
    for cls in (
        EngineError,
        InvalidRequestError,
        ModelNotFoundError,
        EngineOverloadedError,
        RequestAbortedError,
        EngineUnavailableError,
    )
}
