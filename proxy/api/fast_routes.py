"""The completion endpoints as the fast path serves them (proxy/server/fast_path.py): the same
hooks (hooks.RequestHooks), the same route (routes.start_relay, then the pipeline) and the same
error answers as under Quart, called in the same order, for a request the fast path has read.

Quart's own work around them (its request and app contexts, its routing, its hook and signal
dispatch) is what the fast path saves; nothing a client sees or a contract needs is in it."""

from __future__ import annotations

from proxy.api.errors import note_refusal, unexpected
from proxy.api.hooks import RequestHooks
from proxy.api.routes import json_response_headers, start_relay
from proxy.protocol.errors import ApiError
from proxy.protocol.openai import Endpoint
from proxy.protocol.shapes import endpoint_of, error_shape
from proxy.server.fast_path import PlainRequest, PlainResponse

_NATIVE = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/embeddings",
)


class FastRoutes:
    """The POST routes the fast path serves: the native completion endpoints and the models'
    pass-through paths (the routes registered by routes.register_completions)."""

    def __init__(self, hooks: RequestHooks) -> None:
        self.hooks = hooks
        self.max_body_bytes = hooks.state.config.server.max_body_bytes
        endpoints: dict[str, Endpoint] = {}
        for path in _NATIVE:
            endpoint = endpoint_of(path)
            assert endpoint is not None
            endpoints[path] = endpoint
        for path in hooks.passthrough:
            endpoints.setdefault(path, Endpoint.PASSTHROUGH)
        self._endpoints = endpoints

    def serves(self, method: bytes, path: str) -> bool:
        return method == b"POST" and path in self._endpoints

    def respond(self, request: PlainRequest) -> PlainResponse:
        hooks = self.hooks
        path = request.head.path
        endpoint = self._endpoints[path]
        headers = request.headers
        pipeline, access = hooks.begin("POST", path, request.client, headers)
        answer_headers = [
            (name.lower().encode(), value.encode())
            for name, value in hooks.response_headers(access, headers.get("Origin"))
        ]
        try:
            key = hooks.identify(pipeline, headers, access)
            body, _ = start_relay(pipeline, access, key, request.body, endpoint, path, headers)
        except ApiError as error:
            refusal = error
        except Exception as error:  # noqa: BLE001 - answered as Quart's handler answers it
            refusal = unexpected(error)
        else:
            return PlainResponse(200, answer_headers, body)
        note_refusal(access, refusal)
        # A refused request's metric and line say "-" for its model, as Quart's do: a client
        # must not be able to grow the metrics by inventing model names.
        hooks.answered(pipeline, access, refusal.status, "-", endpoint)
        answer_headers += json_response_headers(refusal.headers)
        return PlainResponse(refusal.status, answer_headers, error_shape(endpoint).body(refusal))
