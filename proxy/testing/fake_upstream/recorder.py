"""What the fake records: a ``RequestRecord`` per request it served (when it arrived, when the
first token went out, when the fake was done or the client left, and tokens sent), and the
connections it saw (accepted, open, held by ``accept_delay``, closed during a hold, CONNECT
tunnels, failed TLS handshakes). Tests and the bench wait on the ``Recorder`` for a condition.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import trio

from proxy.testing.fake_upstream.wire import Connection, Request

Outcome = Literal["pending", "completed", "client_disconnected", "failed_injected"]


class NoRecordsYet(LookupError):
    """``Recorder.last()`` before any request arrived; ``wait_for`` treats it as "not yet"."""


@dataclass(eq=False)
class RequestRecord:
    """What the fake saw of one request. Times are ``trio.current_time()``; each has a
    ``*_mono`` twin from ``time.monotonic()`` for comparison across processes.

    ``finished_at`` is stamped when the last ``send_all`` returns, and a client in the same
    process may be scheduled before that and already hold every byte: to assert on a final
    outcome, ``await recorder.wait_for(lambda r: r.last().outcome != "pending")`` first.
    """

    id: int
    connection: int
    method: str
    path: str
    # The JSON body; None for another body (multipart: see ``form``) or none.
    body: dict[str, Any] | None
    headers: dict[str, str]
    received_at: float
    received_at_mono: float
    # The model the request named (JSON ``model``, or the multipart field); None if none.
    model: str | None = None
    # The text fields of a multipart/form-data body.
    form: dict[str, str] | None = None
    mode: str = "ok"
    first_token_at: float | None = None
    first_token_at_mono: float | None = None
    # When the fake's side ended as planned: response fully sent, or the injected fault done.
    finished_at: float | None = None
    finished_at_mono: float | None = None
    # When the client left (EOF or reset) before the fake was done; None otherwise.
    disconnected_at: float | None = None
    disconnected_at_mono: float | None = None
    tokens_sent: int = 0
    outcome: Outcome = "pending"
    # How it arrived. ``client_cert_cn``: the subject common name of the client certificate
    # (mTLS only). ``via_proxy``: through the fake as a proxy, as an absolute-form request or
    # inside a CONNECT tunnel; ``tunnel`` is then that tunnel's target, None for absolute-form.
    tls: bool = False
    client_cert_cn: str | None = None
    via_proxy: bool = False
    tunnel: str | None = None
    # With a prefix cache: the prompt's full blocks, and how many of them were cached.
    prefix_blocks: int | None = None
    prefix_hit_blocks: int | None = None
    # With max_running: seconds it waited for a running slot.
    queued_seconds: float | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Recorder:
    """Records of the requests the fake served, and a way to wait for a condition on them.

    Every change goes through a method here, and every change wakes ``wait_for``. The state
    transitions are synchronous, so two observers (the response task and the disconnect
    watcher) can race without leaving a record half-updated: the first final outcome wins.
    """

    def __init__(self, max_records: int = 100_000) -> None:
        self.records: list[RequestRecord] = []
        self.max_records = max_records
        self.open_connections = 0
        self.connections_accepted = 0
        # CONNECT targets ("host:port") in arrival order, bounded like the records.
        self.proxy_tunnels: list[str] = []
        # Handshakes that did not complete: a refused client certificate, a client that does
        # not trust the fake's, a client that left.
        self.tls_handshake_failures = 0
        # With ``accept_delay``: connections held now, and the ``time.monotonic()`` at which
        # each client that closed during its hold was seen to go.
        self.held_connections = 0
        self.closed_while_held: list[float] = []
        self._next_id = 0
        self._lot = trio.lowlevel.ParkingLot()

    def last(self, path: str | None = None) -> RequestRecord:
        """The newest record (with this ``path``, if given)."""
        for record in reversed(self.records):
            if path is None or record.path == path:
                return record
        raise NoRecordsYet("no matching request recorded yet")

    async def wait_for(self, predicate: Callable[[Recorder], object]) -> None:
        """Return once ``predicate(self)`` is true, re-checking after every change.

        There is no timeout argument: wrap the call in ``trio.fail_after``.
        """
        while True:
            try:
                if predicate(self):
                    return
            except NoRecordsYet:
                pass
            await self._lot.park()

    def _changed(self) -> None:
        # Called once per token at benchmark rates: skip the wake-up when nobody waits.
        if self._lot:
            self._lot.unpark_all()

    def _connection_opened(self) -> int:
        self.connections_accepted += 1
        self.open_connections += 1
        self._changed()
        return self.connections_accepted

    def _connection_closed(self) -> None:
        self.open_connections -= 1
        self._changed()

    def _new_record(
        self, conn: Connection, request: Request, body: dict[str, Any] | None
    ) -> RequestRecord:
        record = RequestRecord(
            id=self._next_id,
            connection=conn.id,
            method=request.method,
            path=request.path,
            body=body,
            headers=request.headers,
            received_at=trio.current_time(),
            received_at_mono=time.monotonic(),
            model=_named_model(body),
            tls=conn.tls,
            client_cert_cn=conn.client_cert_cn,
            via_proxy=request.absolute or conn.tunnel is not None,
            tunnel=conn.tunnel,
        )
        self._next_id += 1
        self._append(self.records, record)
        self._changed()
        return record

    def _append(self, history: list[Any], item: object) -> None:
        history.append(item)
        if len(history) > self.max_records:
            # Trim in batches so that a long benchmark does not pay O(n) per request.
            del history[: len(history) - self.max_records + self.max_records // 8]

    def _held(self, change: int) -> None:
        self.held_connections += change
        self._changed()

    def _closed_during_hold(self) -> None:
        self._append(self.closed_while_held, time.monotonic())
        self._changed()

    def _tunnel_opened(self, target: str) -> None:
        self._append(self.proxy_tunnels, target)
        self._changed()

    def _tls_failed(self) -> None:
        self.tls_handshake_failures += 1
        self._changed()

    def _form_parsed(self, record: RequestRecord, form: dict[str, str]) -> None:
        record.form = form
        record.model = _named_model(form)
        self._changed()

    def _planned(self, record: RequestRecord, mode: str) -> None:
        record.mode = mode
        self._changed()

    def _token_sent(self, record: RequestRecord, count: int = 1) -> None:
        # count=0 stamps first_token_at for an answer without tokens (its first content).
        if record.first_token_at is None:
            record.first_token_at = trio.current_time()
            record.first_token_at_mono = time.monotonic()
        record.tokens_sent += count
        self._changed()

    def _finish(self, record: RequestRecord, outcome: Outcome) -> None:
        if record.outcome != "pending":
            return
        record.outcome = outcome
        record.finished_at = trio.current_time()
        record.finished_at_mono = time.monotonic()
        self._changed()

    def _disconnected(self, record: RequestRecord) -> None:
        if record.outcome != "pending":
            return
        record.outcome = "client_disconnected"
        record.disconnected_at = trio.current_time()
        record.disconnected_at_mono = time.monotonic()
        self._changed()


def _named_model(fields: Mapping[str, Any] | None) -> str | None:
    model = fields.get("model") if fields is not None else None
    return model if isinstance(model, str) else None
