"""One attempt's bytes: the request built and written to one replica, its response relayed
into the sink, and every wire failure mapped to the client's error.

Each attempt runs inside the relay's nursery, so its ``async with replica.pool.stream(...)`` is
inside the request's cancel scope: when the client leaves, the stream is closed (the connection
is dropped, never pooled half-read) and the upstream server sees the disconnect and aborts the
generation.

Deadlines are trio cancel scopes, each with its own error: connect (the pool's connect
timeout), first token and idle between chunks here; total in the backend.
"""

from __future__ import annotations

import functools
import math
import re
import sys
from collections.abc import Callable

import httpx
import trio

from proxy.backends.upstream.pool import UpstreamRequest
from proxy.backends.upstream.replica import USER_AGENT, UpstreamReplica, public_name
from proxy.backends.upstream.transports import Response
from proxy.config import RelayConfig, UpstreamModel
from proxy.ops import tracing
from proxy.protocol import http1
from proxy.protocol.continuation import StreamSplice
from proxy.protocol.errors import (
    UPSTREAM_ERROR,
    ApiError,
    attributed,
    is_json,
    says_model_missing,
)
from proxy.protocol.openai import CompletionRequest, Endpoint
from proxy.protocol.rewrite import RenamingSplitter, model_renamer, rewrite_body
from proxy.protocol.sse import SSEProtocolError, SSESplitter
from proxy.protocol.stream_end import STREAM_END
from proxy.protocol.token_usage import CURRENT_METER, MeteredSplitter
from proxy.relay.body import JSON_CONTENT_TYPE, SSE_CONTENT_TYPE, Sink
from proxy.relay.state import Phase

# Upstream error bodies are passed through to the client, so they are read, but bounded.
_MAX_ERROR_BODY = 64 * 1024
# Response headers of an upstream 4xx worth passing on to the client.
_PASSED_ERROR_HEADERS = ("retry-after",)
# The most an idle deadline fires after idle_timeout (see _relay_stream).
_IDLE_SLACK = 1.0
ANTHROPIC_VERSION = b"2023-06-01"
# The Accept header, by endpoint and streaming: a pass-through takes whatever its server says.
_ACCEPT = {
    (endpoint, stream): (
        b"*/*"
        if endpoint is Endpoint.PASSTHROUGH
        else b"text/event-stream"
        if stream
        else b"application/json"
    )
    for endpoint in Endpoint
    for stream in (False, True)
}


def upstream_error(status: int, code: str, message: str, *, retryable: bool) -> ApiError:
    return ApiError(status, message, type=UPSTREAM_ERROR, code=code, retryable=retryable)


def _counted_if_won(splitter: SSESplitter, sink: Sink, events: list[bytes]) -> list[bytes]:
    """The first events, metered once the head is begun, if this attempt's stream is the
    client's now (a hedge's losing attempt is cancelled: what it read is nobody's)."""
    if isinstance(splitter, MeteredSplitter) and sink.started:
        return splitter.begin_counting(events)
    return events


class UpstreamExchange:
    """One model's way of exchanging a request with a replica: ``await exchange(replica,
    request, request_id, sink)`` writes the request, relays the response into ``sink``, and
    raises the client's ApiError (``retryable`` set) for whatever went wrong on the wire."""

    def __init__(
        self, model: UpstreamModel, relay: RelayConfig, *, api_key: str | None = None
    ) -> None:
        self.model = model
        self._relay = relay
        self._authorization = f"Bearer {api_key}".encode() if api_key else None
        # A model the upstream knows by another name: requests are sent with that name, and
        # answers come back with the model's own. None without an alias: nothing to do.
        self._rename = model_renamer(model.upstream_model, model.name)

    def named(self, replica: UpstreamReplica) -> str:
        """The replica as clients hear of it: its place in the model's table."""
        return public_name(self.model.name, self.model.upstreams, replica.url)

    def request(
        self,
        replica: UpstreamReplica,
        request: CompletionRequest,
        request_id: str,
        on_sent: Callable[[], None] | None = None,
        trace_headers: list[tuple[bytes, bytes]] | None = None,
    ) -> UpstreamRequest:
        # Headers built from scratch: nothing of the client's (its Authorization above all)
        # reaches the upstream. The body is the client's bytes, as they came, unless the
        # upstream knows the model by another name (and the client named it).
        body = request.raw
        if self._rename is not None and request.model:
            body = rewrite_body(request, {"model": self.model.upstream_model})
        headers = [
            (b"host", replica.host_header),
            (b"user-agent", USER_AGENT),
            (b"content-type", request.content_type.encode("latin-1")),
            (b"accept", _ACCEPT[request.endpoint, request.stream]),
            (b"accept-encoding", b"identity"),
            (b"content-length", str(len(body)).encode()),
            (b"x-request-id", request_id.encode()),
        ]
        if self._authorization is not None:
            headers.append((b"authorization", self._authorization))
        if request.endpoint is Endpoint.MESSAGES:
            # The Messages API is versioned by this header (vLLM ignores it; Anthropic's
            # own API requires it).
            headers.append((b"anthropic-version", ANTHROPIC_VERSION))
        if trace_headers is not None:
            # traceparent (and tracestate): this attempt's span is the upstream's parent.
            headers.extend(trace_headers)
        # Reads are bounded by the relay's own deadlines (first token, idle, total).
        return UpstreamRequest(
            replica.origin,
            b"POST",
            replica.target(request),
            headers,
            body,
            connect_timeout=self.model.connect_timeout,
            on_sent=on_sent,
        )

    async def __call__(
        self,
        replica: UpstreamReplica,
        request: CompletionRequest,
        request_id: str,
        sink: Sink,
        splice: StreamSplice | None = None,
    ) -> None:
        """``splice``: a stream that may be paused, whose events handed to the client it
        records; once paused, ``request`` is its continuation, whose events it splices."""
        active = tracing.ACTIVE
        attempt = (
            None
            if active is None
            else active.attempt(replica.url, replica.origin.host, replica.origin.port)
        )
        if attempt is None:
            await self._exchange(replica, request, request_id, sink, None, splice)
            return
        # Every exit ends the attempt's span with its own outcome (trio.Cancelled included:
        # a BaseException, which the SDK's context managers would not classify).
        try:
            await self._exchange(replica, request, request_id, sink, attempt.headers, splice)
        except ApiError as error:
            attempt.finish(error.code or "error", error=True)
            raise
        except BaseException:
            lost = getattr(sink, "lost", False)
            attempt.finish("hedge_lost" if lost else "cancelled")
            raise
        attempt.finish("completed")

    async def _exchange(
        self,
        replica: UpstreamReplica,
        request: CompletionRequest,
        request_id: str,
        sink: Sink,
        trace_headers: list[tuple[bytes, bytes]] | None,
        splice: StreamSplice | None = None,
    ) -> None:
        first_token_deadline = (
            trio.current_time() + self.model.first_token_timeout if request.stream else math.inf
        )
        outgoing = self.request(
            replica,
            request,
            request_id,
            functools.partial(sink.set_phase, Phase.HEAD),
            trace_headers,
        )
        try:
            with trio.CancelScope(deadline=first_token_deadline) as read_scope:
                async with replica.pool.stream(outgoing) as response:
                    sink.on_disconnect(response.abort)
                    sink.set_phase(Phase.FIRST_TOKEN)
                    if response.status_code != 200:
                        await self._relay_error_response(replica, response, sink)
                    elif request.endpoint is Endpoint.PASSTHROUGH and request.stream:
                        await self._relay_bytes(response, read_scope, sink)
                    elif request.stream:
                        await self._relay_stream(
                            replica,
                            response,
                            read_scope,
                            sink,
                            STREAM_END[request.endpoint],
                            splice,
                        )
                    else:
                        await self._relay_whole(replica, request.endpoint, response, sink)
        except (httpx.TransportError, httpx.StreamError, SSEProtocolError) as error:
            raise self._wire_error(replica, error, started=sink.started) from None
        if read_scope.cancelled_caught:
            raise self._deadline_error(replica, started=sink.started)

    def _wire_error(self, replica: UpstreamReplica, error: Exception, *, started: bool) -> ApiError:
        """The client's error for a failure of the connection, the proxy or the stream's
        framing. Only what failed before the head reached the client may be retried."""
        if isinstance(error, httpx.ConnectTimeout):
            return upstream_error(
                504,
                "upstream_connect_timeout",
                f"could not connect to {self.named(replica)} within "
                f"{self.model.connect_timeout:g}s",
                retryable=True,
            )
        if isinstance(error, httpx.ProxyError):
            # The proxy refused the tunnel (407: credentials; 403: not allowed there...).
            return upstream_error(
                502,
                "upstream_proxy_error",
                f"the proxy to {self.named(replica)} refused: {reason(error, replica)}",
                retryable=True,
            )
        if isinstance(error, httpx.ConnectError):
            return upstream_error(
                502,
                "upstream_connect_error",
                f"could not connect to {self.named(replica)}: {reason(error, replica)}",
                retryable=True,
            )
        if isinstance(error, SSEProtocolError):
            return upstream_error(
                502, "upstream_malformed", f"{self.named(replica)}: {error}", retryable=not started
            )
        return upstream_error(
            502,
            "upstream_protocol_error",
            f"the connection to {self.named(replica)} failed: "
            f"{type(error).__name__}: {reason(error, replica)}",
            retryable=not started,
        )

    def _deadline_error(self, replica: UpstreamReplica, *, started: bool) -> ApiError:
        """The read deadline fired: the idle one once the stream has begun, else the first
        token's."""
        if started:
            return upstream_error(
                504,
                "upstream_idle_timeout",
                f"{self.named(replica)} sent nothing for idle_timeout={self.model.idle_timeout:g}s "
                "in the middle of the stream",
                retryable=False,
            )
        return upstream_error(
            504,
            "upstream_first_token_timeout",
            f"{self.named(replica)} sent no token within first_token_timeout="
            f"{self.model.first_token_timeout:g}s",
            retryable=True,
        )

    async def _relay_stream(
        self,
        replica: UpstreamReplica,
        response: Response,
        read_scope: trio.CancelScope,
        sink: Sink,
        ends_stream: Callable[[bytes], bool],
        splice: StreamSplice | None = None,
    ) -> None:
        """Relay an SSE stream event by event; it must end with the endpoint's own last event
        (``ends_stream``: chat's ``data: [DONE]``, Responses' ``response.completed``...), or it
        was cut. With ``splice``, what reaches the client is recorded (it may be paused), and a
        continuation's events are spliced into the client's stream before they are metered."""
        content_type = response.headers.get("content-type", "")
        if not content_type.startswith("text/event-stream"):
            raise SSEProtocolError(
                f"answered a streaming request with content-type {content_type!r}"
            )
        decoder = self._decoder(replica, response, streaming=True)
        idle_timeout = self.model.idle_timeout
        # The idle deadline is moved only once it is closer than idle_timeout, and then to
        # idle_timeout + slack from now: a stream is cut between idle_timeout and
        # idle_timeout + slack after its last chunk, and a deadline change (a context manager
        # and a heap push in trio) happens about once per slack, not per chunk.
        slack = min(idle_timeout / 10, _IDLE_SLACK)
        # A metered request (a key with a token budget) counts its events as they are split.
        meter = CURRENT_METER.get()
        splitter: SSESplitter
        if meter is not None:
            splitter = MeteredSplitter(
                self._relay.max_event_bytes,
                meter,
                self._rename,
                splice.events if splice is not None and splice.pieces else None,
                checked=True,
                counting=sink.started,
            )
        elif self._rename is None:
            splitter = SSESplitter(self._relay.max_event_bytes, checked=True)
        else:
            splitter = RenamingSplitter(self._relay.max_event_bytes, self._rename, checked=True)
        saw_done = False
        async for chunk in response.chunks():
            events = splitter.feed(chunk if decoder is None else decode(decoder, chunk))
            if not events:
                if splitter.malformed is not None:
                    raise splitter.malformed
                continue
            if not sink.started:
                sink.begin(200, SSE_CONTENT_TYPE)
                events = _counted_if_won(splitter, sink, events)
            for event in events:
                if ends_stream(event):
                    saw_done = True
            # The events one read brought go out in one write (the same bytes, fewer sends):
            # a loaded loop reads several per socket, and nothing waits for a later read.
            out = events[0] if len(events) == 1 else b"".join(events)
            if not sink.offer(out):
                # Waiting on the client now: the upstream is not the one being idle.
                read_scope.deadline = math.inf
                await sink.send(out)
            if splice is not None:
                splice.delivered(out)
            if splitter.malformed is not None:
                # The events before the bad one are the client's (relayed above); nothing
                # after it is read, counted or sent.
                raise splitter.malformed
            # Outside [now + idle_timeout, now + idle_timeout + slack]: still the first-token
            # deadline, inf after waiting on the client, or due for its move.
            now = trio.current_time()
            if not 0.0 <= read_scope.deadline - now - idle_timeout <= slack:
                read_scope.deadline = now + idle_timeout + slack
        if not saw_done:
            raise upstream_error(
                502,
                "upstream_protocol_error",
                f"{self.named(replica)} ended the stream before its last event",
                retryable=not sink.started,
            )

    async def _relay_bytes(
        self,
        response: Response,
        read_scope: trio.CancelScope,
        sink: Sink,
    ) -> None:
        """A streamed pass-through: its bytes as they come, with the upstream's content type
        and encoding (nothing here knows their format). The idle deadline applies as to SSE."""
        content_type = response.headers.get("content-type", "application/octet-stream")
        headers = {}
        if "content-encoding" in response.headers:
            headers["Content-Encoding"] = response.headers["content-encoding"]
        idle_timeout = self.model.idle_timeout
        # An aliased model's event stream is renamed event by event (whole events only: a name
        # may be split across chunks); any other stream's bytes pass as they come.
        splitter = (
            RenamingSplitter(self._relay.max_event_bytes, self._rename)
            if self._rename is not None
            and not headers
            and content_type.startswith("text/event-stream")
            else None
        )
        async for chunk in response.chunks():
            if splitter is not None:
                chunk = b"".join(splitter.feed(chunk))
                if not chunk:
                    read_scope.deadline = trio.current_time() + idle_timeout
                    continue
            if not sink.started:
                sink.begin(200, content_type, headers)
            if not sink.offer(chunk):
                read_scope.deadline = math.inf
                await sink.send(chunk)
            read_scope.deadline = trio.current_time() + idle_timeout
        if splitter is not None and splitter.pending:
            # An unterminated last event: the client gets it as the upstream ended it.
            if not sink.started:
                sink.begin(200, content_type, headers)
            await sink.send(splitter.renamed_pending)
        if not sink.started:
            sink.begin(200, content_type, headers, content_length=0)

    def _decoder(
        self, replica: UpstreamReplica, response: Response, *, streaming: bool
    ) -> http1.ContentDecoder | None:
        """A decoder for a body the server encoded though asked not to; None for identity (or,
        for a whole body, an encoding passed on with its Content-Encoding)."""
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding in ("", "identity"):
            return None
        if encoding in http1.DECODABLE_ENCODINGS:
            if streaming:
                # A stream has no total: each chunk's output is bounded like an event.
                return http1.ContentDecoder(encoding, sys.maxsize, self._relay.max_event_bytes)
            return http1.ContentDecoder(encoding, self._relay.max_response_bytes)
        if streaming:
            raise upstream_error(
                502,
                "upstream_encoding",
                f"{self.named(replica)} sent its stream with Content-Encoding {encoding!r}, which "
                "Sluice cannot decode (it asks for identity)",
                retryable=False,
            )
        return None

    async def _relay_whole(
        self, replica: UpstreamReplica, endpoint: Endpoint, response: Response, sink: Sink
    ) -> None:
        body = await _read_bounded(response, self._relay.max_response_bytes)
        content_type = response.headers.get("content-type", JSON_CONTENT_TYPE)
        headers: dict[str, str] = {}
        decoder = self._decoder(replica, response, streaming=False)
        if decoder is not None:
            body = decode(decoder, body)
        elif "content-encoding" in response.headers:
            # Not ours to decode: passed on with its encoding, never mislabelled.
            headers["Content-Encoding"] = response.headers["content-encoding"]
        # An API answer is JSON; anything else (an HTML page from a wrong URL, a body cut
        # short) is the upstream's fault, as the same in a stream is upstream_malformed.
        checked = endpoint is not Endpoint.PASSTHROUGH and "Content-Encoding" not in headers
        if checked and not is_json(body):
            snippet = body[:200].decode("utf-8", "replace")
            raise upstream_error(
                502,
                "upstream_malformed",
                f"{self.named(replica)} answered 200 with a body that is not JSON "
                f"({content_type}): {snippet!r}",
                retryable=True,
            )
        # A pass-through's answer is renamed only when it is JSON: nothing else has a "model"
        # member (and an encoded body, passed on as it came, is not Sluice's to read).
        rename = self._rename
        if rename is not None and "Content-Encoding" not in headers:
            body = rename(body) if checked or is_json(body) else body
        meter = CURRENT_METER.get()
        if meter is not None and checked:
            meter.whole(body)
        sink.begin(200, content_type, headers, content_length=len(body))
        await sink.send(body)

    async def _relay_error_response(
        self, replica: UpstreamReplica, response: Response, sink: Sink
    ) -> None:
        body = await _read_bounded(response, _MAX_ERROR_BODY)
        status = response.status_code
        if sink.started:
            # The continuation of a paused stream refused: its client has half an answer, and
            # hears why in-band.
            snippet = without_addresses(body[:500].decode("utf-8", "replace"), replica)
            raise upstream_error(
                502,
                "upstream_continuation_refused",
                f"{self.named(replica)} refused to continue the paused answer "
                f"(HTTP {status}): {snippet}",
                retryable=False,
            )
        if 300 <= status < 400:
            # Never followed: a redirect from an inference server is a misconfigured URL (a
            # missing /v1, http for https), and following it would resend the client's body
            # to wherever it points.
            location = response.headers.get("location", "(no Location)")
            replica.warn(
                "redirect", "upstream %s redirects to %s: check its URL", replica.url, location
            )
            # The client sees where it points less its host: an internal name, as often as not.
            location = without_addresses(location, replica)
            raise upstream_error(
                502,
                "upstream_redirect",
                f"{self.named(replica)} answered HTTP {status} to {location}; redirects are not "
                "followed (check the model's upstreams URL)",
                retryable=False,
            )
        if status >= 500 or status < 400:
            # The upstream's own words, which may name where it runs (a gateway's error page).
            snippet = without_addresses(body[:500].decode("utf-8", "replace"), replica)
            raise upstream_error(
                502,
                "upstream_http_error",
                f"{self.named(replica)} answered HTTP {status}: {snippet}",
                retryable=status >= 500,
            )
        if status in (401, 403):
            # The upstream refused Sluice's credentials: the operator's mistake, never the
            # client's (whose key Sluice checked itself), so never relayed as the client's 401.
            replica.warn(
                "auth",
                "upstream %s refused Sluice's credentials (HTTP %d): check the model's api_key_env",
                replica.url,
                status,
            )
            raise upstream_error(
                502,
                "upstream_auth_error",
                f"{self.named(replica)} refused Sluice's credentials (HTTP {status}); the model's "
                "upstream key is wrong or missing",
                retryable=True,
            )
        if status == 404 and says_model_missing(body):
            # A model name that is not the upstream's (see upstream_model): kept as the
            # upstream's 404, said to be the upstream's.
            replica.warn(
                "model", "upstream %s: the model it was asked for does not exist", replica.url
            )
            body = attributed(body, self.named(replica))
        # The upstream's own 4xx (bad parameters, context too long, rate limited) is the
        # client's to see, as the upstream said it.
        headers = {
            name: response.headers[name]
            for name in _PASSED_ERROR_HEADERS
            if name in response.headers
        }
        content_type = response.headers.get("content-type", JSON_CONTENT_TYPE)
        sink.begin(status, content_type, headers, content_length=len(body))
        await sink.send(body)


def reason(error: BaseException, replica: UpstreamReplica | None = None) -> str:
    """What went wrong, in words: httpx's own message, or, where it has none (a TLS handshake
    that failed under httpcore says nothing), that of the error it came from. With
    ``replica``, for a client's eyes: its host and every address taken out (an OS error says
    "connect to 10.0.0.5:8000")."""
    seen: BaseException | None = error
    text = type(error).__name__
    for _ in range(8):
        if seen is None:
            break
        if str(seen):
            text = str(seen)
            break
        seen = seen.__cause__ or seen.__context__
    return text if replica is None else without_addresses(text, replica)


def without_addresses(text: str, replica: UpstreamReplica) -> str:
    """``text`` for a client's eyes: the replica's host, every URL's host and every IP
    address (with its port) taken out."""
    host = replica.origin.host
    if host:
        text = text.replace(f"{host}:{replica.origin.port}", "<address>")
        text = text.replace(host, "<address>")
    text = _URL_AUTHORITY.sub(r"\1<address>", text)
    return _ADDRESS.sub("<address>", text)


# An IPv4 or IPv6 address, with its port if any.
_ADDRESS = re.compile(
    r"\[?(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}\]?(?::\d+)?"
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"
)
# An absolute URL's user, host and port (a redirect's Location to another internal name).
_URL_AUTHORITY = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/\s?#\"'<>]+")


def decode(decoder: http1.ContentDecoder, data: bytes) -> bytes:
    try:
        return decoder.feed(data)
    except http1.ProtocolError as error:
        raise upstream_error(
            502, "upstream_protocol_error", f"the upstream's body: {error}", retryable=False
        ) from None


async def _read_bounded(response: Response, limit: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    async for chunk in response.chunks():
        size += len(chunk)
        if size > limit:
            raise upstream_error(
                502,
                "upstream_response_too_large",
                f"the upstream response exceeds this proxy's limit of {limit} bytes",
                retryable=False,
            )
        parts.append(chunk)
    return b"".join(parts)
