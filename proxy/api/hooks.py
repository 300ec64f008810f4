"""The hooks of the routes Quart answers itself (the chat page, /v1/models, /metrics, /readyz,
/healthz, and every 404, 405 and preflight): their request id and access record (begun before,
ended after the response), the client's key where the API needs one, and CORS. They use the
responder's pieces (responder.py), in the responder's order; the API's own routes are answered
by the responder whole, so these hooks leave them alone."""

from __future__ import annotations

from quart import Response, request

from proxy.api.responder import Responder
from proxy.ops.logs import AccessRecord
from proxy.server.asgi import SluiceQuart
from proxy.server.call import Call


def register_hooks(app: SluiceQuart, responder: Responder) -> None:
    cors = responder.cors

    @app.before_request
    async def begin_request() -> Response | None:
        if responder.serves(request.method, request.path):
            return None  # the responder's, from its beginning
        headers = request.headers
        call = Call(
            request.method,
            request.path,
            headers,
            request.remote_addr or "-",
            request_id=headers.get("X-Request-ID"),
        )
        pipeline, access = responder.begin(call)
        request.sluice_pipeline = pipeline  # type: ignore[attr-defined]
        request.sluice_access = access  # type: ignore[attr-defined]
        if request.method == "OPTIONS":
            # Browsers send preflights without credentials, so they are answered unauthenticated
            # (they reveal nothing and start no work); other OPTIONS get Quart's Allow answer.
            preflight = headers.get("Access-Control-Request-Method")
            if preflight and cors.allow_origin(headers.get("Origin")):
                requested = headers.get("Access-Control-Request-Headers")
                return Response("", status=204, headers=cors.preflight_headers(requested))
            return None
        if responder.needs_key(request.path):
            # Raises the 401 (answered by the error handlers, with this access record).
            await responder.identify(pipeline, headers, access, request.method, request.path)
        return None

    @app.after_request
    async def end_request(response: Response) -> Response:
        # Runs for every response of these routes, refusals included (Quart finalizes
        # error-handler responses too).
        access: AccessRecord | None = getattr(request, "sluice_access", None)
        if access is None:
            return response
        for name, value in responder.response_headers(access, request.headers.get("Origin")):
            if name == "Vary":
                response.vary.add(value)
            else:
                response.headers[name] = value
        pipeline = request.sluice_pipeline  # type: ignore[attr-defined]
        responder.answered(
            pipeline, access, response.status_code, "-", responder.endpoint_of(request.path)
        )
        return response
