"""What some scenarios need beside the fake: the tiny local model, a redis-server, and the
client that reads what Sluice left in that redis-server (:class:`RedisChecks`).

The model and the server come from the test suite's own fixtures (``tests.model_fixtures``,
``tests.api``), imported by name (they are no part of the package's types) when a scenario asks
for them, so the sweep runs from a checkout of the repository (``make sweep`` does). Where one
cannot be had (no redis-server on the PATH, no tokenizer), the scenario is skipped, and the
report says why.
"""

from __future__ import annotations

import importlib
import shutil
import time
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import trio

if TYPE_CHECKING:
    import coredis

T = TypeVar("T")

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


# How long, by the wall clock, a check waits for redis-server's answer. Not by trio's clock: a
# deadline sweep jumps that ahead (past the request's deadline, at its cut) while a check may
# be waiting, and a bound on it would end a check that is being answered. For the same reason
# the client's own timeouts (connecting, reading, the pool's wait, the idle close), all on
# trio's clock, are none.
ANSWER_SECONDS = 2.0
# How often, while a check waits, its wall-clock bound is looked at.
WATCH_EVERY = 0.01


class RedisChecks:
    """The sweep's own client of its redis-server, for the checks that read what Sluice left
    there: one connection (a pool of one), opened by :meth:`run` before the sweep takes its
    idle baseline and held until the nursery that runs it is cancelled, so that it is in every
    count alike (redis-server's clients, this process's sockets). Its tasks are the tree of
    :attr:`task`, which the rig does not count as Sluice's. One check at a time (the rig's,
    in turn)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.task: trio.lowlevel.Task | None = None
        self._client: coredis.Redis[str] | None = None
        # The check waiting for its answer: its scope, and the wall-clock time it ends at.
        self._asking: tuple[trio.CancelScope, float] | None = None
        self._asked = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect, then hold the connection (and bound the checks' waits) until cancelled."""
        # Imported here, as proxy.api.limits does: only a sweep with a redis-server pays for it.
        import coredis

        client = coredis.Redis.from_url(
            self.url,
            decode_responses=True,
            max_connections=1,
            connect_timeout=None,
            stream_timeout=None,
            pool_timeout=None,
            max_idle_time=None,
        )
        async with client, trio.open_nursery() as nursery:
            self.task = trio.lowlevel.current_task()
            self._client = client
            try:
                nursery.start_soon(self._bound_answers)
                # Connected now, so that the baseline counts its socket.
                await self._answered(client.ping())
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._client = None

    async def connected_clients(self) -> int:
        """Connections redis-server holds open, less this client's own one."""
        info = await self._answered(self._connected().info("clients"))
        clients = info.get("connected_clients")
        if not isinstance(clients, int):
            raise TypeError(f"INFO clients gave connected_clients {clients!r}")
        return clients - 1

    async def zcard(self, key: str) -> int:
        """The members of the sorted set ``key`` (0: none, or no such key)."""
        return await self._answered(self._connected().zcard(key))

    def _connected(self) -> coredis.Redis[str]:
        if self._client is None:
            raise RuntimeError("the redis checks' client is not running")
        return self._client

    async def _answered(self, command: Awaitable[T]) -> T:
        """``command``'s answer, or a RuntimeError once it has waited ANSWER_SECONDS."""
        with trio.CancelScope() as scope:
            self._asking = scope, time.monotonic() + ANSWER_SECONDS
            self._asked.set()
            try:
                return await command
            finally:
                self._asking = None
        raise RuntimeError(f"redis-server did not answer within {ANSWER_SECONDS} s")

    async def _bound_answers(self) -> None:
        """Cancel a check that has waited ANSWER_SECONDS by the wall clock. Asleep between
        checks; while one waits, it looks every WATCH_EVERY of trio's clock, which a jump only
        makes sooner."""
        while True:
            await self._asked.wait()
            self._asked = trio.Event()
            while (asking := self._asking) is not None:
                scope, until = asking
                if time.monotonic() >= until:
                    scope.cancel()
                    break
                await trio.sleep(WATCH_EVERY)
