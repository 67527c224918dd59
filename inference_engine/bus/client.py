"""The one bus client every front end uses (REST views, WebSocket consumers, Celery tasks): sync and async.

`generate()` returns only once the engine has acknowledged the request (prompt token count) or refused it, so
engine-side errors (invalid parameters, prompt too long, unknown model, overloaded) raise the typed exceptions
of `inference_engine.errors` before any delta. Every wait is bounded: while waiting, the client checks
that some replica of the model is still alive and gives up with `EngineUnavailableError` when none is, or
when nothing arrives within the timeout. Leaving an iteration early, cancelling it, or calling `abort()`
aborts the request in the engine. No torch here: the web tier imports this.

Every client is the owner of the generations it submits: it keeps a liveness key on the bus (``SET`` with
`owner_ttl` when it submits, refreshed every `owner_beat` seconds while it has requests in flight), and the
engine aborts the running requests whose owner's key lapsed. So the requests of a web worker or Celery
process that died (SIGKILL, out of memory) stop within seconds instead of generating to the end for nobody.

Every operation is written once, in `client_core.Core`, as a generator that yields the Redis commands of each
round trip and receives their results; `EngineClient` (`sync_client`) runs them with redis-py's blocking
client, `AsyncEngineClient` (`async_client`) with its asyncio client. Both use a bounded connection pool that
makes a request wait (up to `pool_timeout`) for a free connection rather than fail. This module is the public
import path of both.
"""

from inference_engine.bus.async_client import AsyncEngineClient, AsyncGenerationStream
from inference_engine.bus.client_core import ClientSettings, GenerationResult, Tokenized
from inference_engine.bus.sync_client import EngineClient, GenerationStream
from inference_engine.errors import EngineError

__all__ = [
    "AsyncEngineClient",
    "AsyncGenerationStream",
    "ClientSettings",
    "EngineClient",
    "EngineError",
    "GenerationResult",
    "GenerationStream",
    "Tokenized",
]
