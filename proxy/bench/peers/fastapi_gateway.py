"""The FastAPI peer: the common "optimized" Python gateway, FastAPI and httpx on uvicorn with
uvloop and httptools, run by the benches from its own venv (``.peers/fastapi``), not from the
project's (``uvicorn fastapi_gateway:app --app-dir`` this folder).

It relays each OpenAI-compatible endpoint the fake upstream serves (chat, completions,
responses, messages, embeddings) and ``/v1/models`` and ``/health`` to ``$UPSTREAM``. A
stream's upstream bytes go out as they come (no re-framing), behind anti-buffering headers,
with the usual client-disconnect check before each chunk; a tuned httpx pool and timeouts.
A non-streamed request is relayed whole. Standalone on purpose: nothing of ``proxy`` is
importable from its venv.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

UPSTREAM = os.environ.get("UPSTREAM", "http://127.0.0.1:9000")
RELAYED = ("chat/completions", "completions", "responses", "messages", "embeddings")
# What the upstream needs of the client's headers (its key, Anthropic's version header).
FORWARDED = ("authorization", "x-api-key", "anthropic-version", "anthropic-beta")


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    app.state.client = httpx.AsyncClient(
        base_url=UPSTREAM,
        limits=httpx.Limits(
            max_connections=2000, max_keepalive_connections=500, keepalive_expiry=30.0
        ),
        timeout=httpx.Timeout(connect=5.0, read=600.0, write=10.0, pool=5.0),
    )
    yield
    await app.state.client.aclose()


app = FastAPI(lifespan=lifespan)


def _headers(request: Request) -> dict[str, str]:
    return {name: request.headers[name] for name in FORWARDED if name in request.headers}


async def _relay_stream(
    path: str, payload: dict[str, Any], request: Request
) -> AsyncIterator[bytes]:
    client: httpx.AsyncClient = app.state.client
    try:
        async with client.stream(
            "POST", f"/v1/{path}", json=payload, headers=_headers(request)
        ) as upstream:
            if upstream.status_code != 200:
                await upstream.aread()
                yield b'data: {"error": "upstream"}\n\n'
                return
            async for chunk in upstream.aiter_raw():
                if await request.is_disconnected():
                    break
                yield chunk
                await asyncio.sleep(0)
    except httpx.ReadTimeout:
        yield b'data: {"error": "timeout"}\n\n'


async def _relay(path: str, payload: dict[str, Any], request: Request) -> Response:
    if not payload.get("stream"):
        client: httpx.AsyncClient = app.state.client
        upstream = await client.post(f"/v1/{path}", json=payload, headers=_headers(request))
        content_type = upstream.headers.get("content-type", "application/json")
        return Response(upstream.content, upstream.status_code, media_type=content_type)
    # The head goes out at once, as in the usual gateway: the upstream's status is not waited
    # for, and a failing upstream reads as an error event.
    return StreamingResponse(
        _relay_stream(path, payload, request),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _route(path: str) -> None:
    async def relay(payload: dict[str, Any], request: Request) -> Response:
        return await _relay(path, payload, request)

    app.post(f"/v1/{path}", name=path)(relay)


for _path in RELAYED:
    _route(_path)


@app.get("/v1/models")
async def models() -> Response:
    upstream = await app.state.client.get("/v1/models")
    return JSONResponse(upstream.json(), status_code=upstream.status_code)


@app.get("/health")
async def health() -> Response:
    upstream = await app.state.client.get("/health")
    return Response(status_code=upstream.status_code)
