"""The fake upstream's server: it accepts connections (TLS and the ``accept_delay`` hold
first), reads requests off each, and routes them: ``CONNECT`` (as its own proxy), its
``/_fake/`` control endpoints, ``/metrics``, and the model endpoints, whose answers
(``answers``) the serving model admits and the ``Responder`` sends on their schedule, while a
watcher notices the client leave in any phase.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import ssl
import struct
import time
from functools import partial
from typing import Any

import trio

from proxy.testing.fake_upstream.answers import (
    JSON_ENDPOINTS,
    MESSAGES_PATH,
    TRANSCRIPTIONS_PATH,
    Transcription,
    Upload,
)
from proxy.testing.fake_upstream.behaviours import (
    FakeSettings,
    Invalid,
    Plan,
    Responder,
    ServingModel,
    hold,
    next_request_wanted,
)
from proxy.testing.fake_upstream.clock import Ticker
from proxy.testing.fake_upstream.recorder import Recorder, RequestRecord
from proxy.testing.fake_upstream.wire import (
    Answer,
    Connection,
    End,
    HTTPError,
    Request,
    anthropic_error_body,
    error_body,
    error_response,
    http_response,
    json_response,
    until_client_leaves,
)
from proxy.testing.kv_events import FakeVllmPublisher

# How many request ids the fake remembers the attempts of (``fail_attempts``).
ATTEMPTS_KEPT = 10_000


class FakeUpstream:
    """An OpenAI-compatible server on raw trio TCP that records what it saw.

    ``settings`` is read at each request, so a test may change it between requests.
    """

    def __init__(self, settings: FakeSettings | None = None) -> None:
        self.settings = settings if settings is not None else FakeSettings()
        self.recorder = Recorder(max_records=self.settings.max_records)
        self._ticker = Ticker()
        self._responder = Responder(self.recorder, self._ticker)
        self._tls: tuple[tuple[str, str, str], ssl.SSLContext] | None = None
        self.serving = ServingModel(self.settings)
        # With kv_events_port: where its KV events are published, once serving.
        self.kv_events_endpoint = ""
        self.kv_replay_endpoint = ""
        # Attempts seen per request id, oldest first (``fail_attempts``).
        self._attempts: dict[str, int] = {}

    async def serve(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen, report the bound port through ``task_status``, serve until cancelled."""
        # Unreadable certificate files fail here, before the caller believes it is serving.
        self._tls_context()
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound: int = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._ticker.run)
            if self.settings.kv_events_port is not None:
                await nursery.start(self._publish_kv_events, host)
            await nursery.start(
                partial(
                    trio.serve_listeners,
                    self._handle_connection,
                    listeners,
                    handler_nursery=nursery,
                )
            )
            task_status.started(bound)

    async def _publish_kv_events(
        self, host: str, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """vLLM's KV-event publisher of the token-block cache, bound before the fake says it
        serves (``kv_events_endpoint``, ``kv_replay_endpoint``), closed when it stops."""
        settings = self.settings
        assert settings.kv_events_port is not None
        publisher = FakeVllmPublisher(
            host=host, port=settings.kv_events_port, replay_port=settings.kv_replay_port
        )
        try:
            self.serving.publisher = publisher
            self.kv_events_endpoint = publisher.endpoint
            self.kv_replay_endpoint = publisher.replay_endpoint
            async with trio.open_nursery() as nursery:
                nursery.start_soon(publisher.count_subscribers)
                nursery.start_soon(publisher.serve_replay)
                task_status.started()
        finally:
            self.serving.publisher = None
            publisher.close()

    def _tls_context(self) -> ssl.SSLContext | None:
        """The server context of the current settings, None for plain HTTP."""
        settings = self.settings
        if not settings.tls_cert:
            return None
        files = (settings.tls_cert, settings.tls_key, settings.tls_client_ca)
        if self._tls is None or self._tls[0] != files:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(settings.tls_cert, settings.tls_key)
            context.set_alpn_protocols(["http/1.1"])
            if settings.tls_client_ca:
                # This CA alone: the system store must not vouch for a client.
                context.load_verify_locations(cafile=settings.tls_client_ca)
                context.verify_mode = ssl.CERT_REQUIRED
            self._tls = (files, context)
        return self._tls[1]

    async def _handle_connection(self, tcp: trio.SocketStream) -> None:
        conn = Connection(tcp, self.recorder._connection_opened())
        ending = End.CLOSE
        try:
            if self.settings.sndbuf is not None:
                tcp.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.settings.sndbuf)
            held = self.settings.accept_delay > 0 and self._tls_context() is None
            if held and not await hold(conn, self.settings.accept_delay, self.recorder):
                return
            # Behind the fake's own proxy, TLS starts inside the tunnel, after CONNECT.
            if not self.settings.via_proxy:
                await self._start_tls(conn)
            ending = await self._serve_connection(conn)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # The client vanished between requests: nobody to answer and nothing to record.
            ending = End.CLOSE
        finally:
            if ending is End.RESET:
                # Linger on with timeout 0 makes close() send RST instead of FIN.
                linger = struct.pack("ii", 1, 0)
                with contextlib.suppress(OSError):
                    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
            await trio.aclose_forcefully(conn.stream)
            self.recorder._connection_closed()

    async def _start_tls(self, conn: Connection) -> None:
        """Secure the connection if the settings say HTTPS; raise BrokenResourceError if the
        handshake fails."""
        context = self._tls_context()
        if context is None:
            return
        # https_compatible: an HTTP client may close without close_notify (RFC 9112 §9.8).
        stream = trio.SSLStream(conn.tcp, context, server_side=True, https_compatible=True)
        try:
            await stream.do_handshake()
        except trio.BrokenResourceError:
            self.recorder._tls_failed()
            raise
        conn.secured(stream)

    async def _serve_connection(self, conn: Connection) -> End:
        answered = False
        while True:
            if answered and not await next_request_wanted(self.settings, conn):
                return End.CLOSE
            try:
                request = await conn.read_request()
            except HTTPError as exc:
                response = error_response(exc.status, exc.message, keep_alive=False)
                await conn.stream.send_all(response)
                return End.CLOSE
            if request is None:
                return End.CLOSE
            if request.method == "CONNECT":
                ending = await self._serve_connect(conn, request)
                # The tunnel is a fresh connection to its client: the habits start over.
                answered = False
            elif request.path.startswith("/_fake/"):
                ending = await self._serve_control(conn, request)
                answered = True
            elif request.path == "/metrics" and request.method == "GET":
                ending = await self._serve_metrics(conn, request)
                answered = True
            else:
                ending = await self._serve_request(conn, request)
                answered = True
            if ending is not End.KEEP:
                return ending

    async def _serve_connect(self, conn: Connection, request: Request) -> End:
        """Open a tunnel to the requested origin, which is the fake whatever its name."""
        if not self.settings.via_proxy or conn.tunnel is not None:
            message = "the fake upstream is no proxy here (via_proxy is off, or in a tunnel)"
            await conn.stream.send_all(error_response(405, message, keep_alive=False))
            return End.CLOSE
        target = request.path
        host, _, port = target.rpartition(":")
        if not host or not port.isdigit():
            message = f"CONNECT needs host:port, not {target!r}"
            await conn.stream.send_all(error_response(400, message, keep_alive=False))
            return End.CLOSE
        conn.tunnel = target
        self.recorder._tunnel_opened(target)
        await conn.stream.send_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
        if self.settings.tls_cert:
            if conn.buf:
                # A TLS client waits for the 200; what came before it is no handshake.
                return End.CLOSE
            await self._start_tls(conn)
        return End.KEEP

    def metrics_text(self) -> str:
        """What GET /metrics answers: vLLM's names, this fake's figures."""
        return self.serving.metrics_text(self.settings)

    async def _serve_metrics(self, conn: Connection, request: Request) -> End:
        keep = request.keep_alive
        body = self.metrics_text().encode()
        status = self.settings.metrics_status
        content_type = "text/plain; version=0.0.4; charset=utf-8"
        await conn.stream.send_all(
            http_response(status, body, keep_alive=keep, content_type=content_type)
        )
        return End.KEEP if keep else End.CLOSE

    async def _serve_control(self, conn: Connection, request: Request) -> End:
        """The fake's own endpoints: not recorded, never subject to fault injection."""
        keep = request.keep_alive
        if request.path == "/_fake/requests" and request.method == "GET":
            since = 0
            for pair in request.query.split("&"):
                name, _, value = pair.partition("=")
                if name == "since" and value.isdigit():
                    since = int(value)
            records = [r.to_json() for r in self.recorder.records if r.id >= since]
            response = json_response(200, records, keep_alive=keep)
        else:
            response = error_response(404, f"no such endpoint: {request.path}", keep_alive=keep)
        await conn.stream.send_all(response)
        return End.KEEP if keep else End.CLOSE

    async def _serve_request(self, conn: Connection, request: Request) -> End:
        body = _parse_json_object(request.body)
        record = self.recorder._new_record(conn, request, body)
        ending = End.CLOSE
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_client, conn, record, nursery.cancel_scope)
            try:
                ending = await self._respond(conn, request, record)
            except trio.BrokenResourceError:
                # A write failed before the watcher saw the EOF or reset.
                self.recorder._disconnected(record)
                ending = End.CLOSE
            nursery.cancel_scope.cancel()
        if record.outcome == "client_disconnected":
            return End.CLOSE
        return ending

    async def _watch_client(
        self, conn: Connection, record: RequestRecord, scope: trio.CancelScope
    ) -> None:
        """Notice a client that leaves while the fake is busy, in any phase, without a write.

        Bytes read here (a pipelined next request) are kept for the next ``read_request``;
        cancelling ``receive_some`` loses nothing, since trio cancels only before a read.
        """
        await until_client_leaves(conn)
        self.recorder._disconnected(record)
        scope.cancel()

    async def _respond(self, conn: Connection, request: Request, record: RequestRecord) -> End:
        keep = request.keep_alive
        plain = End.KEEP if keep else End.CLOSE
        path, method = request.path, request.method
        settings = self.settings
        if settings.via_proxy and not record.via_proxy:
            message = "this fake upstream answers only through a proxy (it is one: use it)"
            response = error_response(403, message, keep_alive=keep)
        elif path in JSON_ENDPOINTS or path == TRANSCRIPTIONS_PATH:
            errors = anthropic_error_body if path == MESSAGES_PATH else error_body
            if method != "POST":
                response = http_response(405, errors(405, f"use POST for {path}"), keep_alive=keep)
            else:
                try:
                    plan, answer = self._plan_answer(request, record)
                except Invalid as exc:
                    response = http_response(400, errors(400, str(exc)), keep_alive=keep)
                else:
                    self.recorder._planned(record, plan.mode)
                    async with self.serving.admitted(settings, record, plan) as plan:
                        return await self._responder.send(
                            conn, request, record, plan, answer, errors
                        )
        elif path == "/health" and method == "GET":
            response = http_response(200, b"", keep_alive=keep, content_type=None)
        elif path == "/v1/models" and method == "GET":
            response = json_response(200, self._models(), keep_alive=keep)
        elif path in ("/health", "/v1/models"):
            response = error_response(405, f"use GET for {path}", keep_alive=keep)
        else:
            response = error_response(404, f"no such endpoint: {path}", keep_alive=keep)
        await conn.stream.send_all(response)
        self.recorder._finish(record, "completed")
        return plain

    def _plan_answer(self, request: Request, record: RequestRecord) -> tuple[Plan, Answer]:
        """The plan and the answer of a model endpoint's request; raise Invalid for a 400."""
        settings = self.settings
        default_model = settings.models[0]
        if request.path == TRANSCRIPTIONS_PATH:
            upload = Upload.parse(request.headers.get("content-type", ""), request.body)
            self.recorder._form_parsed(record, upload.fields)
            steering: dict[str, Any] = {}
            if "fake" in upload.fields:
                fake = _parse_json_object(upload.fields["fake"].encode())
                if fake is None:
                    raise Invalid('the "fake" field must be a JSON object')
                steering["fake"] = fake
            plan = Plan.build(settings, steering)
            answer = Transcription.build(upload, request.body, plan, default_model, record.id)
            return plan, answer
        if record.body is None:
            raise Invalid("request body must be a JSON object")
        plan = Plan.build(settings, record.body)
        if plan.fail_attempts and plan.mode != "ok":
            plan = self._attempted(plan, request.headers.get("x-request-id", ""))
        build = JSON_ENDPOINTS[request.path]
        return plan, build(record.body, plan, default_model, record.id)

    def _attempted(self, plan: Plan, request_id: str) -> Plan:
        """``plan`` for this attempt of the request ``request_id``: its fault for the first
        ``fail_attempts``, an answer after them. The attempts of the last ATTEMPTS_KEPT
        request ids are remembered."""
        attempts = self._attempts.pop(request_id, 0) + 1
        self._attempts[request_id] = attempts
        while len(self._attempts) > ATTEMPTS_KEPT:
            del self._attempts[next(iter(self._attempts))]
        return plan if attempts <= plan.fail_attempts else dataclasses.replace(plan, mode="ok")

    def _models(self) -> dict[str, Any]:
        created = int(time.time())
        models = [
            {"id": name, "object": "model", "created": created, "owned_by": "sluice-fake"}
            for name in self.settings.models
        ]
        return {"object": "list", "data": models}


def _parse_json_object(raw: bytes) -> dict[str, Any] | None:
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None
