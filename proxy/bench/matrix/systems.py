"""The system under test: starting it in front of the fake (Sluice as ``sluice serve``, or a
peer from ``proxy.bench.peers``) or finding a ``--target``, the configs written for it, the
versions its report names, and the context every trial works with."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import platform
import re
import socket
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import trio

from proxy.bench.children import PEER_READY_TIMEOUT, supervise, wait_ready
from proxy.bench.matrix.cells import LOCAL_SLOTS, TRIGGER_TIMEOUT, MatrixSettings
from proxy.bench.matrix.client import Client, local_body, request_body
from proxy.bench.peers import start_peer
from proxy.bench.report import write_text
from proxy.bench.settings import BenchError
from proxy.relay.state import Phase
from proxy.testing.fake_upstream import FakeUpstream


@dataclass
class Context:
    """What every trial works with: the run's settings, the fake, and the system under test
    (its address, what it serves, and, for a system this bench started, its process and log)."""

    settings: MatrixSettings
    fake: FakeUpstream
    address: tuple[str, int]
    ws_served: bool
    pid: int | None = None
    served: dict[str, bool] = field(default_factory=dict)
    # Sluice's log (its access lines), how far the matrix has read it, and the outcome of
    # each line read that names a trace, by trace id.
    log: Path | None = None
    log_offset: int = 0
    trace_outcomes: dict[str, str] = field(default_factory=dict)
    fd_baseline: int | None = None
    # Why each endpoint (or "ws") the system does not serve is not served.
    not_served: dict[str, str] = field(default_factory=dict)
    # What every request to the system carries besides the key (a gateway's routing).
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def local(self) -> bool:
        return bool(self.settings.local)

    def body(
        self, endpoint: str, phase: Phase | Literal["probe"], *, stream: bool
    ) -> dict[str, Any]:
        model = self.settings.model
        if self.local:
            return local_body(phase, model, stream=stream)
        return request_body(endpoint, model, stream=stream)

    def client(self, endpoint: str, transport: str, phase: Phase) -> Client:
        return Client(
            self.address,
            endpoint,
            self.settings.model,
            transport,
            api_key=self.settings.api_key,
            body=self.body(endpoint, phase, stream=transport != "json"),
            headers=self.headers,
        )


@dataclass
class StartedSystem:
    """The system under test, answering: its name in the report, its address, and (for a
    system this bench started) its process and its log."""

    name: str
    address: tuple[str, int]
    pid: int | None = None
    log: Path | None = None
    headers: tuple[tuple[str, str], ...] = ()


async def start_system(
    nursery: trio.Nursery,
    settings: MatrixSettings,
    fake_url: str,
    workdir: Path,
    out: Any,
    sluice_env: dict[str, str] | None = None,
) -> StartedSystem:
    """The system ``settings`` name, started in ``nursery`` (which owns its process) and ready;
    a ``--target`` is only told where the fake is. ``sluice_env``: added to the environment of
    the Sluice it starts (its tracing's)."""
    if settings.peer:
        peer = await start_peer(
            nursery,
            settings.peer,
            fake_url,
            workdir,
            api_key=settings.api_key,
            model=settings.model,
        )
        name = settings.system or peer.spec.title
        # Every request carries the run's key already (a peer's own, LiteLLM's master key, is
        # that key).
        headers = tuple((k, v) for k, v in peer.request_headers if k.lower() != "authorization")
        return StartedSystem(name, peer.address, peer.pid, peer.log, headers)
    if settings.target:
        parts = urlsplit(settings.target)
        if parts.hostname is None:
            raise BenchError(f"--target {settings.target!r}: no host")
        print(
            f"fake upstream on {fake_url} (OpenAI base URL {fake_url}/v1): the target "
            f"must send model {settings.model!r} there",
            file=out,
        )
        return StartedSystem(settings.system or settings.target, (parts.hostname, parts.port or 80))
    address = ("127.0.0.1", free_port())
    config = workdir / "sluice.toml"
    write_text(config, sluice_config(address[1], fake_url, settings))
    log = workdir / "sluice.log"
    argv = [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config)]
    process = await nursery.start(partial(supervise, env=sluice_env), "proxy", argv, log)
    # /readyz: a local model loads after the port answers.
    await wait_ready("proxy", address, "/readyz", log, PEER_READY_TIMEOUT)
    name = settings.system or (
        "sluice (local model)" if settings.local else f"sluice ({settings.transport})"
    )
    return StartedSystem(name, address, process.pid, log)


async def serves_websocket(address: tuple[str, int], api_key: str) -> bool:
    try:
        from trio_websocket import HandshakeError, open_websocket
    except ImportError:
        return False
    with trio.move_on_after(TRIGGER_TIMEOUT):
        try:
            async with open_websocket(
                address[0],
                address[1],
                "/v1/ws",
                use_ssl=False,
                extra_headers=[(b"authorization", f"Bearer {api_key}".encode())],
            ):
                return True
        except (HandshakeError, OSError, trio.BrokenResourceError):
            return False
    return False


def sluice_config(port: int, fake_url: str, settings: MatrixSettings) -> str:
    return (
        "# Written by proxy.bench.matrix for one run.\n"
        "[server]\n"
        'host = "127.0.0.1"\n'
        f"port = {port}\n"
        "graceful_timeout = 1.0\n\n"
        "[upstream]\n"
        # One upstream connection: a second request queues for admission (the queued phase).
        "max_connections = 1\n"
        "preconnect = 0\n"
        f"transport = {json.dumps(settings.transport)}\n"
        'proxy = "none"\n\n'
        f"[models.{json.dumps(settings.model)}]\n"
        + (
            # Every slot held makes the next request queue (the queued phase).
            'backend = "local"\n'
            f"path = {json.dumps(settings.local)}\n"
            f"slots = {LOCAL_SLOTS}\n"
            "max_queue = 4\n"
            if settings.local
            else f"upstreams = [{json.dumps(fake_url)}]\n"
        )
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def stack_versions(*, sluice: bool = True) -> dict[str, str]:
    """Python's, Sluice's, and those of Sluice's own dependencies (not its extras); with
    ``sluice`` false (another system), only what the bench itself runs on."""
    found = {"python": platform.python_version()}
    if not sluice:
        found["bench (sluice)"] = _version_or_none("sluice")
        found["httpx (client)"] = _version_or_none("httpx")
        found["trio-websocket (client)"] = _version_or_none("trio-websocket")
        return found
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        found["sluice"] = importlib.metadata.version("sluice")
        for requirement in importlib.metadata.requires("sluice") or []:
            if ";" in requirement:
                continue
            name = re.split(r"[<>=!~ \[]", requirement, maxsplit=1)[0]
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                found[name] = importlib.metadata.version(name)
    found["trio-websocket (client)"] = _version_or_none("trio-websocket")
    return found


def _version_or_none(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
