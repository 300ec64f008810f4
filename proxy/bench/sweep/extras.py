"""What some scenarios need beside the fake: the tiny local model, a redis-server.

Both come from the test suite's own fixtures (``tests.model_fixtures``, ``tests.api``), imported
by name (they are no part of the package's types) when a scenario asks for them, so the sweep
runs from a checkout of the repository (``make sweep`` does). Where one cannot be had (no
redis-server on the PATH, no tokenizer), the scenario is skipped, and the report says why.
"""

from __future__ import annotations

import importlib
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# The local model's decode step, slowed so that the relay waits between tokens as it does in
# life (the tiny model decodes in well under a millisecond).
LOCAL_STEP_SECONDS = 0.002
_local: dict[str, Any] = {}
# The key whose limits a redis-server counts (the ``redis`` scenarios), and its leases there.
LIMITED_KEY = "limited"


class Unavailable(Exception):
    """What a scenario needs is not on this machine: the sweep skips it, saying why."""


def tiny_local_models() -> dict[str, Any]:
    """``local_models`` for a rig: the tiny random Llama over the real tokenizer, slowed."""
    if "tiny" not in _local:
        try:
            fixtures = importlib.import_module("tests.model_fixtures")
            support = importlib.import_module("tests.support")
        except ImportError as exc:
            raise Unavailable(f"the test suite's model fixtures: {exc}") from exc
        loaded = fixtures.make_tiny_loaded_model(fixtures.load_smol_tokenizer(None))
        _local["tiny"] = support.slowed(loaded, LOCAL_STEP_SECONDS)
    return {"tiny": _local["tiny"]}


@contextmanager
def redis_server() -> Iterator[Any]:
    """A throwaway redis-server on 127.0.0.1 for one sweep (``.url``, ``.port``)."""
    if shutil.which("redis-server") is None:
        raise Unavailable("no redis-server on the PATH (make test installs it with apt)")
    server = importlib.import_module("tests.api.test_limits_redis").RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def redis_query(port: int, *command: str) -> Any:
    """One command to the sweep's redis-server, answered (RESP: an integer or a bulk string).
    Blocking, and short: the sweep's checks are synchronous, and it is on 127.0.0.1."""
    parts = [f"*{len(command)}\r\n".encode()]
    for word in command:
        parts.append(f"${len(word.encode())}\r\n{word}\r\n".encode())
    with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
        conn.sendall(b"".join(parts))
        data = b""
        while not data.endswith(b"\r\n") or (data[:1] == b"$" and data.count(b"\r\n") < 2):
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
    kind, rest = data[:1], data[1:]
    if kind == b":":
        return int(rest.split(b"\r\n")[0])
    if kind == b"$":
        return rest.split(b"\r\n", 1)[1].rsplit(b"\r\n", 1)[0].decode()
    raise RuntimeError(f"redis answered {data[:80]!r}")


def redis_clients(port: int) -> int:
    """Connections redis-server holds open, less the one asking."""
    info = redis_query(port, "INFO", "clients")
    for line in info.splitlines():
        if line.startswith("connected_clients:"):
            return int(line.split(":")[1]) - 1
    raise RuntimeError("no connected_clients in INFO clients")
