"""The per-process state every request shares, and its start-up: the backends, their
background work, the local models' loading, and a reload's swap of the served config."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from proxy.api.auth import KeyRing
from proxy.api.pipeline import RequestPipeline
from proxy.api.reload import RELOAD_OUTCOMES, ConfigReloader, ReloadPlan
from proxy.api.served_config import ServedConfig, scheduling_settings
from proxy.api.served_config import check_no_fake_upstream as check_no_fake_upstream
from proxy.api.served_config import resolve_api_keys as resolve_api_keys
from proxy.api.shared_service import SharedService
from proxy.backends.base import Backend
from proxy.backends.upstream.catalog import ModelCatalog
from proxy.backends.upstream.replica import UpstreamReplica
from proxy.config import Config, ConfigError, LocalModel
from proxy.ops import tracing
from proxy.ops.metrics import Metrics
from proxy.ops.progress import stage_reporter
from proxy.relay.admission import Scheduling
from proxy.relay.body import RelayTracker
from proxy.relay.guarded import AfterHooks
from proxy.server.asgi import SluiceQuart

if TYPE_CHECKING:
    from proxy.backends.local import LocalBackend

log = logging.getLogger("sluice.app")

# Closing what a failed reload had opened never holds it up longer than this.
_CLEANUP_SECONDS = 5.0


class SluiceState:
    """Everything one server process shares across requests."""

    def __init__(
        self,
        config: Config,
        env: Mapping[str, str],
        local_models: Mapping[str, Any] | None = None,
        fake_upstream_url: str | None = None,
    ) -> None:
        # Upstream keys, and HTTP(S)_PROXY / NO_PROXY for the upstreams' connections.
        self.env = env
        self.metrics = Metrics()
        # This process's tracing (ops/tracing.py), or None: off, and nothing of it imported.
        self.tracing = tracing.install(config.tracing, env, self.metrics)
        self.tracker = RelayTracker(self.metrics)
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
        # Where the models' "fake:" upstream listens: the fake upstream is tooling, started
        # beside the app by whoever starts the app (`sluice serve` with [fake_upstream]).
        self.fake_upstream_url = fake_upstream_url
        # The queues of the upstreams (their rooms and order), and each key's service: the
        # process's, kept across reloads.
        self.scheduling = Scheduling(scheduling_settings(config))
        # The keys' counters shared through Redis, once serving with [limits] backend = redis.
        self.shared_service: SharedService | None = None
        # The guards' after hooks: a bounded nursery of the server's, started with it; the
        # drain waits for them up to the grace's end.
        self.after_hooks = AfterHooks(self.metrics)
        self.grace_end: float | None = None
        # The config's keys, upstreams and pipeline (api/served_config.py): replaced whole by a
        # reload, in one assignment; the previous ones retire once their relays end.
        self.current = self.build_served(config)
        self.retiring: set[ServedConfig] = set()
        # The app's nursery, once serving: a reload starts its served config's work there.
        self.nursery: trio.Nursery | None = None
        # Re-reads the config file on SIGHUP (api/reload.py), with what it said at start.
        self.reloader = ConfigReloader(config, env)
        self._reloading = trio.Lock()
        for outcome in RELOAD_OUTCOMES:
            self.metrics.config_reloads.labels(outcome)  # each one there, at 0
        # Serving (backends started) and not draining: what /readyz reports.
        self.started = False
        self.draining = False
        # A model that failed to load: the server stops, and this is its one-line reason.
        self.load_error: BaseException | None = None
        self.failed = trio.Event()

    def build_served(self, config: Config, previous: ServedConfig | None = None) -> ServedConfig:
        """The serving objects of ``config`` (not started): at start-up, and at each reload."""
        served = ServedConfig(
            config,
            self.env,
            self.metrics,
            self.tracker,
            self.local_backends,
            self.loading,
            self.fake_upstream_url,
            previous,
            self.scheduling,
            self.after_hooks,
        )
        # Once the config is accepted: a refused reload changes nothing.
        for local in self.local_backends.values():
            local.configure(scheduling_settings(config))
        if self.shared_service is not None:
            # From its next sync on.
            self.shared_service.interval = config.scheduling.share_seconds
        return served

    # What the current served config serves with: each request reads these once (the pipeline
    # at its start), so that a reload never mixes two configs within one request.
    @property
    def config(self) -> Config:
        return self.current.config

    @property
    def pipeline(self) -> RequestPipeline:
        return self.current.pipeline

    @property
    def keys(self) -> KeyRing:
        return self.current.keys

    @property
    def api_keys(self) -> dict[str, str]:
        return self.current.api_keys

    @property
    def backends(self) -> dict[str, Backend]:
        return self.current.backends

    @property
    def replicas(self) -> dict[str, UpstreamReplica]:
        return self.current.replicas

    @property
    def catalog(self) -> ModelCatalog:
        return self.current.catalog

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
            from inference.torch_threads import in_own_thread

            def stage(name: str, what: str) -> None:
                self.loading[name] = what
                report(name, what)

            try:
                # In a thread that ends with the load, taking its OpenMP team along
                # (inference/torch_threads.py).
                loaded = await trio.to_thread.run_sync(
                    in_own_thread,
                    partial(
                        load_model,
                        model.path,
                        model.name,
                        progress=stage,
                        weights=model.weights,
                        keep_transformers=False,
                        threads=max(
                            (
                                other.threads
                                for other in self.config.models
                                if isinstance(other, LocalModel)
                            ),
                            default=0,
                        ),
                    ),
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

        local = LocalBackend(
            model, self.local_models[model.name], self.metrics, scheduling_settings(self.config)
        )
        await nursery.start(local.run)
        self.local_backends[model.name] = local
        # Every served config serves it; a reload's next one copies local_backends.
        self.current.backends[model.name] = local
        for served in self.retiring:
            served.backends[model.name] = local

    async def start(self, nursery: trio.Nursery) -> None:
        """Start serving (the app's before_serving): the backends, then their background work
        in ``nursery`` (the app's), which runs until the server stops."""
        self.nursery = nursery
        await nursery.start(self.after_hooks.run)
        self._share_counters_if_redis(self.config, nursery)
        # The shared limits' Redis client and the upstreams' work live in the app's nursery.
        await nursery.start(self.current.run)
        for model in self.config.models:
            if model.backend == "local" and model.name in self.local_models:
                await self.start_local_backend(model, nursery)
        self.started = True
        if self.loading:
            # In the background: the port answers while the weights load (/healthz says
            # "loading", requests to the model get 503 model_loading with Retry-After).
            nursery.start_soon(self.load_local_models, nursery)

    def _share_counters_if_redis(self, config: Config, nursery: trio.Nursery) -> None:
        """With ``[limits] backend = "redis"`` (at start, or from a reload on), the keys'
        counters are shared with the other instances through the current config's store
        (nothing is sent while a reloaded config counts in memory); started once."""
        if config.limits.backend != "redis" or self.shared_service is not None:
            return
        shared = SharedService(
            self.scheduling.upstream,
            lambda: self.current.keys.shared,
            interval=config.scheduling.share_seconds,
        )
        self.shared_service = shared
        nursery.start_soon(shared.run, name="sluice scheduler counters (Redis)")

    async def serve_config(self, served: ServedConfig) -> None:
        """Serve the config ``served`` from now on: its work started in the app's nursery, then one
        assignment, which the next request reads; the previous one retires in the
        background once its relays have ended."""
        assert self.nursery is not None, "serving starts before a reload"
        try:
            await self.nursery.start(served.run)
        except BaseException:
            with trio.CancelScope(shield=True) as cleanup:  # the pools it had opened
                cleanup.deadline = trio.current_time() + _CLEANUP_SECONDS
                await served.aclose()
            raise
        # A local model that finished loading while this one started.
        served.backends.update(self.local_backends)
        previous, self.current = self.current, served
        self._share_counters_if_redis(served.config, self.nursery)
        self.retiring.add(previous)
        self.nursery.start_soon(self._retire, previous)

    async def _retire(self, served: ServedConfig) -> None:
        try:
            await served.retire()
        finally:
            self.retiring.discard(served)

    async def reload_config(self) -> str:
        """Read the config file again and serve what of it applies (api/reload.py); a file
        that cannot be served is one log line, and the running config goes on. The outcome
        (applied, invalid, restart_needed) is counted and returned; "ignored" (not counted)
        before serving has started or once draining."""
        if self.nursery is None or self.draining:
            log.warning("reload ignored: %s", "draining" if self.draining else "not serving yet")
            return "ignored"
        async with self._reloading:  # one at a time: each builds on the one before
            try:
                plan = self.reloader.read(self.config)
                served = self.build_served(plan.config, previous=self.current)
                await self.serve_config(served)
            except ConfigError as error:
                refused: Exception | None = error
            except Exception as error:  # a reload must not stop the server
                log.exception("reload failed, still serving the previous config")
                refused = error
            else:
                refused = None
        if refused is not None:
            if isinstance(refused, ConfigError):
                # One line, no traceback: the message says which key and why.
                log.error("reload refused, still serving the previous config: %s", refused)
            outcome = "invalid"
        elif plan.restart_needed:
            log.warning(
                "config reloaded from %s: %s; restart needed for: %s (left as they were)",
                plan.config.source,
                applied_changes(plan),
                ", ".join(plan.restart_needed),
            )
            outcome = plan.outcome
        else:
            log.info("config reloaded from %s: %s", plan.config.source, applied_changes(plan))
            outcome = plan.outcome
        self.metrics.config_reloads.labels(outcome).inc()
        return outcome

    def begin_drain(self, grace_end: float) -> None:
        """SIGTERM (or a shutdown trigger): /readyz turns 503, and every queue drains by
        ``grace_end`` (:meth:`~proxy.relay.admission.Dispatcher.drain`): no new preemption,
        paused requests first, queued ones that cannot start in time refused now."""
        self.draining = True
        self.grace_end = grace_end
        self.scheduling.upstream.drain(grace_end)
        for local in self.local_backends.values():
            local.admission.dispatcher.drain(grace_end)

    def end_grace(self) -> int:
        """The drain's grace is about to end: every request still at work is stopped, and its
        client told (``shutting_down``: a 503, or an in-band error); how many were."""
        return sum(body.shut_down() for body in list(self.tracker.active))

    async def aclose(self) -> None:
        # The after hooks still running get what is left of the grace (none past it); their
        # own calls to a policy service close before the pools do.
        await self.after_hooks.drain(
            trio.current_time() if self.grace_end is None else self.grace_end
        )
        for served in (self.current, *self.retiring):
            await served.aclose()
        if self.tracing is not None:
            # Flushes what is queued, bounded by the exporter's timeout: in a thread, so that a
            # collector that is down delays no other task's shutdown.
            with trio.move_on_after(tracing.EXPORT_TIMEOUT + 1):
                await trio.to_thread.run_sync(self.tracing.shutdown, abandon_on_cancel=True)


def applied_changes(plan: ReloadPlan) -> str:
    return "; ".join(plan.applied_changes) or "nothing that applies changed"


def state_of(app: SluiceQuart) -> SluiceState:
    state = app.extensions["sluice"]
    assert isinstance(state, SluiceState)
    return state
