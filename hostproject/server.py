"""``python -m hostproject.server [daphne's options]``: daphne as ``scripts/run`` and the container run it,
with two changes to its HTTP layer.

- Twisted, under daphne, parses ``multipart/form-data`` bodies itself before daphne sees the request (daphne
  never uses the result) and answers one it cannot parse (no boundary) with an empty 400. Switched off: Django
  parses the body once, and the app answers a malformed one with its own error.
- The access log redacts query-string values whose name looks secret (``api_key=...``, ``token=...``): a
  client that puts its key in the URL must not leave it in the log.

Several processes may serve one port: the launcher binds the socket and passes it to each with ``--fd``.
"""

from __future__ import annotations

import re
import sys
from typing import Any

from daphne import cli, http_protocol
from daphne.access import AccessLogGenerator

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


def main(argv: list[str] | None = None) -> None:
    http_protocol.WebRequest = WebRequest  # what daphne's protocol factory instantiates per request
    cli.AccessLogGenerator = RedactingAccessLog  # what daphne's command line builds its access log with
    cli.CommandLineInterface().run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
