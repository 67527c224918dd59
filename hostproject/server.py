"""``python -m hostproject.server [daphne's options]``: daphne as ``scripts/run`` and the container run it,
with these changes.

- Twisted, under daphne, parses ``multipart/form-data`` bodies itself before daphne sees the request (daphne
  never uses the result) and answers one it cannot parse (no boundary) with an empty 400. Switched off: Django
  parses the body once, and the app answers a malformed one with its own error.
- The access log redacts query-string values whose name looks secret (``api_key=...``, ``token=...``): a
  client that puts its key in the URL must not leave it in the log.
- A WebSocket that breaks the protocol (a message over the size limit, invalid UTF-8 in a text frame) is
  closed with a close frame and its RFC 6455 code (1009, 1007 ...), not dropped at the TCP level (autobahn's
  ``failByDrop``), so the client can tell why. The size limit defaults to twice the app's
  ``LLMSERVE["MAX_BODY_BYTES"]``: up to that the chat consumer itself answers an oversized message with an
  ``error`` message before closing.
- SIGTERM (or Ctrl-C) drains instead of cutting every connection: the worker stops accepting connections and
  new generations (503), lets the requests in flight finish for up to ``LLMSERVE_SHUTDOWN_GRACE`` seconds
  (default 30), then ends those still running with an error event (the engine aborts them), closes chat
  sockets with 1001 (going away) and exits. A second signal exits at once.

Several processes may serve one port: the launcher binds the socket and passes it to each with ``--fd``.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from typing import Any

from daphne import cli, http_protocol
from daphne import server as daphne_server
from daphne.access import AccessLogGenerator
from daphne.ws_protocol import WebSocketFactory, WebSocketProtocol
from twisted.internet import reactor  # daphne.server installed its asyncio reactor

SECRET_PARAMETER = re.compile(r"(?i)([?&][^=&]*(?:key|token|secret|password|auth)[^=&]*=)[^&#]*")


def redact(path: str) -> str:
    """`path` with the values of secret-looking query parameters replaced by ``***``."""
    return SECRET_PARAMETER.sub(r"\1***", path)


class RedactingAccessLog(AccessLogGenerator):
    def __call__(self, protocol: str, action: str, details: dict[str, Any]) -> None:
        if "path" in details:
            details = {**details, "path": redact(str(details["path"]))}
        super().__call__(protocol, action, details)


class WebRequest(http_protocol.WebRequest):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._parsePOSTFormSubmission = False  # Twisted's own form parsing (see the module docstring)


class ClosingWebSocketFactory(WebSocketFactory):
    def setProtocolOptions(self, **options: Any) -> None:
        super().setProtocolOptions(**options, failByDrop=False)


class DrainingServer(daphne_server.Server):
    """daphne that drains on SIGTERM (see the module docstring)."""

    POLL = 0.1  # seconds between looks at what is still in flight

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.signal_handlers = False  # Twisted's would stop the reactor at once; ours drain first
        self.grace = float(os.environ.get("LLMSERVE_SHUTDOWN_GRACE", "30"))
        self._ports: list[Any] = []
        self._drain_started: float | None = None
        self._failed = False

    def run(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: reactor.callFromThread(self.drain))
        super().run()

    def listen_success(self, port: Any) -> None:
        self._ports.append(port)
        super().listen_success(port)

    def drain(self) -> None:
        if self._drain_started is not None:  # a second signal: no more waiting
            self.stop()
            return
        self._drain_started = time.monotonic()
        for port in self._ports:
            port.stopListening()
        for client in _bus_clients():
            client.drain()
        self._check_drained()

    def _busy(self) -> int:
        """HTTP requests still being answered, and generations still streaming (chat answers included)."""
        requests = sum(
            1
            for protocol, details in self.connections.items()
            if not isinstance(protocol, WebSocketProtocol)
            and details.get("application_instance") is not None
            and not details["application_instance"].done()
        )
        return requests + sum(client.inflight for client in _bus_clients())

    def _check_drained(self) -> None:
        waited = time.monotonic() - self._drain_started
        if not self._busy() or waited > self.grace + 10:
            for protocol in list(self.connections):
                if isinstance(protocol, WebSocketProtocol):
                    # 1001, going away: a code autobahn lets only its own frames carry (not sendClose's)
                    protocol.sendCloseFrame(code=1001, isReply=False)
            reactor.callLater(0.5, self.stop)  # the last bytes and close frames go out first
            return
        if waited > self.grace and not self._failed:
            from inference_engine.errors import EngineUnavailableError

            self._failed = True
            error = EngineUnavailableError("the server shut down before this answer finished; retry it.")
            for client in _bus_clients():
                client.fail_inflight(error)
        reactor.callLater(self.POLL, self._check_drained)


def _bus_clients() -> list[Any]:
    from llmserve import bus

    return bus.async_clients()


def _message_limit() -> int:
    import os

    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hostproject.settings")
    django.setup()
    from llmserve import conf

    return 2 * int(conf.get("MAX_BODY_BYTES"))


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    http_protocol.WebRequest = WebRequest  # what daphne's protocol factory instantiates per request
    cli.AccessLogGenerator = RedactingAccessLog  # what daphne's command line builds its access log with
    daphne_server.WebSocketFactory = ClosingWebSocketFactory  # what daphne's server builds its factory with
    cli.CommandLineInterface.server_class = DrainingServer
    if not any(a.startswith(("--websocket-max-message-size", "--websocket-max-frame-size")) for a in args):
        limit = str(_message_limit())
        args = ["--websocket-max-message-size", limit, "--websocket-max-frame-size", limit, *args]
    cli.CommandLineInterface().run(args)


if __name__ == "__main__":
    main()
