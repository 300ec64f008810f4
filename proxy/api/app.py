"""The app factory: the per-process state, and what it registers on the app (the chat page, the
routes, the error handlers, the hooks, and the backends' start-up and close)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from proxy.api import web
from proxy.api.errors import register_error_handlers
from proxy.api.hooks import register_hooks
from proxy.api.responder import Responder
from proxy.api.routes import register_routes
from proxy.api.state import SluiceState
from proxy.config import Config
from proxy.server.asgi import SluiceQuart


def create_app(
    config: Config,
    env: Mapping[str, str] | None = None,
    *,
    local_models: Mapping[str, Any] | None = None,
    fake_upstream_url: str | None = None,
) -> SluiceQuart:
    """The app. ``local_models`` maps model names to preloaded ``inference.LoadedModel``s;
    local models not given are loaded when the server starts. ``fake_upstream_url`` is where
    the fake upstream that the models' ``fake:`` upstreams name listens: the app never starts
    it (it is tooling); ``sluice serve`` does, beside the app, when [fake_upstream] is on."""
    state = SluiceState(config, os.environ if env is None else env, local_models, fake_upstream_url)
    # static_folder=None: Quart would otherwise serve ./static from the working directory.
    # The chat page's files come from the package, through the web blueprint.
    app = SluiceQuart("sluice", static_folder=None)
    app.register_blueprint(web.blueprint)
    app.config["MAX_CONTENT_LENGTH"] = config.server.max_body_bytes
    app.extensions["sluice"] = state

    @app.before_serving
    async def start() -> None:
        await state.start(app.nursery)

    @app.after_serving
    async def stop() -> None:
        await state.aclose()

    # The one way in: Quart's API routes, the WebSocket and the fast path all call it.
    responder = Responder(state)
    app.responder = responder
    register_error_handlers(
        app, config.server.max_body_bytes, responder.passthrough, responder.endpoint_of
    )
    register_hooks(app, responder)
    register_routes(app, state, responder)
    return app
