"""The hooks every HTTP request passes: its request id and access record (begun before, ended
after the response), its client key (authenticate, through the pipeline), and CORS.

Registered in this order, and only these: the per-request path is measured."""

from __future__ import annotations

from quart import Response, request

from proxy.api.auth import CORS_EXPOSED_HEADERS, CorsPolicy
from proxy.api.routes import endpoint_finder, passthrough_paths
from proxy.api.state import SluiceState
from proxy.ops.logs import AccessRecord
from proxy.relay.body import RelayBody
from proxy.server.asgi import SluiceQuart


def register_hooks(app: SluiceQuart, state: SluiceState) -> None:
    passthrough = passthrough_paths(state.config)
    endpoint_here = endpoint_finder(passthrough)
    cors = CorsPolicy(state.config.server.cors_origins)

    @app.before_request
    async def begin_request() -> None:
        # First of the before_request hooks, so that a refusal by any later one (a 401) has
        # its request id and access line too. The request keeps the pipeline it began on: a
        # reload meanwhile changes nothing of it (its key, its model, its upstream).
        pipeline = request.sluice_pipeline = state.pipeline  # type: ignore[attr-defined]
        request.sluice_access = pipeline.begin(  # type: ignore[attr-defined]
            request.method,
            request.path,
            request.remote_addr or "-",
            request.headers.get("X-Request-ID"),
            request.headers,
        )

    @app.after_request
    async def end_request(response: Response) -> Response:
        # Runs for every response, refusals included (Quart finalizes error-handler responses
        # too); a relayed response's line is written by its body when the stream ends.
        access: AccessRecord | None = getattr(request, "sluice_access", None)
        if access is None:
            return response
        response.headers["X-Request-ID"] = access.request_id
        if access.trace is not None:
            # W3C Trace Context Level 2: the trace (and this server span) the response is of.
            response.headers["traceresponse"] = access.trace.traceresponse
        if not isinstance(response.response, RelayBody):
            pipeline = request.sluice_pipeline  # type: ignore[attr-defined]
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
        if request.path.startswith("/v1/") or request.path in passthrough:
            # Before the body is read: an unauthenticated client costs no parsing.
            access: AccessRecord = request.sluice_access  # type: ignore[attr-defined]
            pipeline = request.sluice_pipeline  # type: ignore[attr-defined]
            key = pipeline.authenticate(request.headers, access)
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
