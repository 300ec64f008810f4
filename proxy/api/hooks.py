"""The hooks every HTTP request passes: its request id and access record (begun before, ended
after the response), its client key (authenticate, through the pipeline), and CORS.

:class:`RequestHooks` is what they do, once: Quart's hooks (registered here, in this order, and
only these: the per-request path is measured) and the fast path's routes (fast_routes.py) both
call it."""

from __future__ import annotations

from quart import Response, request

from proxy.api.auth import CORS_EXPOSED_HEADERS, CorsPolicy
from proxy.api.pipeline import HeaderLookup, RequestPipeline
from proxy.api.routes import endpoint_finder, passthrough_paths
from proxy.api.state import SluiceState
from proxy.config import KeyConfig
from proxy.ops.logs import AccessRecord
from proxy.protocol.openai import Endpoint
from proxy.relay.body import RelayBody
from proxy.server.asgi import SluiceQuart


class RequestHooks:
    """What happens around every request, whichever server layer read it."""

    def __init__(self, state: SluiceState) -> None:
        self.state = state
        self.passthrough = passthrough_paths(state.config)
        self.cors = CorsPolicy(state.config.server.cors_origins)

    def begin(
        self, method: str, path: str, client: str, headers: HeaderLookup
    ) -> tuple[RequestPipeline, AccessRecord]:
        """The pipeline the request keeps (a reload meanwhile changes nothing of it: its key,
        its model, its upstream) and its access record, which every refusal after this has."""
        pipeline = self.state.pipeline
        access = pipeline.begin(method, path, client, headers.get("X-Request-ID"), headers)
        return pipeline, access

    def needs_key(self, path: str) -> bool:
        """Only the API needs a key: /healthz and /metrics stay open to probes and scrapers."""
        return path.startswith("/v1/") or path in self.passthrough

    @staticmethod
    def identify(
        pipeline: RequestPipeline, headers: HeaderLookup, access: AccessRecord
    ) -> KeyConfig | None:
        # Before the body is read: an unauthenticated client costs no parsing.
        return pipeline.authenticate(headers, access)

    def response_headers(self, access: AccessRecord, origin: str | None) -> list[tuple[str, str]]:
        """The headers every answer carries, a relayed stream's included: its request id, its
        trace (W3C Trace Context Level 2: the trace and this server span it is of), CORS."""
        headers = [("X-Request-ID", access.request_id)]
        if access.trace is not None:
            headers.append(("traceresponse", access.trace.traceresponse))
        headers.extend(self.cors_headers(origin))
        return headers

    def cors_headers(self, origin: str | None) -> list[tuple[str, str]]:
        cors = self.cors
        if not cors.enabled:
            return []
        headers = []
        allowed = cors.allow_origin(origin)
        if allowed is not None:
            headers.append(("Access-Control-Allow-Origin", allowed))
            headers.append(("Access-Control-Expose-Headers", CORS_EXPOSED_HEADERS))
        if cors.varies:
            headers.append(("Vary", "Origin"))
        return headers

    @staticmethod
    def answered(
        pipeline: RequestPipeline,
        access: AccessRecord,
        status: int,
        model: str,
        endpoint: Endpoint | None,
    ) -> None:
        """The access line (and, for a refused API request, its metric) of an answer that is
        not a relay: a relayed response's line is written by its body when the stream ends."""
        if endpoint is not None and status >= 400:
            pipeline.refused(access, status, access.outcome, model, endpoint)
        else:
            pipeline.finished(access, status, access.outcome, model)


def register_hooks(app: SluiceQuart, state: SluiceState, hooks: RequestHooks) -> None:
    endpoint_here = endpoint_finder(hooks.passthrough)
    cors = hooks.cors

    @app.before_request
    async def begin_request() -> None:
        # First of the before_request hooks, so that a refusal by any later one (a 401) has
        # its request id and access line too.
        pipeline, access = hooks.begin(
            request.method, request.path, request.remote_addr or "-", request.headers
        )
        request.sluice_pipeline = pipeline  # type: ignore[attr-defined]
        request.sluice_access = access  # type: ignore[attr-defined]

    @app.after_request
    async def end_request(response: Response) -> Response:
        # Runs for every response, refusals included (Quart finalizes error-handler responses
        # too); asgi.py sends response.headers (plus the relay's own) when a relay's head is
        # ready.
        access: AccessRecord | None = getattr(request, "sluice_access", None)
        if access is None:
            return response
        for name, value in hooks.response_headers(access, request.headers.get("Origin")):
            if name == "Vary":
                response.vary.add(value)
            else:
                response.headers[name] = value
        if not isinstance(response.response, RelayBody):
            pipeline = request.sluice_pipeline  # type: ignore[attr-defined]
            model = getattr(request, "sluice_model", "-")
            hooks.answered(pipeline, access, response.status_code, model, endpoint_here())
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
        if hooks.needs_key(request.path):
            access: AccessRecord = request.sluice_access  # type: ignore[attr-defined]
            pipeline = request.sluice_pipeline  # type: ignore[attr-defined]
            request.sluice_key = hooks.identify(pipeline, request.headers, access)  # type: ignore[attr-defined]
        return None
