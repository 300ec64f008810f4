"""One config as it is served: its client keys and their limits' counters, its upstream
replicas and backends, its catalog of upstream models, and the request pipeline over them.

Built at start-up and again at each reload (api/reload.py): a request keeps the served config it
began on (its pipeline), so a reload never changes the settings of a request in flight, and an
old one's pools close only once its last relay has. The local models are not a served config's:
they are loaded once per process, and every served config serves the same ones.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING

import trio

from proxy.api.auth import KeyRing
from proxy.api.guard_builtins import GuardServices
from proxy.api.guards import ServedGuards, check_guards
from proxy.api.pipeline import RequestPipeline
from proxy.backends.base import Backend
from proxy.backends.upstream.backend import UpstreamBackend
from proxy.backends.upstream.catalog import ModelCatalog
from proxy.backends.upstream.replica import UpstreamReplica, start_slots
from proxy.backends.upstream.routing import HealthPolicy
from proxy.backends.upstream.scrape import check_replicas, report_reachability
from proxy.backends.upstream.transports import ConnectionSettings
from proxy.config import FAKE_UPSTREAM_URL, Config, ConfigError, placeholder_keys
from proxy.ops.metrics import Metrics
from proxy.protocol.scheduling import SchedulingSettings
from proxy.relay.admission import Scheduling
from proxy.relay.body import RelayTracker
from proxy.relay.guarded import AfterHooks

if TYPE_CHECKING:
    from proxy.api.identity import Identity

log = logging.getLogger("sluice.app")

# A retiring served config looks again this often for relays that ended without closing (a
# response dropped before its body was entered leaves nothing to notify).
_RETIRE_POLL_SECONDS = 1.0
# Closing a retired served config's pools never holds up the process longer than this.
_CLOSE_SECONDS = 5.0


def resolve_api_keys(config: Config, env: Mapping[str, str]) -> dict[str, str]:
    """Each model's upstream key, read from the environment variable its config names."""
    keys: dict[str, str] = {}
    for model in config.models:
        if model.backend == "local" or not model.api_key_env:
            continue
        value = env.get(model.api_key_env)
        if not value:
            raise ConfigError(
                f"[models.{model.name}] api_key_env names {model.api_key_env}, which is not "
                f"set: export {model.api_key_env}=<the upstream's key> (vLLM's --api-key), or "
                "remove api_key_env if the upstream runs without one"
            )
        keys[model.name] = value
    return keys


def check_no_fake_upstream(config: Config) -> None:
    """A ConfigError when a model's upstream is the fake (``fake:``) but no fake upstream was
    started for the app to reach."""
    for model in config.models:
        if model.backend == "upstream" and FAKE_UPSTREAM_URL in model.upstreams:
            raise ConfigError(
                f"[models.{model.name}] uses '{FAKE_UPSTREAM_URL}', but no fake upstream was "
                "started beside the app: `sluice serve` starts it when [fake_upstream] is "
                "enabled; in code, pass create_app(config, fake_upstream_url=...)"
            )


def check_servable(config: Config, env: Mapping[str, str], fake_upstream: bool) -> None:
    """What serving ``config`` checks beyond the file itself (the environment's keys, the
    fake upstream, replicas' capacities), without serving it: a supervisor runs it once before
    it starts its workers, so that a config no worker can serve is one clean error, not one
    per worker. ``fake_upstream``: whether one will be started beside the app."""
    resolve_api_keys(config, env)
    if not fake_upstream:
        check_no_fake_upstream(config)
    # Each worker's own fake upstream has its own address, so that replica is not checked.
    replica_capacities(config, env, None)
    check_guards(config, env)


def scheduling_settings(config: Config) -> SchedulingSettings:
    table = config.scheduling
    return SchedulingSettings(
        table.policy,
        table.w_in,
        table.w_out,
        table.starvation_seconds,
        table.preempt_after,
        table.max_preemptions,
        table.pause_keepalive,
        table.preempt_within_band,
    )


def replica_capacities(
    config: Config, env: Mapping[str, str], fake_upstream_url: str | None
) -> dict[str, int]:
    """Each replica's slots (by its name), from the max_connections of the models it serves;
    a ConfigError when two of them disagree (a replica's concurrency is the engine's, one
    number)."""
    capacities: dict[str, tuple[int, str]] = {}
    for model in config.models:
        if model.backend == "local":
            continue
        for url in model.upstreams:
            if url == FAKE_UPSTREAM_URL:
                if fake_upstream_url is None:
                    continue  # check_no_fake_upstream says why
                url = fake_upstream_url
            name = UpstreamReplica.key(url, ConnectionSettings.resolve(url, model, env))
            known = capacities.setdefault(name, (model.max_connections, model.name))
            if known[0] != model.max_connections:
                raise ConfigError(
                    f"[models.{model.name}] and [models.{known[1]}] share the replica {url} "
                    f"but set max_connections = {model.max_connections} and {known[0]}: a "
                    "replica's concurrency is one number (its engine's), set it alike"
                )
    return {name: start_slots(capacity) for name, (capacity, _) in capacities.items()}


class ServedConfig:
    """What one config serves with, beside the process's shared parts (metrics, relay
    tracker, local models). Raises :class:`ConfigError` for what only serving checks (an
    upstream key's variable unset, a ``fake:`` upstream with no fake)."""

    def __init__(
        self,
        config: Config,
        env: Mapping[str, str],
        metrics: Metrics,
        tracker: RelayTracker,
        local_backends: Mapping[str, Backend],
        loading: Mapping[str, str],
        fake_upstream_url: str | None = None,
        previous: ServedConfig | None = None,
        scheduling: Scheduling | None = None,
        after_hooks: AfterHooks | None = None,
    ) -> None:
        self.config = config
        # Upstream keys, and HTTP(S)_PROXY / NO_PROXY for the upstreams' connections.
        self.env = env
        self.api_keys = resolve_api_keys(config, env)
        self.fake_upstream_url = fake_upstream_url
        if fake_upstream_url is None:
            check_no_fake_upstream(config)
        self.metrics = metrics
        self.tracker = tracker
        # The clients' keys (not the upstreams' above) and their limits' counters ([limits]:
        # in this process, or shared through Redis). A key kept across a reload keeps its
        # counters: its streams in flight still count against it.
        self.keys = KeyRing(config.keys, config.limits, metrics)
        if previous is not None:
            self.keys.carry_over(previous.keys)
        # The process's queues (kept across reloads), and each replica's capacity, one per
        # replica whichever models share it.
        self._capacities = replica_capacities(config, env, fake_upstream_url)
        # After every check that may refuse this config: a refused reload changes nothing.
        self.scheduling = scheduling or Scheduling(scheduling_settings(config))
        self.scheduling.configure(scheduling_settings(config))
        self.replicas: dict[str, UpstreamReplica] = {}
        # The upstream models' backends (start_backends) and the local ones, shared.
        self.backends: dict[str, Backend] = dict(local_backends)
        # What upstreams say of their models, for GET /v1/models (list_upstream_models).
        self.catalog = ModelCatalog()
        self.pipeline = RequestPipeline(
            config, self.keys, metrics, tracker, self.backends, local_backends, loading=loading
        )
        # [[guards]]: each use resolved now (a ConfigError names the guard: a refused reload
        # changes nothing); none built, and none asked, without them.
        self.guards: ServedGuards | None = None
        if config.guards:
            self.guards = ServedGuards(
                config, GuardServices(config, env, self.backends), after_hooks
            )
            self.pipeline.guards = self.guards
        # JWT issuers and forward auth: built (and PyJWT imported) only when [auth] says so.
        # An issuer kept across a reload keeps its key set and its cooldown.
        self.identity: Identity | None = None
        if config.auth.enabled:
            from proxy.api.identity import Identity

            self.identity = Identity(config.auth, self.keys, config.keys, metrics=metrics)
            self.identity.carry_over(None if previous is None else previous.identity)
            self.pipeline.identity = self.identity
        # Its background work's scope: cancelled when it retires.
        self._scope = trio.CancelScope()
        self._closed = False

    @property
    def health_policy(self) -> HealthPolicy:
        upstream = self.config.upstream
        return HealthPolicy(upstream.failure_threshold, upstream.ejection_seconds)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start its backends, then run their background work (the limits' Redis client,
        health checks, scrapers, the catalog, spare connections) until :meth:`retire`."""
        with self._scope:
            async with trio.open_nursery() as nursery:
                if self.keys.shared is not None:
                    await nursery.start(self.keys.shared.keep_connected)
                if self.identity is not None:
                    # Its first key-set fetches start now, and are not waited for: a request
                    # that needs a key set waits for its fetch (bounded by fetch_timeout).
                    await nursery.start(self.identity.run)
                self.start_backends()
                self.watch_upstreams(nursery)
                task_status.started()

    def start_backends(self) -> None:
        for name in placeholder_keys(self.config):
            log.warning(
                "!!! [[keys]] %r in %s has the placeholder sha256 (all zeros): no key hashes to "
                "it, so that entry admits nobody. Put the key's own hash there (`sluice "
                "hash-key`).",
                name,
                self.config.source,
            )
        upstream = self.config.upstream
        socket_options = (
            [(socket.SOL_SOCKET, socket.SO_RCVBUF, upstream.socket_rcvbuf)]
            if upstream.socket_rcvbuf
            else None
        )
        for model in self.config.models:
            if model.backend == "local":
                continue  # the process's, started once loaded (SluiceState)
            replicas = []
            for url in model.upstreams:
                if url == FAKE_UPSTREAM_URL:
                    assert self.fake_upstream_url is not None  # check_no_fake_upstream
                    url = self.fake_upstream_url
                connection = ConnectionSettings.resolve(url, model, self.env)
                name = UpstreamReplica.key(url, connection)
                if name not in self.replicas:
                    if not connection.verify:
                        log.warning(
                            "!!! TLS VERIFICATION IS OFF for %s (model '%s', verify = false): "
                            "any server, or anyone between, can answer as this upstream and "
                            "read its requests. Use ca_file for a private CA instead.",
                            url,
                            model.name,
                        )
                    self.replicas[name] = UpstreamReplica(
                        url,
                        upstream,
                        connection,
                        socket_options=socket_options,
                        room=self.scheduling.room(name, self._capacities[name]),
                    )
                    log.info("upstream %s via %s", url, connection.label)
                replica = self.replicas[name]
                key = self.api_keys.get(model.name)
                if key is not None and replica.authorization is None:
                    replica.authorization = f"Bearer {key}"
                replicas.append(replica)
            self.backends[model.name] = UpstreamBackend(
                model,
                replicas,
                self.config.relay,
                dispatcher=self.scheduling.upstream,
                admission=self.scheduling.admission(
                    model.name,
                    max_queue=model.max_queue,
                    queue_timeout=model.queue_timeout,
                    rooms=[replica.room for replica in replicas],
                ),
                api_key=self.api_keys.get(model.name),
                policy=self.health_policy,
                metrics=self.metrics,
            )

        # What the previous config had and this one has not: its rooms retired, its queues
        # let go (their waiters go on, to this config's rooms).
        self.scheduling.keep_only(
            self.replicas,
            [
                name
                for name, backend in self.backends.items()
                if isinstance(backend, UpstreamBackend)
            ],
        )

    def watch_upstreams(self, nursery: trio.Nursery) -> None:
        """The upstreams' background work, each task in ``nursery`` until it is cancelled."""
        upstream = self.config.upstream
        for backend in self.backends.values():
            if isinstance(backend, UpstreamBackend):
                # What its balance needs in the background (upstream_metrics: a scraper per
                # replica); returns at once when it needs nothing.
                nursery.start_soon(backend.watch_replicas)
        for replica in self.replicas.values():
            # Its pool's work in the background, until the pool closes: the lean pool's spare
            # connections (returns at once without preconnect), httpx's sweep of idle
            # connections that their server closed.
            nursery.start_soon(replica.maintain_connections)
        if self.replicas and self.fake_upstream_url is None:
            nursery.start_soon(
                report_reachability, list(self.replicas.values()), upstream.connect_timeout
            )
        if upstream.list_upstream_models and self.replicas:
            served: dict[UpstreamReplica, list[str]] = {}
            # An aliased model is listed upstream under its upstream_model.
            upstream_names: dict[str, str] = {}
            for name, backend in self.backends.items():
                if isinstance(backend, UpstreamBackend):
                    for replica in backend.replicas:
                        served.setdefault(replica, []).append(name)
                    if backend.model.aliased:
                        upstream_names[name] = backend.model.upstream_model
            nursery.start_soon(
                self.catalog.refresh_forever,
                served,
                upstream.models_refresh_interval,
                upstream_names,
            )
        if upstream.health_check_path and self.replicas:
            nursery.start_soon(
                check_replicas,
                list(self.replicas.values()),
                upstream.health_check_path,
                upstream.health_check_interval,
                self.health_policy,
            )

    async def retire(self) -> None:
        """Once a newer served config serves: wait for the relays begun on this one to end (each
        holds its backend, replica and pool, and its key's lease), then stop its background
        work and close its pools; at once when cancelled (the server stops)."""
        relays = self.pipeline.relays
        try:
            while relays:
                with trio.move_on_after(_RETIRE_POLL_SECONDS):
                    await self.tracker.wait_until(lambda _: not relays)
        finally:
            with trio.CancelScope(shield=True) as cleanup:
                cleanup.deadline = trio.current_time() + _CLOSE_SECONDS
                await self.aclose()

    async def aclose(self) -> None:
        """Close its pools (once: shutdown may close one that is retiring)."""
        if self._closed:
            return
        self._closed = True
        self._scope.cancel()
        if self.guards is not None:
            await self.guards.aclose()
        for replica in self.replicas.values():
            await replica.aclose()
