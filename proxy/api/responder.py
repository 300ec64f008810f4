"""The one way in: :meth:`Responder.respond` is the only way a completion, Responses, Messages,
embeddings or pass-through request is answered, whichever entry read it: the fast path
(``server/fast_path.py``), Quart's routes (``routes.py``: chunked bodies, ``Expect``, HTTP/2 and
whatever else the fast path hands over), or the WebSocket (``ws.py``, one call per message).

The order of the request pipeline's steps (``pipeline.py``) is written here, once:

1. ``begin``: the request id, the access record, the trace;
2. ``authenticate``: the client's key, before the body is read, so an unauthenticated client
   costs no reading (of a body the server has not read yet) and no parsing;
3. the body, read (within ``max_body_bytes``) and ``parse``d, with one set of errors, then
   ``screen``ed by the ``request`` stage's guards (which may refuse it or edit it);
4. ``relay``: the RelayBody that runs the request (its band, checked and decided first; its
   key's limits, the backend's admission, the stall limit, the lifetime, metrics, drain
   tracking, the access line at its close);
5. or, for a request refused before a relay exists, ``refused``: the same metric and the same
   access line, and the refusal in the endpoint's own error shape;
6. either way, the answer's own headers (the request id, the trace, CORS, and the band once
   one was decided).

The Quart hooks (``hooks.py``) use the same pieces for the routes that are not the API's.
"""

from __future__ import annotations

from collections.abc import Mapping

from proxy.api.auth import CORS_EXPOSED_HEADERS, CorsPolicy
from proxy.api.errors import note_refusal, unexpected
from proxy.api.pipeline import RequestPipeline
from proxy.api.state import SluiceState
from proxy.config import Config, KeyConfig
from proxy.ops.logs import AccessRecord
from proxy.protocol.errors import ApiError
from proxy.protocol.openai import NATIVE_ENDPOINTS, Endpoint
from proxy.protocol.request_priority import PRIORITY_HEADER
from proxy.protocol.shapes import endpoint_of, error_shape
from proxy.relay.body import JSON_CONTENT_TYPE
from proxy.server.call import Answer, Call, HeaderLookup

# Chat over a WebSocket: each message is a chat request (ws.py).
WS_PATH = "/v1/ws"
WS_METHOD = "WS"


def passthrough_paths(config: Config) -> frozenset[str]:
    """Every path that the pipeline serves besides the native endpoints: the models'
    pass-through paths."""
    return frozenset(
        path for model in config.models if model.backend == "upstream" for path in model.passthrough
    )


class Responder:
    """The app's one way in (``server.call.Responder``), shared by every request of the
    process: each takes the pipeline a reload last installed (``state.pipeline``) and keeps it
    (a reload meanwhile changes nothing of a request in flight)."""

    def __init__(self, state: SluiceState) -> None:
        self.state = state
        config = state.config
        self.passthrough = passthrough_paths(config)
        self.cors = CorsPolicy(config.server.cors_origins)
        self.max_body_bytes = config.server.max_body_bytes
        endpoints: dict[str, Endpoint] = {endpoint.value: endpoint for endpoint in NATIVE_ENDPOINTS}
        for path in self.passthrough:
            endpoints.setdefault(path, Endpoint.PASSTHROUGH)
        self._endpoints: Mapping[str, Endpoint] = endpoints

    def serves(self, method: str, path: str) -> bool:
        """The API's POST routes: the native endpoints and the models' pass-through paths."""
        return method == "POST" and path in self._endpoints

    def endpoint_of(self, path: str) -> Endpoint | None:
        """The endpoint ``path`` speaks (None off the API), for its error shape and its metric's
        label."""
        if path in self.passthrough:
            return Endpoint.PASSTHROUGH
        return endpoint_of(path)

    def needs_key(self, path: str) -> bool:
        """Only the API needs a key: /healthz and /metrics stay open to probes and scrapers."""
        return path.startswith("/v1/") or path in self.passthrough

    async def respond(self, call: Call) -> Answer:
        """The answer to ``call``: its relay (not yet entered: the writer runs it), or its
        refusal. Never raises but for cancellation: a failure nobody foresaw is its 500."""
        websocket = call.path == WS_PATH
        endpoint = Endpoint.CHAT if websocket else self._endpoints[call.path]
        pipeline, access = self.begin(call)
        # The answer's own headers are made once the pipeline has run, whichever way it ended,
        # so that they can say what it decided (the band).
        origin = call.headers.get("Origin")
        # The model a refusal's line and metric name: a configured one the body asked for, once
        # it is parsed (a request guard's refusal, a limit's), else "-".
        model = "-"
        try:
            key = await self.identify(pipeline, call.headers, access, call.method, call.path)
            raw = call.body
            if raw is None:
                assert call.read_body is not None, "a Call brings its body or its reader"
                raw = await call.read_body()
            content_type = call.headers.get("Content-Type")
            request = pipeline.parse(
                raw,
                endpoint,
                path=call.path,
                content_type="application/json" if content_type is None else content_type,
                headers=call.headers,
                message=websocket,
            )
            if pipeline.config.model(request.model) is not None:
                model = request.model
            request = await pipeline.screen(request, access, key)
            body = pipeline.relay(request, access, key, call.headers)
        except ApiError as error:
            refusal = error
        except Exception as error:  # noqa: BLE001 - the boundary of one request: its 500
            refusal = unexpected(error)
        else:
            return Answer(200, self.response_headers(access, origin), body, access=access)
        return self._refusal(
            pipeline, access, endpoint, refusal, self.response_headers(access, origin), model
        )

    def refuse(self, call: Call, error: ApiError) -> Answer:
        """A request refused by its transport before it reaches the pipeline (a second
        WebSocket message while one generates): a request of its own all the same, with its id,
        access line, metric and span."""
        pipeline, access = self.begin(call)
        endpoint = self.endpoint_of(call.path) or Endpoint.CHAT
        return self._refusal(pipeline, access, endpoint, error, [])

    async def authenticate_session(self, call: Call) -> tuple[AccessRecord, ApiError | None]:
        """A WebSocket's handshake: its record, and its refusal (counted and logged as one) if
        its credentials are refused. Each message is authenticated again, as its own request."""
        pipeline = self.state.pipeline
        # No trace of its own: each message's span is the handshake's traceparent's child.
        access = pipeline.begin(call.method, call.path, call.client, None)
        try:
            await self.identify(pipeline, call.headers, access, call.method, call.path)
        except ApiError as error:
            pipeline.refused(access, error.status, error.code or "error", "-")
            return access, error
        return access, None

    @staticmethod
    async def identify(
        pipeline: RequestPipeline,
        headers: HeaderLookup,
        access: AccessRecord,
        method: str = "POST",
        path: str = "",
    ) -> KeyConfig | None:
        """The client's key (None with no keys configured), or the 401 ApiError (403, 503:
        api/identity.py): before the body is read, so an unauthenticated client costs no
        parsing. The routes that are not the API's but need a key (/v1/models) take the same
        step."""
        return await pipeline.authenticate(headers, access, method, path)

    def begin(self, call: Call) -> tuple[RequestPipeline, AccessRecord]:
        """The pipeline the request keeps, and its access record, which every refusal after
        this has."""
        pipeline = self.state.pipeline
        access = pipeline.begin(call.method, call.path, call.client, call.request_id, call.headers)
        return pipeline, access

    def response_headers(self, access: AccessRecord, origin: str | None) -> list[tuple[str, str]]:
        """The headers every answer carries, a relayed stream's included: its request id, its
        trace (W3C Trace Context Level 2: the trace and this server span it is of), CORS; and,
        for a request that was scheduled, its band (``x-sluice-priority``), so that a client
        sees the band it was served in, which is its key's when it asked for a more urgent one
        (refusals after scheduling, such as its key's 429, say it too)."""
        headers = [("X-Request-ID", access.request_id)]
        if access.band is not None:
            headers.append((PRIORITY_HEADER, str(access.band)))
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

    def _refusal(
        self,
        pipeline: RequestPipeline,
        access: AccessRecord,
        endpoint: Endpoint,
        refusal: ApiError,
        headers: list[tuple[str, str]],
        model: str = "-",
    ) -> Answer:
        note_refusal(access, refusal)
        # A refused request's metric and line name a configured model or say "-": a client
        # must not be able to grow the metrics by inventing model names.
        self.answered(pipeline, access, refusal.status, model, endpoint)
        headers.append(("Content-Type", JSON_CONTENT_TYPE))
        headers.extend((refusal.headers or {}).items())
        body = error_shape(endpoint).body(refusal)
        return Answer(refusal.status, headers, body, error=refusal, access=access)
