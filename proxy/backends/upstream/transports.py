"""How a replica reaches its server: which transport, which TLS, which proxy.

Two transports keep the same contracts (the relay's lifetime, backpressure, the deadlines):

* ``lean``: :class:`~proxy.backends.upstream.pool.KeepAlivePool`, Sluice's own HTTP/1.1
  client, the cheapest per event, for plain in-cluster HTTP (it speaks TLS too).
* ``httpx``: :class:`~proxy.backends.upstream.httpx_pool.HttpxPool`, over httpx, for what the
  lean one does not do: HTTP proxies (CONNECT for https) and HTTP/2.

``auto`` picks lean for plain ``http://`` without a proxy, httpx for everything else. The
choice, the TLS context and the proxy are made once per replica (:class:`ConnectionSettings`),
and its health checks use the same ones as its requests.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from proxy.config import UpstreamRequestConfig, load_client_certificate
from proxy.protocol.proxies import proxy_for, redact

log = logging.getLogger("sluice.upstream")


@dataclass(frozen=True)
class ConnectionSettings:
    """What a replica's connections are made with. Equal settings to one URL share a replica
    (one pool) whichever models use it."""

    transport: str  # "lean" or "httpx": resolved, never "auto"
    proxy: str | None = None
    ca_file: str = ""
    client_cert: str = ""
    client_key: str = ""
    verify: bool = True
    http2: bool = False

    @classmethod
    def resolve(
        cls, url: str, settings: UpstreamRequestConfig, environ: Mapping[str, str]
    ) -> ConnectionSettings:
        https = url.startswith("https://")
        transport = settings.transport
        if transport == "lean":
            # Asked for by name: direct, whatever the environment's proxy variables say.
            proxy = None
        else:
            proxy = proxy_for(url, settings.proxy, environ)
            if transport == "auto":
                transport = "lean" if not https and proxy is None else "httpx"
        return cls(
            transport=transport,
            proxy=proxy,
            ca_file=settings.ca_file if https else "",
            client_cert=settings.client_cert if https else "",
            client_key=settings.client_key if https else "",
            verify=settings.verify or not https,
            # ALPN offers h2 on TLS only; plain http:// stays HTTP/1.1 (vLLM's server and
            # llama.cpp's speak nothing else).
            http2=settings.http2 and https and transport == "httpx",
        )

    @property
    def label(self) -> str:
        """How logs, metrics and ``state.replicas`` tell two replicas of one URL apart."""
        parts = [self.transport]
        if self.proxy:
            parts.append(f"proxy {redact(self.proxy)}")
        if self.http2:
            parts.append("http2")
        if self.ca_file:
            parts.append(f"ca {self.ca_file}")
        if self.client_cert:
            parts.append(f"cert {self.client_cert}")
        if not self.verify:
            parts.append("UNVERIFIED")
        return ", ".join(parts)

    def ssl_context(self, *, alpn: list[str]) -> ssl.SSLContext:
        """A new TLS context for these settings (each pool has its own: httpcore sets its ALPN
        protocols on the context it is given)."""
        if not self.verify:
            context = httpx.create_ssl_context(verify=False)
        elif self.ca_file:
            context = ssl.create_default_context(cafile=self.ca_file)
        else:
            # certifi's bundle, or SSL_CERT_FILE / SSL_CERT_DIR when set (as httpx reads them).
            context = httpx.create_ssl_context(trust_env=True)
        if self.client_cert:
            load_client_certificate(context, self.client_cert, self.client_key)
        context.set_alpn_protocols(alpn)
        return context


class Response(Protocol):
    """What the relay reads of an upstream response, from either transport."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]:
        """Looked up by lower-case name."""

    def abort(self) -> None:
        """Make the upstream see the client's disconnect now, from any task (a sync callback);
        the response's task unwinds later and closes what is left."""

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (transfer framing removed, no content decoding)."""


class Exchange(Protocol):
    """``async with pool.stream(request) as response``: the response is closed when the block
    ends, however it ends (its connection kept only if the body was read to its end)."""

    async def __aenter__(self) -> Response: ...

    async def __aexit__(self, *exc_info: object) -> None: ...


class Pool(Protocol):
    """One replica's connections, lean or httpx."""

    def stream(self, request: Any) -> Exchange: ...

    def tls_context(self) -> ssl.SSLContext: ...

    def connections(self) -> list[Any]: ...

    async def keep_spare(self, origin: Any, connect_timeout: float | None) -> None:
        """The pool's background work while it is open, in its owner's nursery (the lean
        pool's spare connections; the httpx pool's sweep of idle connections whose server
        closed them)."""

    async def aclose(self) -> None: ...


def health_client(settings: ConnectionSettings, timeout: float) -> httpx.AsyncClient:
    """The client that health-checks a replica: the proxy and the TLS settings its requests
    use, and connections of its own, so that a check never waits behind streams for a slot.
    Its TLS context is its own too: httpcore sets its ALPN protocols on the context it uses."""
    return httpx.AsyncClient(
        # trust_env=False: the proxy was taken from the environment already, once, in
        # ConnectionSettings.resolve; SSL_CERT_FILE is read by ssl_context.
        trust_env=False,
        timeout=timeout,
        verify=settings.ssl_context(alpn=["http/1.1"]),
        proxy=settings.proxy,
    )
