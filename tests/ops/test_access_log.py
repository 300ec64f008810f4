"""The access log: exactly one JSON line per request, written when the request ends."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator
from datetime import datetime
from functools import partial
from typing import Any

import httpx
import pytest
import trio

from proxy.api.auth import hash_key
from proxy.ops.logs import ACCESS_LOGGER, AccessRecord, configure_access_log
from tests.ops.test_metrics import closed_port
from tests.support import (
    DEADLINE,
    Fake,
    Proxy,
    cancel_while_waiting_then_mid_stream,
    chat_body,
    sse_payloads,
    start_proxy,
)

CHAT = "/v1/chat/completions"
FIELDS = {
    "timestamp",
    "request_id",
    "method",
    "path",
    "model",
    "status",
    "duration_s",
    "ttft_s",
    "events",
    "outcome",
    "client",
    "key",
    # The request's trace (tracing on), else null: the line's fields are the same either way.
    "trace_id",
    # Its band in the scheduler (null: refused before it had one), its wait in Sluice's
    # queue, and the seconds to its earliest deadline (null: none).
    "band",
    "queue_wait_s",
    "deadline_s",
    # How many times it was paused for a more urgent request, and for how long in all.
    "pauses",
    "paused_s",
    # The [[guards]] table that refused it, and its reason (null: none did).
    "guard",
    "guard_reason",
    # A metered request's tokens (every request that generates), else null.
    "input_tokens",
    "output_tokens",
    "for_nobody_tokens",
    "input_estimated",
}


@pytest.fixture
def access(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        yield caplog


def lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """The access lines so far, each checked to be one complete JSON object."""
    found = []
    for record in caplog.records:
        if record.name != ACCESS_LOGGER:
            continue
        assert record.levelno == logging.INFO
        message = record.getMessage()
        assert "\n" not in message
        line = json.loads(message)
        assert set(line) == FIELDS
        found.append(line)
    return found


def only_line(caplog: pytest.LogCaptureFixture, **match: Any) -> dict[str, Any]:
    matching = [
        line for line in lines(caplog) if all(line[name] == want for name, want in match.items())
    ]
    assert len(matching) == 1, lines(caplog)
    return matching[0]


async def test_completed_stream(
    proxy: Proxy, fake: Fake, client: httpx.AsyncClient, access: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(DEADLINE):
        response = await client.post(
            proxy.url + CHAT, json=chat_body(), headers={"X-Request-ID": "trace-42.a:b"}
        )
        assert response.status_code == 200
        assert response.headers["x-request-id"] == "trace-42.a:b"
        # Passed upstream as it came.
        assert fake.recorder.last().headers["x-request-id"] == "trace-42.a:b"
        await proxy.state.tracker.wait_idle()
    line = only_line(access, request_id="trace-42.a:b")
    assert len(lines(access)) == 1
    events = sum(1 for payload in sse_payloads(response.text) if payload != "[DONE]")
    assert line["method"] == "POST"
    assert line["path"] == CHAT
    assert line["model"] == "fake-model"
    assert line["status"] == 200
    assert line["outcome"] == "completed"
    assert line["events"] == events >= 5
    assert line["client"] == "127.0.0.1"
    assert line["key"] is None
    assert 0 < line["ttft_s"] <= line["duration_s"] < DEADLINE
    assert datetime.fromisoformat(line["timestamp"]).tzinfo is not None


async def test_refusals_have_one_line_and_a_request_id(
    proxy: Proxy, fake: Fake, client: httpx.AsyncClient, access: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(DEADLINE):
        bad = await client.post(proxy.url + CHAT, content=b"{", headers={"X-Request-ID": "r1"})
        assert bad.status_code == 400
        assert bad.headers["x-request-id"] == "r1"
        unknown = await client.post(proxy.url + CHAT, json=chat_body("made-up"))
        assert unknown.status_code == 404
        # An id that does not match the accepted form is replaced, not echoed.
        odd = await client.post(
            proxy.url + CHAT, content=b"{", headers={"X-Request-ID": "no spaces allowed"}
        )
        assert odd.status_code == 400
    line = only_line(access, request_id="r1")
    assert (line["status"], line["outcome"], line["model"]) == (400, "invalid_json", "-")
    assert line["ttft_s"] is None and line["events"] == 0
    line = only_line(access, status=404)
    assert line["outcome"] == "model_not_found"
    assert line["model"] == "-"  # never the client's invented name
    assert line["request_id"] == unknown.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", odd.headers["x-request-id"])
    only_line(access, request_id=odd.headers["x-request-id"])
    assert len(lines(access)) == 3
    assert fake.recorder.records == []


async def test_cancelled_streams(
    proxy: Proxy, fake: Fake, client: httpx.AsyncClient, access: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(DEADLINE):
        await cancel_while_waiting_then_mid_stream(proxy, fake)
    assert len(lines(access)) == 2
    line = only_line(access, outcome="cancelled(first_token)")
    assert (line["status"], line["ttft_s"], line["events"]) == (499, None, 0)
    line = only_line(access, outcome="cancelled(mid_stream)")
    assert line["status"] == 200
    assert line["events"] >= 3
    assert line["ttft_s"] is not None
    assert line["model"] == "fake-model"


async def test_a_whole_answer_cut_before_it_came_is_all_for_nobody(
    proxy: Proxy, fake: Fake, client: httpx.AsyncClient, access: pytest.LogCaptureFixture
) -> None:
    """A whole answer whose client left while the upstream was at work on it: nothing says how
    much was made, so its reservation (its max_tokens) is its output, and none of it reached a
    client: the line's tokens for nobody are that output, as is the metric's count."""
    body = chat_body(stream=False, max_tokens=300, fake={"ttft": 30})
    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as posting:
            posting.start_soon(partial(client.post, proxy.url + CHAT, json=body))
            # The client leaves once the upstream has the request, however long that took.
            await fake.recorder.wait_for(lambda r: len(r.records) == 1)
            posting.cancel_scope.cancel()
        await proxy.state.tracker.wait_idle()
    line = only_line(access, status=499)
    assert line["outcome"].startswith("cancelled(")
    assert (line["output_tokens"], line["for_nobody_tokens"]) == (300, 300)
    metric = proxy.state.metrics.tokens_for_nobody.labels("-", "fake-model", "client_left")
    assert metric._value.get() == 300


async def test_upstream_failure_and_other_routes(
    nursery: trio.Nursery, client: httpx.AsyncClient, access: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(nursery, {"m": [f"http://127.0.0.1:{closed_port()}"]})
        failed = await client.post(proxy.url + CHAT, json=chat_body("m"))
        assert failed.status_code == 502
        assert failed.headers["x-request-id"]
        health = await client.get(proxy.url + "/healthz", headers={"X-Request-ID": "probe"})
        assert health.headers["x-request-id"] == "probe"
        await proxy.state.tracker.wait_idle()
    line = only_line(access, status=502)
    assert (line["model"], line["outcome"]) == ("m", "upstream_connect_error")
    assert line["request_id"] == failed.headers["x-request-id"]
    line = only_line(access, request_id="probe")
    assert (line["path"], line["status"], line["outcome"]) == ("/healthz", 200, "completed")


async def test_key_name_and_401(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient, access: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            keys=[{"name": "alice", "sha256": hash_key("sk-alice"), "max_concurrent_streams": 4}],
        )
        denied = await client.post(
            proxy.url + CHAT, json=chat_body(), headers={"X-Request-ID": "no-key"}
        )
        assert denied.status_code == 401
        assert denied.headers["x-request-id"] == "no-key"
        allowed = await client.post(
            proxy.url + CHAT, json=chat_body(), headers={"Authorization": "Bearer sk-alice"}
        )
        assert allowed.status_code == 200
        await proxy.state.tracker.wait_idle()
    line = only_line(access, request_id="no-key")
    assert (line["status"], line["outcome"], line["key"]) == (401, "invalid_api_key", None)
    line = only_line(access, status=200)
    assert line["key"] == "alice"
    assert len(lines(access)) == 2


def test_configured_handler_writes_the_bare_json_line() -> None:
    stream = io.StringIO()
    logger = logging.getLogger(ACCESS_LOGGER)
    level, propagate = logger.level, logger.propagate
    configure_access_log(stream)
    handler = configure_access_log(stream)  # replaces the first: never two lines per request
    try:
        assert logger.handlers == [handler]
        assert not logger.propagate  # not also through the root handler's format
        logger.setLevel(logging.INFO)
        record = AccessRecord("id-1", "GET", "/healthz", "127.0.0.1", started=10.0)
        record.emit(status=200, model="-", outcome="completed", ended=10.25)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
    written = stream.getvalue().splitlines()
    assert len(written) == 1
    line = json.loads(written[0])
    assert set(line) == FIELDS
    assert (line["request_id"], line["duration_s"]) == ("id-1", 0.25)
