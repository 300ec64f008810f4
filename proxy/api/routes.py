"""The app's routes. The API's (the completion endpoints, the models' pass-through paths, the
WebSocket) hand what they read to the one responder (responder.py); the others read the state:
/v1/models, /metrics, /readyz and /healthz."""

from __future__ import annotations

import json
import os
from typing import Any

from quart import Response, request, websocket
from werkzeug.datastructures import Headers
from werkzeug.exceptions import HTTPException, NotFound

from proxy.api.errors import http_error
from proxy.api.responder import WS_PATH, Responder
from proxy.api.state import SluiceState
from proxy.api.ws import serve_websocket
from proxy.protocol.errors import model_not_found
from proxy.protocol.openai import NATIVE_ENDPOINTS, models_list
from proxy.relay.body import JSON_CONTENT_TYPE, RelayBody
from proxy.server.asgi import SluiceQuart
from proxy.server.call import Answer, Call


def json_response(payload: bytes, status: int) -> Response:
    return Response(payload, status=status, content_type=JSON_CONTENT_TYPE)


def register_routes(app: SluiceQuart, state: SluiceState, responder: Responder) -> None:
    register_api(app, responder)
    register_info(app, state)


async def _read_body(responder: Responder) -> bytes:
    """The current request's body, within the server's bound; what Quart raises while reading
    it (a body too big, or too slow to come) as the API's error."""
    try:
        raw = await request.get_data(cache=False)
    except HTTPException as error:
        raise http_error(error, responder.max_body_bytes, responder.passthrough) from None
    assert isinstance(raw, bytes)
    return raw


def quart_response(answer: Answer) -> Response:
    # Headers given whole, so that Quart adds no content type of its own.
    response = Response(answer.body, status=answer.status, headers=Headers(answer.headers))
    if isinstance(answer.body, RelayBody):
        # Quart's RESPONSE_TIMEOUT (60 s) would silently truncate a long stream; the relay's
        # own deadlines (upstream total, client stall) bound it instead.
        response.timeout = None
    return response


def register_api(app: SluiceQuart, responder: Responder) -> None:
    """The API's routes, all answered by the responder: the native endpoints, the
    pass-through paths and the WebSocket."""

    async def answer() -> Response:
        headers = request.headers
        call = Call(
            request.method,
            request.path,
            headers,
            request.remote_addr or "-",
            read_body=lambda: _read_body(responder),
            request_id=headers.get("X-Request-ID"),
        )
        return quart_response(await responder.respond(call))

    for endpoint in NATIVE_ENDPOINTS:
        app.add_url_rule(endpoint.value, f"api {endpoint.value}", answer, methods=["POST"])
    for path in sorted(responder.passthrough):
        # One route per configured path: anything else is the app's 404, in OpenAI's shape.
        app.add_url_rule(path, f"passthrough {path}", answer, methods=["POST"])

    @app.websocket(WS_PATH)
    async def chat_websocket() -> None:
        await serve_websocket(responder, websocket)


def register_info(app: SluiceQuart, state: SluiceState) -> None:
    """What the process says of itself: its models, its metrics, its readiness and health."""

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        served = state.current  # the config a reload last applied
        return models_list([model.name for model in served.config.models], served.catalog.entries)

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> dict[str, Any]:
        # Model names may hold slashes ("HuggingFaceTB/SmolLM2-135M-Instruct"): a path.
        served = state.current
        if served.config.model(model_id) is None:
            raise model_not_found(model_id)
        listed: dict[str, Any] = models_list([model_id], served.catalog.entries)["data"][0]
        return listed

    @app.get("/metrics")
    async def metrics() -> Response:
        payload, content_type = state.metrics.render(request.headers.get("Accept", ""))
        return Response(payload, content_type=content_type)

    @app.get("/readyz")
    async def readyz() -> Response:
        # Load balancers stop sending here as soon as a drain begins, while /healthz (the
        # process is alive) stays green until the in-flight streams are done.
        ready = state.ready
        payload = json.dumps({"ready": ready, "draining": state.draining}).encode()
        return json_response(payload, 200 if ready else 503)

    @app.get("/.well-known/oauth-protected-resource")
    async def protected_resource() -> Response:
        # RFC 9728: who may sign this server's bearer tokens; only with [[auth.jwt]] issuers.
        auth = state.current.config.auth
        if not auth.jwt:
            raise NotFound()
        origin = f"{request.scheme}://{request.host}"
        payload = {
            "resource": auth.resource or origin,
            "authorization_servers": [issuer.issuer for issuer in auth.jwt],
            "bearer_methods_supported": ["header"],
        }
        return json_response(json.dumps(payload).encode(), 200)

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
