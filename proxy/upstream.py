"""The upstream backend: relay an OpenAI-compatible server (vLLM, llama.cpp, ...) through httpx.

One :class:`UpstreamReplica` per base URL owns one httpx pool. Each request runs inside the
relay's nursery, so its ``async with client.stream(...)`` is inside the request's cancel scope:
when the client leaves, the stream is closed (the connection is dropped, never pooled half-read)
and the upstream server sees the disconnect and aborts the generation.

Deadlines are trio cancel scopes, each with its own error: connect (httpx's connect timeout),
first token, idle between chunks, and total. Retries go to another replica and happen only
before anything has been sent to the client.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Any, cast

import httpx
import trio

from .config import ModelConfig, RelayConfig, UpstreamConfig
from .errors import UPSTREAM_ERROR, ApiError
from .openai import CompletionRequest, Endpoint
from .relay import JSON_CONTENT_TYPE, SSE_CONTENT_TYPE, RelaySink
from .routing import LeastBusyRouter, ReplicaLoad
from .sse import SSEProtocolError, SSESplitter, check_event, is_done

log = logging.getLogger("sluice.upstream")

# Upstream error bodies are passed through to the client, so they are read, but bounded.
_MAX_ERROR_BODY = 64 * 1024
# Response headers of an upstream 4xx worth passing on to the client.
_PASSED_ERROR_HEADERS = ("retry-after",)


def upstream_error(status: int, code: str, message: str, *, retryable: bool) -> ApiError:
    return ApiError(status, message, type=UPSTREAM_ERROR, code=code, retryable=retryable)


class UpstreamReplica:
    """One upstream server: its httpx pool, and a semaphore that keeps requests out of it.

    httpcore #1093: a request cancelled while waiting for a pool slot leaks a connection in
    CONNECTING state; enough of them and every request gets PoolTimeout. Waiting on our own
    semaphore (never larger than the pool) first means nothing ever waits inside httpcore.
    """

    def __init__(self, url: str, settings: UpstreamConfig, *, socket_options: Any = None) -> None:
        self.url = url.rstrip("/")
        self.load = ReplicaLoad(self.url)
        limits = httpx.Limits(
            max_connections=settings.max_connections,
            max_keepalive_connections=settings.max_keepalive_connections,
            keepalive_expiry=settings.keepalive_expiry,
        )
        transport = httpx.AsyncHTTPTransport(
            limits=limits, retries=0, socket_options=socket_options
        )
        # trust_env=False: an HTTP(S)_PROXY in the environment must not reroute model traffic.
        self._transport = transport
        self.client = httpx.AsyncClient(transport=transport, trust_env=False)
        self.slots = trio.Semaphore(settings.max_connections)

    def endpoint_url(self, endpoint: Endpoint) -> str:
        # Accept base URLs written either way: "http://host:8000" or "http://host:8000/v1".
        if self.url.endswith("/v1"):
            return self.url[:-3] + endpoint.value
        return self.url + endpoint.value

    def pool_connections(self) -> list[Any]:
        """httpcore's connection objects in this pool (for tests and diagnostics)."""
        # httpx exposes no public accessor for its pool; httpcore's is the one that matters.
        pool = getattr(self._transport, "_pool", None)
        return list(getattr(pool, "connections", []))

    async def aclose(self) -> None:
        await self.client.aclose()


class UpstreamBackend:
    """Serves one model from one or more replicas."""

    def __init__(
        self,
        model: ModelConfig,
        replicas: Sequence[UpstreamReplica],
        relay: RelayConfig,
        *,
        api_key: str | None = None,
    ) -> None:
        if not replicas:
            raise ValueError(f"model {model.name!r} has no replicas")
        self.model = model
        self.replicas = list(replicas)
        self._by_load = {replica.load: replica for replica in self.replicas}
        self._loads = [replica.load for replica in self.replicas]
        self._router = LeastBusyRouter()
        self._relay = relay
        self._api_key = api_key
        self._timeout = httpx.Timeout(
            connect=model.connect_timeout, read=None, write=model.connect_timeout, pool=None
        )

    def _headers(self, request: CompletionRequest, request_id: str) -> dict[str, str]:
        # Built from scratch: nothing of the client's headers (its Authorization above all)
        # reaches the upstream.
        headers = {
            "content-type": "application/json",
            "accept": "text/event-stream" if request.stream else "application/json",
            "accept-encoding": "identity",
            "x-request-id": request_id,
        }
        if self._api_key:
            headers["authorization"] = f"Bearer {self._api_key}"
        return headers

    async def produce(self, request: CompletionRequest, request_id: str, sink: RelaySink) -> None:
        with trio.move_on_after(self.model.total_timeout):
            await self._attempts(request, request_id, sink)
            return
        raise upstream_error(
            504,
            "upstream_total_timeout",
            f"the upstream did not finish within total_timeout={self.model.total_timeout:g}s",
            retryable=False,
        )

    async def _attempts(self, request: CompletionRequest, request_id: str, sink: RelaySink) -> None:
        tried: list[ReplicaLoad] = []
        last_error: ApiError | None = None
        for _ in range(self.model.max_attempts):
            load = self._router.choose(self._loads, tried)
            if load is None:
                break
            tried.append(load)
            replica = self._by_load[load]
            load.in_flight += 1
            try:
                sink.set_phase("queued")
                async with replica.slots:
                    sink.set_phase("awaiting_headers")
                    await self._exchange(replica, request, request_id, sink)
                return
            except ApiError as error:
                if sink.started or not error.retryable:
                    raise
                last_error = error
                log.warning(
                    "request %s: %s failed before the first byte (%s); %s",
                    request_id,
                    replica.url,
                    error.code,
                    "retrying on another replica" if len(tried) < len(self._loads) else "giving up",
                )
            finally:
                load.in_flight -= 1
        assert last_error is not None
        raise last_error

    async def _exchange(
        self,
        replica: UpstreamReplica,
        request: CompletionRequest,
        request_id: str,
        sink: RelaySink,
    ) -> None:
        url = replica.endpoint_url(request.endpoint)
        model = self.model
        first_token_deadline = (
            trio.current_time() + model.first_token_timeout if request.stream else math.inf
        )
        try:
            with trio.CancelScope(deadline=first_token_deadline) as read_scope:
                async with replica.client.stream(
                    "POST",
                    url,
                    content=request.raw,
                    headers=self._headers(request, request_id),
                    timeout=self._timeout,
                ) as response:
                    sink.set_phase("awaiting_first_token")
                    if response.status_code != 200:
                        await self._relay_error_response(replica, response, sink)
                    elif request.stream:
                        await self._relay_stream(replica, response, read_scope, sink)
                    else:
                        await self._relay_whole(response, sink)
        except httpx.ConnectTimeout:
            raise upstream_error(
                504,
                "upstream_connect_timeout",
                f"could not connect to {replica.url} within {model.connect_timeout:g}s",
                retryable=True,
            ) from None
        except httpx.ConnectError as error:
            raise upstream_error(
                502,
                "upstream_connect_error",
                f"could not connect to {replica.url}: {error}",
                retryable=True,
            ) from None
        except (httpx.TransportError, httpx.StreamError) as error:
            raise upstream_error(
                502,
                "upstream_protocol_error",
                f"the connection to {replica.url} failed: {type(error).__name__}: {error}",
                retryable=not sink.started,
            ) from None
        except SSEProtocolError as error:
            raise upstream_error(
                502, "upstream_malformed", f"{replica.url}: {error}", retryable=not sink.started
            ) from None
        if read_scope.cancelled_caught:
            if sink.started:
                raise upstream_error(
                    504,
                    "upstream_idle_timeout",
                    f"{replica.url} sent nothing for idle_timeout={model.idle_timeout:g}s "
                    "in the middle of the stream",
                    retryable=False,
                )
            raise upstream_error(
                504,
                "upstream_first_token_timeout",
                f"{replica.url} sent no token within first_token_timeout="
                f"{model.first_token_timeout:g}s",
                retryable=True,
            )

    async def _relay_stream(
        self,
        replica: UpstreamReplica,
        response: httpx.Response,
        read_scope: trio.CancelScope,
        sink: RelaySink,
    ) -> None:
        content_type = response.headers.get("content-type", "")
        if not content_type.startswith("text/event-stream"):
            raise SSEProtocolError(
                f"answered a streaming request with content-type {content_type!r}"
            )
        idle_timeout = self.model.idle_timeout
        splitter = SSESplitter(self._relay.max_event_bytes)
        saw_done = False
        # aclosing: an error mid-stream must close the generator now, not at garbage collection.
        async with aclosing(_raw_chunks(response)) as chunks:
            async for chunk in chunks:
                events = splitter.feed(chunk)
                if not events:
                    continue
                if not sink.started:
                    check_event(events[0])
                    sink.begin(200, SSE_CONTENT_TYPE)
                # While we wait on the client, the upstream is not the one being idle.
                read_scope.deadline = math.inf
                for event in events:
                    check_event(event)
                    if is_done(event):
                        saw_done = True
                    await sink.send(event)
                read_scope.deadline = trio.current_time() + idle_timeout
        if not saw_done:
            raise upstream_error(
                502,
                "upstream_protocol_error",
                f"{replica.url} ended the stream before 'data: [DONE]'",
                retryable=not sink.started,
            )

    async def _relay_whole(self, response: httpx.Response, sink: RelaySink) -> None:
        body = await _read_bounded(response, self._relay.max_response_bytes)
        content_type = response.headers.get("content-type", JSON_CONTENT_TYPE)
        sink.begin(200, content_type, content_length=len(body))
        await sink.send(body)

    async def _relay_error_response(
        self, replica: UpstreamReplica, response: httpx.Response, sink: RelaySink
    ) -> None:
        body = await _read_bounded(response, _MAX_ERROR_BODY)
        status = response.status_code
        if status >= 500 or status < 400:
            snippet = body[:500].decode("utf-8", "replace")
            raise upstream_error(
                502,
                "upstream_http_error",
                f"{replica.url} answered HTTP {status}: {snippet}",
                retryable=status >= 500,
            )
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


def _raw_chunks(response: httpx.Response) -> AsyncGenerator[bytes, None]:
    # httpx types aiter_raw as an AsyncIterator; it is an async generator, and aclosing it is
    # what ends the stream promptly when we stop early.
    return cast(AsyncGenerator[bytes, None], response.aiter_raw())


async def _read_bounded(response: httpx.Response, limit: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    async with aclosing(_raw_chunks(response)) as chunks:
        async for chunk in chunks:
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
