"""One Sluice in this process, on 127.0.0.1 port 0, in front of the fake upstream (in this
process too): what a scenario's runs go through, and what it looked like when idle.

In-process, so that a trio instrument sees Sluice's tasks and the sweep can read its state
(the relay tracker, the rooms, the pools, the keys' counters) directly. The server is
``proxy.server.run.serve`` with the app of ``proxy.api.app.create_app``, exactly as ``sluice
serve`` runs them; the fake is ``proxy.testing.fake_upstream.FakeUpstream``.
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

import proxy.server.run
from proxy.api.app import create_app
from proxy.api.state import SluiceState, state_of
from proxy.backends.local import LocalBackend
from proxy.backends.upstream.backend import UpstreamBackend
from proxy.bench.sweep.checkpoints import CheckpointCounter
from proxy.bench.sweep.extras import LIMITED_KEY, RedisChecks
from proxy.bench.sweep.observe import (
    AccessLines,
    all_tasks,
    busy_threads,
    names,
    open_fds,
    task_tree,
    tasks_running,
)
from proxy.config import config_from_mapping
from proxy.server.asgi import SluiceQuart
from proxy.testing.fake_upstream import FakeSettings, FakeUpstream

# How long the state may take to come back after a run before the run is a failure.
SETTLE_SECONDS = 2.0
POLL = 0.002


@dataclass
class Baseline:
    """The idle process: its tasks (outside the fake and the redis checks' client) and busy
    threads by name, its descriptors that are not sockets, and its sockets less the pooled
    upstream connections' two ends (the redis checks' own connection, open from before the
    baseline to the end, among them)."""

    tasks: Counter[str] = field(default_factory=Counter)
    threads: Counter[str] = field(default_factory=Counter)
    files: Counter[str] = field(default_factory=Counter)
    sockets: int = 0
    # The sweep's redis-server's connections (the ``redis`` scenarios'), less the checks' own.
    redis_clients: int = 0


@dataclass
class Rig:
    fake: FakeUpstream
    fake_url: str
    app: SluiceQuart
    url: str
    serving: trio.lowlevel.Task
    counter: CheckpointCounter
    lines: AccessLines
    baseline: Baseline = field(default_factory=Baseline)
    # Where the tasks of the fake (and the sweep's own) live: never counted as Sluice's.
    outside: Callable[[], set[trio.lowlevel.Task]] = field(default=lambda: set())
    # The client that reads the redis-server counting the keys' limits, if one does (running in
    # the sweep's nursery from before the baseline).
    redis: RedisChecks | None = None
    # The local models it serves (a slowed model counts its forward passes).
    local_models: dict[str, Any] = field(default_factory=dict)

    @property
    def state(self) -> SluiceState:
        return state_of(self.app)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)

    # -- what the sweep compares ------------------------------------------------------------

    def pooled(self) -> int:
        """Upstream connections the pools keep, idle or not."""
        return sum(len(replica.pool_connections()) for replica in self.state.replicas.values())

    def local_busy(self) -> bool:
        return any(local.engine.sequences for local in self.state.local_backends.values())

    def busy_connections(self) -> set[int]:
        return {
            id(connection)
            for replica in self.state.replicas.values()
            for connection in replica.pool_connections()
            if not connection.is_idle()
        }

    def release_check(
        self, request_id: str | None, *, others: bool = False, relays: bool = False
    ) -> tuple[Callable[[], bool], Callable[[], int | None]]:
        """For the request ``request_id`` that starts now: whether nothing of it is at work
        below Sluice any more: every request the fake got for it since is over (the fake saw it
        close, or it was done), no upstream connection that was idle before is in use, no local
        sequence is in a batch. Asked by the counter after every step that follows a cut.
        (``request_id`` None: every request the fake gets from now on is this one's, as for a
        WebSocket's message, which Sluice gives an id of its own.) (Another request's work, a
        queued scenario's holder, is not this one's; with
        ``others``, other requests start beside it, and the connections, which cannot be told
        apart, are not looked at.) With ``relays``, not before every relay has ended: a departure
        that Sluice hears late lets the request reach the upstream after the cut. And the local
        engine's decode steps once it was released
        (None while it is not, or with no local model)."""
        records = len(self.fake.recorder.records)
        before = self.busy_connections()
        released_at_step: list[int] = []

        def released() -> bool:
            if any(
                r.outcome == "pending"
                and (request_id is None or r.headers.get("x-request-id") == request_id)
                for r in self.fake.recorder.records[records:]
            ):
                return False
            if not others and self.busy_connections() - before:
                return False
            if self.local_busy():
                return False
            if relays and self.state.tracker.active:
                return False
            if not released_at_step:
                released_at_step.append(self.engine_steps())
            return True

        def steps_at_release() -> int | None:
            return released_at_step[0] if released_at_step and self.local_models else None

        return released, steps_at_release

    def engine_steps(self) -> int:
        """Forward passes the (slowed) local models have run so far."""
        return sum(getattr(loaded.model, "steps", 0) for loaded in self.local_models.values())

    def process_tasks(self) -> set[trio.lowlevel.Task]:
        tasks = all_tasks() - self.outside()
        if self.redis is not None and self.redis.task is not None:
            # The checks' own client (its connection's tasks, the bound on their waits): the
            # sweep's, not Sluice's. Left out rather than left in the baseline, so that a
            # connection it opens again is no change either.
            tasks -= task_tree(self.redis.task)
        return tasks

    def sockets_and_files(self) -> tuple[int, Counter[str]]:
        fds = open_fds()
        sockets = sum(count for target, count in fds.items() if target.startswith("socket:"))
        files = Counter({t: c for t, c in fds.items() if not t.startswith("socket:")})
        return sockets, files

    async def quiet(self) -> None:
        """Once the warm-up's relays and client connections are gone, and the loop has had a
        moment with nothing to do: the idle state to compare every run with."""
        await self.state.tracker.wait_idle()
        with trio.move_on_after(SETTLE_SECONDS):
            await poll(lambda: not any(t.name.endswith("_run_handler") for t in self.tasks()))
        await trio.sleep(0.05)

    async def take_baseline(self) -> None:
        # Redis is asked first, so that the counts of this process are taken together, with
        # no await between them.
        redis_clients = 0 if self.redis is None else await self.redis.connected_clients()
        gc.collect()
        sockets, files = self.sockets_and_files()
        self.baseline = Baseline(
            tasks=names(self.process_tasks()),
            threads=busy_threads(),
            files=files,
            sockets=sockets - 2 * self.pooled(),
            redis_clients=redis_clients,
        )

    async def differences(self) -> list[str]:
        """What is not back to the idle baseline (empty: everything is)."""
        found: list[str] = []
        state = self.state
        tracker = state.tracker
        if tracker.active:
            found.append(f"{len(tracker.active)} relay(s) still active")
        tasks = self.process_tasks()
        extra = names(tasks) - self.baseline.tasks
        if extra:
            found.append("tasks left: " + "; ".join(self._describe(tasks, extra)))
        missing = self.baseline.tasks - names(tasks)
        if missing:
            found.append(f"tasks gone that were there when idle: {dict(missing)}")
        threads = busy_threads() - self.baseline.threads
        if threads:
            found.append(f"threads left: {dict(threads)}")
        sockets, files = self.sockets_and_files()
        if files != self.baseline.files:
            found.append(f"descriptors changed: {dict(files - self.baseline.files)}")
        expected = self.baseline.sockets + 2 * self.pooled()
        if sockets != expected:
            found.append(f"{sockets} sockets open, {expected} expected (pool and listeners)")
        if self.fake.recorder.open_connections != self.pooled():
            found.append(
                f"the fake holds {self.fake.recorder.open_connections} connection(s) open, "
                f"the pools {self.pooled()}"
            )
        for name, replica in state.replicas.items():
            if replica.room.in_flight:
                found.append(f"replica {name}: {replica.room.in_flight} slot(s) held")
            if any(not c.is_idle() for c in replica.pool_connections()):
                found.append(f"replica {name}: a pooled connection is not idle")
        for name, backend in state.backends.items():
            if isinstance(backend, UpstreamBackend | LocalBackend) and backend.admission.waiting:
                found.append(f"model {name}: {backend.admission.waiting} waiting")
        for name, local in state.local_backends.items():
            if local.active_generations or local.engine.sequences:
                found.append(f"local {name}: {local.engine.sequences} sequence(s) in the batch")
            if local.engine.paused_kv_bytes:
                found.append(f"local {name}: {local.engine.paused_kv_bytes} bytes of paused KV")
        found.extend(key_holds(state))
        if self.redis is not None:
            found.extend(await self._redis_differences(self.redis))
        return found

    async def _redis_differences(self, checks: RedisChecks) -> list[str]:
        """The redis-server's side: the connections Sluice holds there, and the limited key's
        stream leases and token reservations (sorted sets of their ids), none left."""
        found = []
        clients = await checks.connected_clients()
        if clients != self.baseline.redis_clients:
            found.append(f"redis holds {clients} connection(s), {self.baseline.redis_clients} idle")
        prefix = self.state.config.limits.key_prefix
        for kind in ("streams", "pending"):
            held = await checks.zcard(f"{prefix}{{{LIMITED_KEY}}}:{kind}")
            if held:
                found.append(f"redis: {held} {kind} entr(ies) of key {LIMITED_KEY} left")
        return found

    def _describe(self, tasks: set[trio.lowlevel.Task], extra: Counter[str]) -> list[str]:
        from proxy.bench.sweep.checkpoints import cut_point

        described = []
        for task in tasks:
            if extra[task.name] > 0:
                extra[task.name] -= 1
                site = self.counter.site_of(task) or "(spawned before the sweep)"
                described.append(f"{task.name} spawned at {site}, parked at {cut_point(task)}")
        return described

    def tasks(self) -> set[trio.lowlevel.Task]:
        """Sluice's tasks: the serving task's tree."""
        return task_tree(self.serving)

    async def settled(self) -> list[str]:
        """Wait until nothing differs from the baseline; what still differs after
        SETTLE_SECONDS (a full collection first, for a body that only a cycle keeps)."""
        # Timed by the wall clock, not trio's: a deadline sweep may jump trio's clock while
        # this waits (the request's last steps, closing its connection, come after its answer).
        until = time.monotonic() + SETTLE_SECONDS
        while time.monotonic() < until:
            if not await self.differences():
                return []
            await trio.sleep(POLL)
        gc.collect()
        return await self.differences()


async def poll(predicate: Callable[[], object]) -> None:
    """Until ``predicate`` holds, for state that has no event to wait on (a pool's, a fake's
    counts, the task tree). No deadline of its own: callers run under one."""
    while True:
        if predicate():
            return
        await trio.sleep(POLL)


def key_holds(state: SluiceState) -> list[str]:
    """Keys that still hold a concurrent stream."""
    states = getattr(state.keys, "_states", {})
    return [f"key {name}: {s.streams} stream(s) held" for name, s in states.items() if s.streams]


async def start_rig(
    nursery: trio.Nursery,
    config: dict[str, Any],
    *,
    fake: FakeSettings,
    local_models: dict[str, Any] | None = None,
) -> Rig:
    """The fake, then Sluice serving ``config`` (a config mapping: every model's upstreams
    saying ``"fake:"`` go to the fake), both on 127.0.0.1 port 0."""
    upstream = FakeUpstream(fake)
    port = await nursery.start(upstream.serve, "127.0.0.1", 0)
    fake_url = f"http://127.0.0.1:{port}"
    # A second replica, the same fake by another name.
    named = {"fake:": fake_url, "fake-localhost:": f"http://localhost:{port}"}
    data = dict(config)
    data["models"] = {
        name: {
            **table,
            **(
                {"upstreams": [named.get(u, u) for u in table["upstreams"]]}
                if "upstreams" in table
                else {}
            ),
        }
        for name, table in config["models"].items()
    }
    data["server"] = {**data.get("server", {}), "port": 0}
    data["upstream"] = {"preconnect": 0, **data.get("upstream", {})}
    loaded = config_from_mapping(data, "sweep", env={})
    app = create_app(loaded, env={}, local_models=local_models)
    binds = await nursery.start(proxy.server.run.serve, app, loaded)
    (serving,) = tasks_running(proxy.server.run.serve.__code__)
    (fake_task,) = tasks_running(FakeUpstream.serve.__code__)
    lines = AccessLines()
    driver = trio.lowlevel.current_task()
    rig = Rig(
        upstream,
        fake_url,
        app,
        binds[0],
        serving,
        CheckpointCounter(serving),
        lines,
        outside=lambda: task_tree(fake_task) | {driver},
        local_models=dict(local_models or {}),
    )
    return rig
