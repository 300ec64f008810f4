"""What a server hands the app's one responder, and what it gets back: a :class:`Call` in, an
:class:`Answer` out.

Every entry (the fast path, Quart's routes, the WebSocket) turns what it read into a Call and
asks the :class:`Responder` (the api layer's ``api/responder.py``) for its Answer; every Answer
is written by ``server/writer.py``. Neither type knows which server or transport carries it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from proxy.ops.logs import AccessRecord
from proxy.protocol.errors import ApiError
from proxy.relay.body import RelayBody


class HeaderLookup(Protocol):
    """A request's headers, looked up by name, case-insensitively (the first of repeated ones,
    as werkzeug's ``get`` gives)."""

    def get(self, key: str, /) -> str | None: ...


@dataclass(slots=True)
class Call:
    """One request, as its transport read it."""

    method: str
    path: str
    headers: HeaderLookup
    # The client's address, for the access line ("-" when unknown).
    client: str
    # The body, when the transport has it already (the fast path reads it whole, a WebSocket
    # message is whole); else ``read_body`` reads it, once the client is authenticated.
    body: bytes | None = None
    read_body: Callable[[], Awaitable[bytes]] | None = field(default=None, repr=False)
    # The request id the client presented (X-Request-ID); None for a WebSocket message, whose
    # handshake's header would otherwise name every message alike.
    request_id: str | None = None


@dataclass(slots=True)
class Answer:
    """An answer to a Call: its status, the headers it carries (its request id, trace and
    CORS; a refusal's own, such as Retry-After), and its body: bytes, or the relay that makes
    it (whose own head follows once its producer decides it)."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes | RelayBody
    # A refusal's error, and the request's access record (its id, its trace): for a transport
    # that words its answers itself (the WebSocket).
    error: ApiError | None = None
    access: AccessRecord | None = field(default=None, repr=False)


class Responder(Protocol):
    """The app's one way in, as the servers see it."""

    # Bodies over this many bytes are refused (413) by the HTTP server of record.
    max_body_bytes: int

    def serves(self, method: str, path: str) -> bool:
        """Whether ``method path`` is answered by :meth:`respond` (the API's POST routes)."""
        ...

    async def respond(self, call: Call) -> Answer: ...
