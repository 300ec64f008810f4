"""A real OIDC issuer and a forward-auth service for the identity tests: small HTTP servers on
127.0.0.1 (trio sockets, one request per connection), with keys made by ``cryptography`` and
tokens signed by the test."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import jwt
import trio
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

Handler = Callable[[str, dict[str, str]], Awaitable[tuple[int, dict[str, str], bytes]]]

MAX_HEAD = 16384


class TinyServer:
    """HTTP/1.1 on 127.0.0.1, one request per connection, answered by ``handler``. Each
    request is recorded (path, headers); ``stop`` closes the listener, so that connecting
    is refused."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[tuple[str, dict[str, str]]] = []
        # Connections accepted, answered or not.
        self.connections = 0
        self.port = 0
        self._scope = trio.CancelScope()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self._scope:
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            self.port = listeners[0].socket.getsockname()[1]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.serve_listeners, self._connection, listeners)
                task_status.started()

    def stop(self) -> None:
        self._scope.cancel()

    async def _connection(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        async with stream:
            head = b""
            while b"\r\n\r\n" not in head and len(head) < MAX_HEAD:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    return
                head += chunk
            lines = head.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
            _, path, _ = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            self.requests.append((path, headers))
            status, extra, body = await self.handler(path, headers)
            out = [f"HTTP/1.1 {status} X", f"Content-Length: {len(body)}", "Connection: close"]
            out += [f"{name}: {value}" for name, value in extra.items()]
            await stream.send_all(("\r\n".join(out) + "\r\n\r\n").encode() + body)


class Signer:
    """One signing key of the issuer: RSA (RS256) or EC P-256 (ES256)."""

    def __init__(self, kind: str = "RSA", kid: str | None = None) -> None:
        self.kid = kid or uuid.uuid4().hex[:12]
        if kind == "RSA":
            self.private: Any = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            self.algorithm = "RS256"
            jwk = json.loads(RSAAlgorithm.to_jwk(self.private.public_key()))
        else:
            self.private = ec.generate_private_key(ec.SECP256R1())
            self.algorithm = "ES256"
            jwk = json.loads(ECAlgorithm.to_jwk(self.private.public_key()))
        self.jwk = {**jwk, "kid": self.kid, "use": "sig"}


class Issuer:
    """An OIDC issuer: its discovery document and key set over HTTP (fetches counted), its
    keys changed at will, and tokens signed with them."""

    def __init__(self) -> None:
        self.server = TinyServer(self._answer)
        self.signers: list[Signer] = []
        # Seconds each answer waits first (a slow issuer; math.inf: a hung one, which accepts
        # the connection, reads the request and never answers).
        self.delay = 0.0

    @property
    def issuer(self) -> str:
        return self.server.url

    @property
    def jwks_fetches(self) -> int:
        return sum(1 for path, _ in self.server.requests if path == "/jwks")

    async def _answer(
        self, path: str, headers: dict[str, str]
    ) -> tuple[int, dict[str, str], bytes]:
        if self.delay:
            await trio.sleep(self.delay)
        document: dict[str, Any]
        if path == "/.well-known/openid-configuration":
            document = {"issuer": self.issuer, "jwks_uri": self.issuer + "/jwks"}
        elif path == "/jwks":
            document = {"keys": [signer.jwk for signer in self.signers]}
        else:
            return 404, {}, b"{}"
        return 200, {"Content-Type": "application/json"}, json.dumps(document).encode()

    def token(
        self,
        signer: Signer | None = None,
        *,
        headers: dict[str, Any] | None = None,
        now: float | None = None,
        lifetime: float = 300,
        **claims: Any,
    ) -> str:
        signer = signer or self.signers[0]
        issued = time.time() if now is None else now
        payload = {
            "iss": self.issuer,
            "aud": "sluice",
            "sub": "alice",
            "iat": int(issued),
            "exp": int(issued + lifetime),
            **claims,
        }
        payload = {name: value for name, value in payload.items() if value is not None}
        return jwt.encode(
            payload,
            signer.private,
            algorithm=signer.algorithm,
            headers={"kid": signer.kid, **(headers or {})},
        )


async def start_issuer(nursery: trio.Nursery, *kinds: str) -> Issuer:
    issuer = Issuer()
    issuer.signers = [Signer(kind) for kind in kinds or ("RSA",)]
    await nursery.start(issuer.server.serve)
    return issuer


async def start_service(nursery: trio.Nursery, handler: Handler) -> TinyServer:
    server = TinyServer(handler)
    await nursery.start(server.serve)
    return server
