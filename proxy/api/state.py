"""The app factory: routes, error shapes, and the per-process state they share."""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import trio
from quart import Response, request
from werkzeug.exceptions import HTTPException

from proxy.api import web
from proxy.api.auth import CORS_EXPOSED_HEADERS, CorsPolicy, KeyRing
from proxy.api.pipeline import RequestPipeline
from proxy.api.ws import serve_websocket
from proxy.backends.base import Backend
from proxy.backends.upstream.backend import (
    UpstreamBackend,
    UpstreamReplica,
    check_replicas,
    report_reachability,
)
from proxy.backends.upstream.catalog import ModelCatalog
from proxy.backends.upstream.routing import HealthPolicy
from proxy.backends.upstream.transports import ConnectionSettings
from proxy.config import FAKE_UPSTREAM_URL, Config, ConfigError, ModelConfig
from proxy.ops.logs import AccessRecord
from proxy.ops.metrics import Metrics
from proxy.ops.progress import stage_reporter
from proxy.protocol.errors import ApiError, internal_error, model_not_found, request_too_large
from proxy.protocol.openai import Endpoint, models_list
from proxy.protocol.shapes import ErrorShape, endpoint_of, error_shape
from proxy.relay.body import JSON_CONTENT_TYPE, RelayBody, RelayTracker
from proxy.server.asgi import SluiceQuart

if TYPE_CHECKING:
    from proxy.backends.local import LocalBackend

log = logging.getLogger("sluice.app")


def resolve_api_keys(config: Config, env: Mapping[str, str]) -> dict[str, str]:
    """Each model's upstream key, read from the environment variable its config names."""
    keys: dict[str, str] = {}
    for model in config.models:
        if not model.api_key_env:
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


class SluiceState:
    """Everything one server process shares across requests."""

    def __init__(
        self,
        config: Config,
        env: Mapping[str, str],
        local_models: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = config
        # Upstream keys, and HTTP(S)_PROXY / NO_PROXY for the upstreams' connections.
        self.env = env
        self.api_keys = resolve_api_keys(config, env)
        self.metrics = Metrics()
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
        self.fake_upstream: Any = None
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
            if model.name not in self.loading:
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

    async def start_local_backend(self, model: ModelConfig, nursery: trio.Nursery) -> None:
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

    def start_backends(self, fake_upstream_url: str | None) -> None:
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
                    assert fake_upstream_url is not None
                    url = fake_upstream_url
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


def _json_response(
    payload: bytes, status: int, headers: Mapping[str, str] | None = None
) -> Response:
    response = Response(payload, status=status, content_type=JSON_CONTENT_TYPE)
    for name, value in (headers or {}).items():
        response.headers[name] = value
    return response


def create_app(
    config: Config,
    env: Mapping[str, str] | None = None,
    *,
    local_models: Mapping[str, Any] | None = None,
) -> SluiceQuart:
    """The app. ``local_models`` maps model names to preloaded ``inference.LoadedModel``s;
    local models not given are loaded when the server starts."""
    state = SluiceState(config, os.environ if env is None else env, local_models)
    # static_folder=None: Quart would otherwise serve ./static from the working directory.
    # The chat page's files come from the package, through the web blueprint.
    app = SluiceQuart("sluice", static_folder=None)
    app.register_blueprint(web.blueprint)
    app.config["MAX_CONTENT_LENGTH"] = config.server.max_body_bytes
    app.extensions["sluice"] = state

    @app.before_serving
    async def start() -> None:
        fake_url = None
        if config.fake_upstream.enabled:
            from proxy.testing.fake_upstream import FakeSettings, FakeUpstream

            fake = config.fake_upstream
            state.fake_upstream = FakeUpstream(
                FakeSettings(
                    ttft=fake.ttft,
                    interval=fake.interval,
                    tokens=fake.tokens,
                    models=[m.name for m in config.models],
                )
            )
            port = await app.nursery.start(state.fake_upstream.serve, "127.0.0.1", 0)
            fake_url = f"http://127.0.0.1:{port}"
            log.info("embedded fake upstream on %s", fake_url)
        if state.keys.shared is not None:
            # The shared limits' Redis client lives in the app's nursery.
            await app.nursery.start(state.keys.shared.keep_connected)
        state.start_backends(fake_url)
        for model in config.models:
            if model.backend == "local" and model.name in state.local_models:
                await state.start_local_backend(model, app.nursery)
        state.started = True
        if state.loading:
            # In the background: the port answers while the weights load (/healthz says
            # "loading", requests to the model get 503 model_loading with Retry-After).
            app.nursery.start_soon(state.load_local_models, app.nursery)
        upstream = config.upstream
        for backend in state.backends.values():
            if isinstance(backend, UpstreamBackend):
                # What its balance needs in the background (upstream_metrics: a scraper per
                # replica); returns at once when it needs nothing.
                app.nursery.start_soon(backend.watch_replicas)
        for replica in state.replicas.values():
            # Its pool's work in the background, until the pool closes: the lean pool's spare
            # connections (returns at once without preconnect), httpx's sweep of idle
            # connections that their server closed.
            app.nursery.start_soon(replica.maintain_connections)
        if state.replicas and state.fake_upstream is None:
            app.nursery.start_soon(
                report_reachability, list(state.replicas.values()), upstream.connect_timeout
            )
        if upstream.list_upstream_models and state.replicas:
            served: dict[UpstreamReplica, list[str]] = {}
            for name, backend in state.backends.items():
                if isinstance(backend, UpstreamBackend):
                    for replica in backend.replicas:
                        served.setdefault(replica, []).append(name)
            app.nursery.start_soon(
                state.catalog.refresh_forever, served, upstream.models_refresh_interval
            )
        if upstream.health_check_path and state.replicas:
            app.nursery.start_soon(
                check_replicas,
                list(state.replicas.values()),
                upstream.health_check_path,
                upstream.health_check_interval,
                state.health_policy,
            )

    @app.after_serving
    async def stop() -> None:
        await state.aclose()

    pipeline = state.pipeline

    def refused(error: ApiError) -> None:
        """What every refusal does besides answering: the access line's outcome and, for a
        completion request, the requests metric (through the pipeline, in end_request)."""
        access: AccessRecord | None = getattr(request, "sluice_access", None)
        if access is not None:
            access.outcome = error.code or "error"

    # Every path that the pipeline serves: the native endpoints and the models' pass-through.
    passthrough_paths = frozenset(path for model in config.models for path in model.passthrough)

    def endpoint_here() -> Endpoint | None:
        if request.path in passthrough_paths:
            return Endpoint.PASSTHROUGH
        return endpoint_of(request.path)

    def shape() -> ErrorShape:
        """The error shape of the API this request speaks (Anthropic's on /v1/messages)."""
        return error_shape(endpoint_here())

    @app.errorhandler(ApiError)
    async def api_error(error: ApiError) -> Response:
        refused(error)
        return _json_response(shape().body(error), error.status, error.headers)

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response:
        status = error.code or 500
        headers: dict[str, str] = {}
        if status == 413:
            api = request_too_large(config.server.max_body_bytes)
        elif status == 404:
            api = ApiError(
                404,
                f"No such path: {request.path}. Sluice serves POST /v1/chat/completions, "
                "/v1/completions, /v1/responses, /v1/messages and /v1/embeddings, GET "
                "/v1/models, WebSocket /v1/ws"
                + (
                    f", and the pass-through paths {', '.join(sorted(passthrough_paths))}"
                    if passthrough_paths
                    else ""
                )
                + ".",
                code="not_found",
            )
        elif status == 405:
            allowed = sorted(getattr(error, "valid_methods", None) or ())
            headers["Allow"] = ", ".join(allowed)
            api = ApiError(
                405,
                f"{request.method} is not allowed on {request.path}"
                + (f"; use {' or '.join(allowed)}" if allowed else ""),
                code="method_not_allowed",
            )
        else:
            api = ApiError(
                status,
                f"{error.name}: {error.description}",
                code=error.name.lower().replace(" ", "_"),
            )
        refused(api)
        return _json_response(shape().body(api), status, headers)

    @app.errorhandler(Exception)
    async def unexpected_error(error: Exception) -> Response:
        log.exception("unhandled error", exc_info=error)
        api = internal_error()
        refused(api)
        return _json_response(shape().body(api), api.status)

    cors = CorsPolicy(config.server.cors_origins)

    @app.before_request
    async def begin_request() -> None:
        # First of the before_request hooks, so that a refusal by any later one (a 401) has
        # its request id and access line too.
        request.sluice_access = pipeline.begin(  # type: ignore[attr-defined]
            request.method,
            request.path,
            request.remote_addr or "-",
            request.headers.get("X-Request-ID"),
        )

    @app.after_request
    async def end_request(response: Response) -> Response:
        # Runs for every response, refusals included (Quart finalizes error-handler responses
        # too); a relayed response's line is written by its body when the stream ends.
        access: AccessRecord | None = getattr(request, "sluice_access", None)
        if access is None:
            return response
        response.headers["X-Request-ID"] = access.request_id
        if not isinstance(response.response, RelayBody):
            model = getattr(request, "sluice_model", "-")
            endpoint = endpoint_here()
            if endpoint is not None and response.status_code >= 400:
                pipeline.refused(access, response.status_code, access.outcome, model, endpoint)
            else:
                pipeline.finished(access, response.status_code, access.outcome, model)
        return response

    @app.before_request
    async def authenticate() -> Response | None:
        if request.method == "OPTIONS":
            # Browsers send preflights without credentials, so they are answered unauthenticated
            # (they reveal nothing and start no work); other OPTIONS get Quart's Allow answer.
            preflight = request.headers.get("Access-Control-Request-Method")
            if preflight and cors.allow_origin(request.headers.get("Origin")):
                requested = request.headers.get("Access-Control-Request-Headers")
                return Response("", status=204, headers=cors.preflight_headers(requested))
            return None
        # Only the API needs a key: /healthz and /metrics stay open to probes and scrapers.
        if request.path.startswith("/v1/") or request.path in passthrough_paths:
            # Before the body is read: an unauthenticated client costs no parsing.
            access: AccessRecord = request.sluice_access  # type: ignore[attr-defined]
            authorization = request.headers.get("Authorization")
            api_key = request.headers.get("x-api-key")
            if authorization is None and api_key is not None:
                # Anthropic's SDKs send the key so (with anthropic-version); checked against
                # the same [[keys]], and, as Authorization, never forwarded.
                authorization = f"Bearer {api_key}"
            key = pipeline.authenticate(authorization, access)
            request.sluice_key = key  # type: ignore[attr-defined]
        return None

    if cors.enabled:

        @app.after_request
        async def cors_headers(response: Response) -> Response:
            # Runs for every response, errors and relayed streams included: asgi.py sends
            # response.headers (plus the relay's own) when the relay's head is ready.
            allowed = cors.allow_origin(request.headers.get("Origin"))
            if allowed is not None:
                response.headers["Access-Control-Allow-Origin"] = allowed
                response.headers["Access-Control-Expose-Headers"] = CORS_EXPOSED_HEADERS
            if cors.varies:
                response.vary.add("Origin")
            return response

    async def completions(endpoint: Endpoint) -> Response:
        access: AccessRecord = request.sluice_access  # type: ignore[attr-defined]
        raw = await request.get_data(cache=False)
        assert isinstance(raw, bytes)
        parsed = pipeline.parse(
            raw,
            endpoint,
            path=request.path,
            content_type=request.headers.get("Content-Type", "application/json"),
            headers=request.headers,
        )
        # Raises model_not_found for a model not configured, before the label below is set.
        body = pipeline.relay(parsed, access, getattr(request, "sluice_key", None))
        request.sluice_model = parsed.model  # type: ignore[attr-defined]
        response = Response(body)
        # Quart's RESPONSE_TIMEOUT (60 s) would silently truncate a long stream; the relay's own
        # deadlines (upstream total, client stall) bound it instead.
        response.timeout = None
        return response

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await completions(Endpoint.CHAT)

    @app.post("/v1/completions")
    async def text_completions() -> Response:
        return await completions(Endpoint.COMPLETIONS)

    @app.post("/v1/responses")
    async def responses() -> Response:
        return await completions(Endpoint.RESPONSES)

    @app.post("/v1/messages")
    async def messages() -> Response:
        return await completions(Endpoint.MESSAGES)

    @app.post("/v1/embeddings")
    async def embeddings() -> Response:
        return await completions(Endpoint.EMBEDDINGS)

    for path in sorted(passthrough_paths):
        # One route per configured path: anything else is the app's 404, in OpenAI's shape.
        app.add_url_rule(
            path,
            f"passthrough {path}",
            partial(completions, Endpoint.PASSTHROUGH),
            methods=["POST"],
        )

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return models_list([model.name for model in config.models], state.catalog.entries)

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> dict[str, Any]:
        # Model names may hold slashes ("HuggingFaceTB/SmolLM2-135M-Instruct"): a path.
        if config.model(model_id) is None:
            raise model_not_found(model_id)
        listed: dict[str, Any] = models_list([model_id], state.catalog.entries)["data"][0]
        return listed

    @app.get("/metrics")
    async def metrics() -> Response:
        payload, content_type = state.metrics.render(request.headers.get("Accept", ""))
        return Response(payload, content_type=content_type)

    @app.websocket("/v1/ws")
    async def chat_websocket() -> None:
        await serve_websocket(pipeline)

    @app.get("/readyz")
    async def readyz() -> Response:
        # Load balancers stop sending here as soon as a drain begins, while /healthz (the
        # process is alive) stays green until the in-flight streams are done.
        ready = state.ready
        payload = json.dumps({"ready": ready, "draining": state.draining}).encode()
        return _json_response(payload, 200 if ready else 503)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {
            "status": "loading" if state.loading else "ok",
            # Each model still loading, with its stage ("reading weights"...).
            "loading": dict(state.loading),
            "pid": os.getpid(),  # which worker answered, with --workers
            "active_streams": len(state.tracker.active),
            "local_models": {
                name: backend.describe() for name, backend in state.local_backends.items()
            },
        }

    return app


def state_of(app: SluiceQuart) -> SluiceState:
    state = app.extensions["sluice"]
    assert isinstance(state, SluiceState)
    return state
