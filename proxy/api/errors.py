"""The app's error handlers, for the routes Quart answers itself (the API's answers, refusals
included, are the responder's): every refusal and failure in the error shape of the API the
request's path speaks (Anthropic's on /v1/messages, OpenAI's elsewhere), with its access
line's outcome."""

from __future__ import annotations

import logging
from collections.abc import Callable

from quart import Response, request
from werkzeug.exceptions import HTTPException

from proxy.ops.logs import AccessRecord
from proxy.protocol.errors import ApiError, internal_error, request_too_large
from proxy.protocol.openai import Endpoint
from proxy.protocol.shapes import error_shape
from proxy.relay.body import JSON_CONTENT_TYPE
from proxy.server.asgi import SluiceQuart

log = logging.getLogger("sluice.app")


def note_refusal(access: AccessRecord | None, error: ApiError) -> None:
    """What every refusal does besides answering: the access line's outcome."""
    if access is not None:
        access.outcome = error.code or "error"


def unexpected(error: BaseException) -> ApiError:
    """What a failure nobody foresaw is answered with, once it is logged."""
    log.exception("unhandled error", exc_info=error)
    return internal_error()


def http_error(error: HTTPException, max_body_bytes: int, passthrough: frozenset[str]) -> ApiError:
    """What Quart (or werkzeug) raised for the current request, as the API's error: a body too
    big (413) or too slow (408) while the body is read, no route (404), the wrong method
    (405)."""
    status = error.code or 500
    if status == 413:
        return request_too_large(max_body_bytes)
    if status == 404:
        return not_found(passthrough)
    if status == 405:
        allowed = sorted(getattr(error, "valid_methods", None) or ())
        return ApiError(
            405,
            f"{request.method} is not allowed on {request.path}"
            + (f"; use {' or '.join(allowed)}" if allowed else ""),
            code="method_not_allowed",
            headers={"Allow": ", ".join(allowed)},
        )
    return ApiError(
        status,
        f"{error.name}: {error.description}",
        code=error.name.lower().replace(" ", "_"),
    )


def register_error_handlers(
    app: SluiceQuart,
    max_body_bytes: int,
    passthrough: frozenset[str],
    endpoint_of: Callable[[str], Endpoint | None],
) -> None:
    def answer(error: ApiError) -> Response:
        note_refusal(getattr(request, "sluice_access", None), error)
        # The error shape of the API this request's path speaks.
        body = error_shape(endpoint_of(request.path)).body(error)
        response = Response(body, status=error.status, content_type=JSON_CONTENT_TYPE)
        for name, value in (error.headers or {}).items():
            response.headers[name] = value
        return response

    @app.errorhandler(ApiError)
    async def api_error(error: ApiError) -> Response:
        return answer(error)

    @app.errorhandler(HTTPException)
    async def werkzeug_error(error: HTTPException) -> Response:
        return answer(http_error(error, max_body_bytes, passthrough))

    @app.errorhandler(Exception)
    async def unexpected_error(error: Exception) -> Response:
        return answer(unexpected(error))


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
