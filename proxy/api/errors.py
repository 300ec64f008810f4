"""The app's error handlers: every refusal and failure answered in the error shape of the API
the request speaks (Anthropic's on /v1/messages, OpenAI's elsewhere), with its access line's
outcome."""

from __future__ import annotations

import logging

from quart import Response, request
from werkzeug.exceptions import HTTPException

from proxy.api.routes import endpoint_finder, json_response, passthrough_paths
from proxy.api.state import SluiceState
from proxy.ops.logs import AccessRecord
from proxy.protocol.errors import ApiError, internal_error, request_too_large
from proxy.protocol.shapes import ErrorShape, error_shape
from proxy.server.asgi import SluiceQuart

log = logging.getLogger("sluice.app")


def refused(error: ApiError) -> None:
    """What every refusal does besides answering: the access line's outcome and, for a
    completion request, the requests metric (through the pipeline, in end_request)."""
    note_refusal(getattr(request, "sluice_access", None), error)


def note_refusal(access: AccessRecord | None, error: ApiError) -> None:
    if access is not None:
        access.outcome = error.code or "error"


def unexpected(error: BaseException) -> ApiError:
    """What a failure nobody foresaw is answered with, once it is logged."""
    log.exception("unhandled error", exc_info=error)
    return internal_error()


def register_error_handlers(app: SluiceQuart, state: SluiceState) -> None:
    max_body_bytes = state.config.server.max_body_bytes
    passthrough = passthrough_paths(state.config)
    endpoint_here = endpoint_finder(passthrough)

    def shape() -> ErrorShape:
        """The error shape of the API this request speaks (Anthropic's on /v1/messages)."""
        return error_shape(endpoint_here())

    @app.errorhandler(ApiError)
    async def api_error(error: ApiError) -> Response:
        refused(error)
        return json_response(shape().body(error), error.status, error.headers)

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response:
        status = error.code or 500
        headers: dict[str, str] = {}
        if status == 413:
            api = request_too_large(max_body_bytes)
        elif status == 404:
            api = not_found(passthrough)
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
        return json_response(shape().body(api), status, headers)

    @app.errorhandler(Exception)
    async def unexpected_error(error: Exception) -> Response:
        api = unexpected(error)
        refused(api)
        return json_response(shape().body(api), api.status)


def not_found(passthrough: frozenset[str]) -> ApiError:
    """The 404 of a path nothing serves, listing what is served."""
    return ApiError(
        404,
        f"No such path: {request.path}. Sluice serves POST /v1/chat/completions, "
        "/v1/completions, /v1/responses, /v1/messages and /v1/embeddings, GET "
        "/v1/models, WebSocket /v1/ws"
        + (f", and the pass-through paths {', '.join(sorted(passthrough))}" if passthrough else "")
        + ".",
        code="not_found",
    )
