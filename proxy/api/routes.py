"""The app's routes: each parses what it is sent, hands it to the pipeline (or reads the
state), and shapes the answer. The completion endpoints, the models' pass-through paths,
/v1/models, /metrics, the WebSocket /v1/ws, /readyz and /healthz."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from quart import Response, request

from proxy.api.pipeline import HeaderLookup, RequestPipeline
from proxy.api.state import SluiceState
from proxy.api.ws import serve_websocket
from proxy.config import Config, KeyConfig
from proxy.ops.logs import AccessRecord
from proxy.protocol.errors import model_not_found
from proxy.protocol.openai import Endpoint, models_list
from proxy.protocol.shapes import endpoint_of
from proxy.relay.body import JSON_CONTENT_TYPE, RelayBody
from proxy.server.asgi import SluiceQuart


def passthrough_paths(config: Config) -> frozenset[str]:
    """Every path that the pipeline serves besides the native endpoints: the models'
    pass-through paths."""
    return frozenset(
        path for model in config.models if model.backend == "upstream" for path in model.passthrough
    )


def endpoint_finder(passthrough: frozenset[str]) -> Callable[[], Endpoint | None]:
    """The endpoint the current request speaks (None off the API), for its error shape and
    its metric's label."""

    def endpoint_here() -> Endpoint | None:
        if request.path in passthrough:
            return Endpoint.PASSTHROUGH
        return endpoint_of(request.path)

    return endpoint_here


def json_response(
    payload: bytes, status: int, headers: Mapping[str, str] | None = None
) -> Response:
    response = Response(payload, status=status, content_type=JSON_CONTENT_TYPE)
    for name, value in (headers or {}).items():
        response.headers[name] = value
    return response


def start_relay(
    pipeline: RequestPipeline,
    access: AccessRecord,
    key: KeyConfig | None,
    raw: bytes,
    endpoint: Endpoint,
    path: str,
    headers: HeaderLookup,
) -> tuple[RelayBody, str]:
    """A completion request's relay and its model: the body parsed, then the relay made by the
    pipeline (not yet entered). Raises the ApiError of a request it refuses, model_not_found
    for a model not configured included (before anything is labelled with its name)."""
    content_type = headers.get("Content-Type")
    parsed = pipeline.parse(
        raw,
        endpoint,
        path=path,
        content_type="application/json" if content_type is None else content_type,
        headers=headers,
    )
    return pipeline.relay(parsed, access, key), parsed.model


def json_response_headers(headers: Mapping[str, str] | None) -> list[tuple[bytes, bytes]]:
    """The headers of a JSON answer the fast path writes (json_response's, for Quart)."""
    pairs = [(b"content-type", JSON_CONTENT_TYPE.encode())]
    pairs.extend((name.lower().encode(), value.encode()) for name, value in (headers or {}).items())
    return pairs


def register_routes(app: SluiceQuart, state: SluiceState) -> None:
    register_completions(app, state)
    register_info(app, state)


def register_completions(app: SluiceQuart, state: SluiceState) -> None:
    """The endpoints served through the pipeline: the native ones, the pass-through paths and
    the WebSocket."""

    async def completions(endpoint: Endpoint) -> Response:
        raw = await request.get_data(cache=False)
        assert isinstance(raw, bytes)
        body, model = start_relay(
            request.sluice_pipeline,  # type: ignore[attr-defined]
            request.sluice_access,  # type: ignore[attr-defined]
            getattr(request, "sluice_key", None),
            raw,
            endpoint,
            request.path,
            request.headers,
        )
        request.sluice_model = model  # type: ignore[attr-defined]
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

    for path in sorted(passthrough_paths(state.config)):
        # One route per configured path: anything else is the app's 404, in OpenAI's shape.
        app.add_url_rule(
            path,
            f"passthrough {path}",
            partial(completions, Endpoint.PASSTHROUGH),
            methods=["POST"],
        )

    @app.websocket("/v1/ws")
    async def chat_websocket() -> None:
        await serve_websocket(lambda: state.pipeline)


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
