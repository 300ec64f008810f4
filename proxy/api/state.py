"""The per-process state every request shares, and its start-up: the backends, their
background work, and the local models' loading."""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from proxy.api.auth import KeyRing
from proxy.api.pipeline import RequestPipeline
from proxy.backends.base import Backend
from proxy.backends.upstream.backend import UpstreamBackend
from proxy.backends.upstream.catalog import ModelCatalog
from proxy.backends.upstream.replica import UpstreamReplica
from proxy.backends.upstream.routing import HealthPolicy
from proxy.backends.upstream.scrape import check_replicas, report_reachability
from proxy.backends.upstream.transports import ConnectionSettings
from proxy.config import FAKE_UPSTREAM_URL, Config, ConfigError, LocalModel
from proxy.ops import tracing
from proxy.ops.metrics import Metrics
from proxy.ops.progress import stage_reporter
from proxy.relay.body import RelayTracker
from proxy.server.asgi import SluiceQuart

if TYPE_CHECKING:
    from proxy.backends.local import LocalBackend

log = logging.getLogger("sluice.app")


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


class SluiceState:
    """Everything one server process shares across requests."""

    def __init__(
        self,
        config: Config,
        env: Mapping[str, str],
        local_models: Mapping[str, Any] | None = None,
        fake_upstream_url: str | None = None,
    ) -> None:
        self.config = config
        # Upstream keys, and HTTP(S)_PROXY / NO_PROXY for the upstreams' connections.
        self.env = env
        self.api_keys = resolve_api_keys(config, env)
        self.metrics = Metrics()
        # This process's tracing (ops/tracing.py), or None: off, and nothing of it imported.
        self.tracing = tracing.install(config.tracing, env, self.metrics)
        # The clients' keys (not the upstreams' above) and their limits' counters ([limits]:
        # in this process, or shared through Redis).
        self.keys = KeyRing(config.keys, config.limits, self.metrics)
        self.tracker = RelayTracker(self.metrics)
        self.replicas: dict[str, UpstreamReplica] = {}
        self.backends: dict[str, Backend] = {}
        self.local_backends: dict[str, LocalBackend] = {}
        # Preloaded local models by name (tests); the others are loaded at start-up.
        self.local_models: dict[str, Any] = dict(local_models or {})
        # Local models still loading (the port answers meanwhile: /v1/* with 503
        # model_loading), by name, with the stage they are in.
        self.loading: dict[str, str] = {
            model.name: "queued"
            for model in config.models
            if model.backend == "local" and model.name not in self.local_models
        }
        # Every completion-like request, whatever its transport, goes through this one.
        self.pipeline = RequestPipeline(
            config,
            self.keys,
            self.metrics,
            self.tracker,
            self.backends,
            self.local_backends,
            loading=self.loading,
        )
        # Where the models' "fake:" upstream listens: the fake upstream is tooling, started
        # beside the app by whoever starts the app (`sluice serve` with [fake_upstream]).
        self.fake_upstream_url = fake_upstream_url
        if fake_upstream_url is None:
            check_no_fake_upstream(config)
        # What upstreams say of their models, for GET /v1/models (list_upstream_models).
        self.catalog = ModelCatalog()
        # Serving (backends started) and not draining: what /readyz reports.
        self.started = False
        self.draining = False
        # A model that failed to load: the server stops, and this is its one-line reason.
        self.load_error: BaseException | None = None
        self.failed = trio.Event()

    @property
    def ready(self) -> bool:
        return self.started and not self.draining and not self.loading

    async def load_local_models(self, nursery: trio.Nursery) -> None:
        """Load every configured local model not given preloaded, one at a time, in a thread
        (loading takes seconds and must not block the event loop), each made servable as soon
        as it is loaded. A failure stops the server (``failed``), with its reason."""
        report = stage_reporter()
        for model in self.config.models:
            if model.backend != "local" or model.name not in self.loading:
                continue
            from inference import ModelLoadError, load_model

            def stage(name: str, what: str) -> None:
                self.loading[name] = what
                report(name, what)

            try:
                loaded = await trio.to_thread.run_sync(
                    partial(load_model, model.path, model.name, progress=stage)
                )
            except ModelLoadError as error:
                report(model.name, "failed")
                self.load_error = error
                self.failed.set()
                return
            self.local_models[model.name] = loaded
            await self.start_local_backend(model, nursery)
            del self.loading[model.name]
            log.info("model %s loaded: serving it", model.name)

    async def start_local_backend(self, model: LocalModel, nursery: trio.Nursery) -> None:
        """Serve a loaded model: its batch engine runs in ``nursery`` (the app's) from now
        until the server stops."""
        from proxy.backends.local import LocalBackend

        local = LocalBackend(model, self.local_models[model.name], self.metrics)
        await nursery.start(local.run)
        self.local_backends[model.name] = local
        self.backends[model.name] = local

    @property
    def health_policy(self) -> HealthPolicy:
        upstream = self.config.upstream
        return HealthPolicy(upstream.failure_threshold, upstream.ejection_seconds)

    async def start(self, nursery: trio.Nursery) -> None:
        """Start serving (the app's before_serving): the backends, then their background work
        in ``nursery`` (the app's), which runs until the server stops."""
        if self.keys.shared is not None:
            # The shared limits' Redis client lives in the app's nursery.
            await nursery.start(self.keys.shared.keep_connected)
        self.start_backends()
        for model in self.config.models:
            if model.backend == "local" and model.name in self.local_models:
                await self.start_local_backend(model, nursery)
        self.started = True
        if self.loading:
            # In the background: the port answers while the weights load (/healthz says
            # "loading", requests to the model get 503 model_loading with Retry-After).
            nursery.start_soon(self.load_local_models, nursery)
        self.watch_upstreams(nursery)

    def watch_upstreams(self, nursery: trio.Nursery) -> None:
        """The upstreams' background work, each task in ``nursery`` until the server stops."""
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

    def start_backends(self) -> None:
        upstream = self.config.upstream
        socket_options = (
            [(socket.SOL_SOCKET, socket.SO_RCVBUF, upstream.socket_rcvbuf)]
            if upstream.socket_rcvbuf
            else None
        )
        for model in self.config.models:
            if model.backend == "local":
                continue  # started by start_local_backend, once loaded
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
                        url, upstream, connection, socket_options=socket_options
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
                api_key=self.api_keys.get(model.name),
                policy=self.health_policy,
                metrics=self.metrics,
            )

    async def aclose(self) -> None:
        for replica in self.replicas.values():
            await replica.aclose()
        if self.tracing is not None:
            # Flushes what is queued, bounded by the exporter's timeout: in a thread, so that a
            # collector that is down delays no other task's shutdown.
            with trio.move_on_after(tracing.EXPORT_TIMEOUT + 1):
                await trio.to_thread.run_sync(self.tracing.shutdown, abandon_on_cancel=True)


def state_of(app: SluiceQuart) -> SluiceState:
    state = app.extensions["sluice"]
    assert isinstance(state, SluiceState)
    return state
