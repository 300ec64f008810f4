"""The chat page: one HTML page, one script, one stylesheet, served from the package.

``GET /`` is the page; ``GET /static/app.js`` and ``GET /static/style.css`` are its assets, and
``GET /static/vendor/…`` the two libraries it renders answers with (marked and DOMPurify, fetched
from the npm registry by ``scripts/vendor_js.py``; their licences lie beside them). The page
talks to the proxy's own API (``/healthz``, ``/v1/models``, streamed ``/v1/chat/completions``)
like any other client: nothing here touches a backend.

Each asset has its own fully static URL rule rather than Quart's ``static_folder`` machinery:
the app object is created with Quart's default static folder (``<cwd>/static`` at
``/static/<path:filename>``), and a fully static rule wins over that converter rule whichever
was registered first. It also means exactly these files are served, never a directory.

The files are read once, on first use (through ``importlib.resources``, so an installed wheel
serves them too), and answered from memory with an ``ETag``. Every response carries a
Content-Security-Policy that allows nothing but this origin: the page loads no external
resource, and a script injected into an answer could not send it anywhere.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from importlib import resources

from quart import Blueprint, Response, request

__all__ = ["ASSETS", "CONTENT_SECURITY_POLICY", "blueprint"]

_JS = "text/javascript; charset=utf-8"

# URL path -> (file under proxy/api/static/, content type).
ASSETS: dict[str, tuple[str, str]] = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", _JS),
    "/static/style.css": ("style.css", "text/css; charset=utf-8"),
    "/static/vendor/marked.umd.js": ("vendor/marked.umd.js", _JS),
    "/static/vendor/purify.min.js": ("vendor/purify.min.js", _JS),
}

CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "connect-src 'self'",
        "img-src 'self' data:",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)

blueprint = Blueprint("web", __name__)


@dataclass(frozen=True)
class _Asset:
    body: bytes
    content_type: str
    etag: str


@cache
def _asset(name: str, content_type: str) -> _Asset:
    body = resources.files("proxy.api").joinpath("static", *name.split("/")).read_bytes()
    etag = '"' + hashlib.sha256(body).hexdigest()[:20] + '"'
    return _Asset(body, content_type, etag)


def _serve(path: str) -> Response:
    name, content_type = ASSETS[path]
    asset = _asset(name, content_type)
    headers = {
        "ETag": asset.etag,
        # Revalidated on every load (a 304 costs one round trip): a new version of the proxy
        # never runs with a stale script.
        "Cache-Control": "no-cache",
        "Content-Security-Policy": CONTENT_SECURITY_POLICY,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }
    if asset.etag in request.headers.get("If-None-Match", ""):
        return Response(b"", status=304, headers=headers)
    return Response(asset.body, content_type=content_type, headers=headers)


def _register(path: str) -> None:
    async def view() -> Response:
        return _serve(path)

    endpoint = ASSETS[path][0].replace(".", "_").replace("/", "_")
    blueprint.add_url_rule(path, endpoint, view, methods=["GET"])


for _path in ASSETS:
    _register(_path)
