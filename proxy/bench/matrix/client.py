"""The matrix's clients: one request over one transport (raw HTTP/1.1 for ``fin`` and ``rst``,
httpcore for an SDK's ``abort``, a WebSocket of its own), the bodies they send, and the moment
each leave closed (or shut down) its socket, the start of every cancel latency. Every request
names a trace of its own (a W3C ``traceparent``, sampled), so that its spans can be found."""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import struct
import time
from collections.abc import Callable
from typing import Any, Final, Literal

import httpcore
import trio

from proxy.bench.matrix.cells import (
    LOCAL_LONG_TOKENS,
    LOCAL_PREFILL_REPEAT,
    LOCAL_SHORT_TOKENS,
    OBSERVE_TIMEOUT,
    PATHS,
    RECV_SIZE,
)
from proxy.protocol.http1 import ProtocolError, ResponseReader, encode_request
from proxy.relay.state import Phase

# Not a phase: the plain request that asks whether the system still serves (short, as for
# after_last).
PROBE: Final = "probe"


def request_body(endpoint: str, model: str, *, stream: bool) -> dict[str, Any]:
    text = "Say something."
    if endpoint == "chat":
        return {"model": model, "messages": [{"role": "user", "content": text}], "stream": stream}
    if endpoint == "completions":
        return {"model": model, "prompt": text, "stream": stream}
    if endpoint == "responses":
        return {"model": model, "input": text, "stream": stream}
    return {
        "model": model,
        "max_tokens": 4096,
        "messages": [{"role": "user", "content": text}],
        "stream": stream,
    }


def local_body(phase: Phase | Literal["probe"], model: str, *, stream: bool) -> dict[str, Any]:
    """A chat request to a local model: greedy, with EOS ignored so that the answer is as long
    as the phase needs (a long prompt for first_token, a short answer for after_last)."""
    text = "Say something. " * (LOCAL_PREFILL_REPEAT if phase == Phase.FIRST_TOKEN else 1)
    return {
        "model": model,
        "messages": [{"role": "user", "content": text.strip()}],
        "stream": stream,
        "max_tokens": (
            LOCAL_SHORT_TOKENS if phase in (Phase.AFTER_LAST, PROBE) else LOCAL_LONG_TOKENS
        ),
        "temperature": 0,
        "ignore_eos": True,
    }


def traceparent(trace_id: str) -> str:
    """A W3C ``traceparent`` naming ``trace_id`` (a parent span of its own; sampled)."""
    return f"00-{trace_id}-{secrets.token_hex(8)}-01"


def _http_request(
    address: tuple[str, int],
    path: str,
    body: dict[str, Any],
    api_key: str,
    parent: str,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> bytes:
    data = json.dumps(body).encode()
    headers = [
        (b"Host", f"{address[0]}:{address[1]}".encode("latin-1")),
        (b"Content-Type", b"application/json"),
        (b"Authorization", f"Bearer {api_key}".encode("latin-1")),
        (b"traceparent", parent.encode("latin-1")),
        (b"Content-Length", str(len(data)).encode()),
        *(extra or []),
    ]
    return encode_request(b"POST", path.encode("latin-1"), headers, data)


def _linger_zero(sock: socket.socket | trio.socket.SocketType) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class _ClockedStream(httpcore.AsyncNetworkStream):
    """An SDK's connection that notes when it closes its socket: the moment a proxy can see
    the client go, after the client library's own unwinding."""

    def __init__(self, inner: httpcore.AsyncNetworkStream, closed: Callable[[], None]) -> None:
        self._inner = inner
        self._closed = closed

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109 - httpcore's signature
        return await self._inner.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109 - httpcore's signature
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        self._closed()
        await self._inner.aclose()

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _ClockedBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, closed: Callable[[], None]) -> None:
        self._inner = httpcore.TrioBackend()
        self._closed = closed

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        return _ClockedStream(stream, self._closed)

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class Client:
    """One request over one transport, left in one way. ``start`` runs it in ``nursery``;
    ``received`` (bytes; WebSocket: messages), ``events`` (SSE ``data:`` lines; WebSocket:
    messages), ``head`` and ``done`` say what arrived; ``leave`` leaves and returns the
    moment its socket was closed, or shut down (``time.monotonic()``). ``trace_id``: the
    trace its ``traceparent`` names, on every transport (over WebSocket, the handshake's)."""

    def __init__(
        self,
        address: tuple[str, int],
        endpoint: str,
        model: str,
        transport: str,
        *,
        api_key: str = "sk-matrix",
        body: dict[str, Any] | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ):
        self.address = address
        # What the system needs on every request besides the key (a gateway's routing).
        self.extra_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        self.endpoint = endpoint
        self.model = model
        self.transport = transport
        self.api_key = api_key
        self.body = body or request_body(endpoint, model, stream=transport != "json")
        self.trace_id = secrets.token_hex(16)
        self.traceparent = traceparent(self.trace_id)
        self.received = 0
        self.events = 0
        self.head = trio.Event()
        self.done = trio.Event()
        self.failed: str | None = None
        self._scope = trio.CancelScope()
        self._sock: trio.socket.SocketType | None = None
        self._stream: trio.SocketStream | None = None
        self._ws: Any = None
        self._socket_closed = trio.Event()
        self._socket_closed_at: float | None = None

    async def start(self, nursery: trio.Nursery, leave: str) -> None:
        if self.transport == "ws":
            await self._start_ws(nursery)
        elif leave == "abort":
            nursery.start_soon(self._run_sdk)
        else:
            await self._start_raw(nursery)

    # Raw sockets: FIN and RST.
    async def _start_raw(self, nursery: trio.Nursery) -> None:
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock = sock
        await sock.connect(self.address)
        data = _http_request(
            self.address,
            PATHS[self.endpoint],
            self.body,
            self.api_key,
            self.traceparent,
            self.extra_headers,
        )
        while data:
            sent = await sock.send(data)
            data = data[sent:]
        nursery.start_soon(self._read_raw, sock)

    async def _read_raw(self, sock: trio.socket.SocketType) -> None:
        # The client side of protocol/http1.py, the relay's own: it says when the head and
        # the whole answer have come. None once the answer broke it: then only drained.
        reader: ResponseReader | None = ResponseReader()
        with self._scope:
            try:
                while True:
                    data = await sock.recv(RECV_SIZE)
                    if not data:
                        # The proxy closed: an answer delimited by the close is whole too.
                        self.done.set()
                        break
                    self.received += len(data)
                    if reader is None:
                        continue
                    try:
                        self.events += reader.feed(data).count(b"data:")
                    except ProtocolError as exc:
                        self.failed, reader = repr(exc), None
                        continue
                    if reader.head is not None:
                        self.head.set()
                    if reader.complete:
                        self.done.set()
            except (OSError, trio.ClosedResourceError) as exc:
                self.failed = repr(exc)

    # The SDK-style abort: the response closed before its end, as the OpenAI SDK's ``close()``
    # or a timeout does, through httpcore (the connection layer its httpx runs on), whose
    # socket's close is the clock.
    async def _run_sdk(self) -> None:
        url = f"http://{self.address[0]}:{self.address[1]}{PATHS[self.endpoint]}"
        headers = [
            (b"Content-Type", b"application/json"),
            (b"Authorization", f"Bearer {self.api_key}".encode()),
            (b"traceparent", self.traceparent.encode()),
            *self.extra_headers,
        ]
        content = json.dumps(self.body).encode()
        with self._scope:
            try:
                async with (
                    httpcore.AsyncConnectionPool(
                        network_backend=_ClockedBackend(self._closing)
                    ) as pool,
                    pool.stream("POST", url, headers=headers, content=content) as response,
                ):
                    self.head.set()
                    async for chunk in response.aiter_stream():
                        self.received += len(chunk)
                        self.events += chunk.count(b"data:")
                    self.done.set()
                    await trio.sleep_forever()
            except (
                httpcore.NetworkError,
                httpcore.ProtocolError,
                httpcore.TimeoutException,
            ) as exc:
                self.failed = repr(exc)

    def _closing(self) -> None:
        if self._socket_closed_at is None:
            self._socket_closed_at = time.monotonic()
            self._socket_closed.set()

    # WebSocket: /v1/ws over a socket of our own, so that FIN and RST are ours to send.
    async def _start_ws(self, nursery: trio.Nursery) -> None:
        from trio_websocket import wrap_client_stream

        stream = await trio.open_tcp_stream(*self.address)
        self._stream = stream
        host = f"{self.address[0]}:{self.address[1]}"
        self._ws = await wrap_client_stream(
            nursery,
            stream,
            host,
            "/v1/ws",
            extra_headers=[
                (b"authorization", f"Bearer {self.api_key}".encode()),
                (b"traceparent", self.traceparent.encode()),
                *self.extra_headers,
            ],
        )
        body = dict(self.body)
        body.pop("stream", None)
        await self._ws.send_message(json.dumps(body))
        self.head.set()
        nursery.start_soon(self._read_ws)

    async def _read_ws(self) -> None:
        from trio_websocket import ConnectionClosed

        with self._scope:
            try:
                while True:
                    message = json.loads(await self._ws.get_message())
                    self.received += 1
                    self.events += 1
                    if message.get("type") in ("done", "error"):
                        self.done.set()
            except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    async def leave(self, how: str) -> float:
        """FIN is ``shutdown(SHUT_WR)``: a ``close()`` with unread bytes would send RST instead.
        The reader drains until ``close()`` ends the trial."""
        if self.transport == "ws":
            assert self._stream is not None
            if how == "abort":
                left = time.monotonic()
                with trio.move_on_after(1):
                    await self._ws.aclose()
            elif how == "fin":
                left = time.monotonic()
                self._stream.socket.shutdown(socket.SHUT_WR)
            else:
                _linger_zero(self._stream.socket)
                self._scope.cancel()
                left = time.monotonic()
                await trio.aclose_forcefully(self._stream)
        elif self._sock is not None:
            left = time.monotonic()
            if how == "fin":
                self._sock.shutdown(socket.SHUT_WR)
            else:
                _linger_zero(self._sock)
                self._scope.cancel()
                self._sock.close()
        else:
            self._scope.cancel()
            with trio.move_on_after(OBSERVE_TIMEOUT):
                await self._socket_closed.wait()
            left = self._socket_closed_at or time.monotonic()
        return left

    async def close(self) -> None:
        """End whatever is left of this client (the trial is over)."""
        self._scope.cancel()
        if self._sock is not None:
            self._sock.close()
        if self._stream is not None:
            await trio.aclose_forcefully(self._stream)
