"""The framing contract: every event reaches the client as soon as it is complete, whole, and
in the shape its API expects; and a request whose framing is ambiguous is refused.

- SSE, sans-IO: splitting the upstream's byte chunks into events at any chunking, and framing
  our own events;
- over real sockets: each event delivered on its own as it is produced (no relay buffering:
  ``Cache-Control: no-cache``, ``X-Accel-Buffering: no``), as ``curl -N`` sees it;
- a request with both ``Content-Length`` and ``Transfer-Encoding`` (RFC 9112 §6.1: a smuggled
  request could follow) is refused and its connection closed, as is a chunked body on
  HTTP/1.0.
"""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
from functools import partial

import httpx
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from proxy.protocol.errors import ApiError
from proxy.protocol.sse import (
    DONE_EVENT,
    SSEProtocolError,
    SSESplitter,
    check_event,
    data_event,
    error_event,
    is_done,
)
from tests.support import (
    DEADLINE,
    LOCKSTEP_WORDS,
    Proxy,
    RawClient,
    chat_body,
    connect_client,
    mark_read,
    read_request_head,
    serve_in_lockstep,
    start_proxy,
    stream_text,
)
from tests.testing.test_fake_upstream import split_chunked

# At the server seam: each contract holds whichever server reads the request.
pytestmark = pytest.mark.usefixtures("each_server_path")

CHAT = "/v1/chat/completions"

# Line text: any Unicode (multi-byte UTF-8 included) except line breaks and lone surrogates.
_text = st.text(st.characters(exclude_characters="\r\n", exclude_categories=["Cs"]), max_size=12)
_field = st.sampled_from(["data: ", "data:", "event: ", "id: ", ": "])
_line = st.builds(lambda field, text: (field + text).encode(), _field, _text)
# An event's lines, without the blank line that ends it.
_event_lines = st.lists(_line, min_size=1, max_size=3)


def _cuts(data: st.DataObject, stream: bytes, extra: set[int] = frozenset()) -> list[bytes]:
    """Split ``stream`` at random offsets (plus ``extra``); empty chunks allowed."""
    offsets = data.draw(st.lists(st.integers(0, len(stream)), max_size=12))
    bounds = sorted({0, len(stream), *offsets, *extra})
    chunks = [stream[a:b] for a, b in itertools.pairwise(bounds)]
    if data.draw(st.booleans()):
        chunks.insert(data.draw(st.integers(0, len(chunks))), b"")
    return chunks


def _check_split(wire_events: list[bytes], expected: list[bytes], chunks: list[bytes]) -> None:
    """Feeding ``chunks`` yields each event exactly when its last wire byte has arrived."""
    ends, total = [], 0
    for event in wire_events:
        total += len(event)
        ends.append(total)
    splitter = SSESplitter()
    got: list[bytes] = []
    fed = 0
    for chunk in chunks:
        got.extend(splitter.feed(chunk))
        fed += len(chunk)
        complete = sum(1 for end in ends if end <= fed)
        assert got == expected[:complete], f"after {fed} bytes"
    assert got == expected
    assert splitter.pending == b""


@given(st.lists(_event_lines, max_size=6), st.data())
def test_lf_events_survive_any_chunking(events: list[list[bytes]], data: st.DataObject) -> None:
    wire = [b"\n".join(lines) + b"\n\n" for lines in events]
    _check_split(wire, wire, _cuts(data, b"".join(wire)))


@given(st.lists(_event_lines, max_size=6), st.booleans(), st.data())
def test_crlf_events_are_normalised_under_any_chunking(
    events: list[list[bytes]], split_every_crlf: bool, data: st.DataObject
) -> None:
    wire = [b"\r\n".join(lines) + b"\r\n\r\n" for lines in events]
    stream = b"".join(wire)
    # Optionally cut between every CR and its LF, the hardest case for the normaliser.
    extra = (
        {i + 1 for i, byte in enumerate(stream) if byte == ord("\r")} if split_every_crlf else set()
    )
    expected = [b"\n".join(lines) + b"\n\n" for lines in events]
    _check_split(wire, expected, _cuts(data, stream, extra))


@pytest.mark.parametrize("newline", [b"\n", b"\r\n"])
def test_byte_by_byte(newline: bytes) -> None:
    stream = b"data: \xe4\xbd\xa0\xe5\xa5\xbd" + newline * 2 + b"data: \xf0\x9f\x98\x80" + newline
    splitter = SSESplitter()
    got = [event for i in range(len(stream)) for event in splitter.feed(stream[i : i + 1])]
    assert got == [b"data: \xe4\xbd\xa0\xe5\xa5\xbd\n\n"]
    assert splitter.pending == b"data: \xf0\x9f\x98\x80\n"


def test_pending_event_over_limit_raises() -> None:
    splitter = SSESplitter(max_event_bytes=16)
    assert splitter.feed(b"data: " + b"x" * 10) == []  # exactly at the limit: still fine
    with pytest.raises(SSEProtocolError, match="16 bytes"):
        splitter.feed(b"y")


def test_complete_events_do_not_count_towards_limit() -> None:
    splitter = SSESplitter(max_event_bytes=16)
    events = [b"data: %d\n\n" % i for i in range(10)]
    assert splitter.feed(b"".join(events) + b"data: ") == events
    assert splitter.pending == b"data: "


def test_sse_protocol_error_is_a_value_error() -> None:
    assert issubclass(SSEProtocolError, ValueError)


@pytest.mark.parametrize(
    "event",
    [
        b"data: {}\n\n",
        b"data:{}\n\n",
        b"event: x\ndata: 1\n\n",
        b"id: 7\n\n",
        b"retry: 5\n\n",
        b": keep-alive\n\n",
        b"data\n\n",
    ],
)
def test_check_event_accepts_sse_fields(event: bytes) -> None:
    check_event(event)


@pytest.mark.parametrize(
    "event", [b"<html><body>502</body></html>\n\n", b'{"error": "x"}\n\n', b"HTTP/1.1 200\n\n"]
)
def test_check_event_rejects_non_sse(event: bytes) -> None:
    with pytest.raises(SSEProtocolError, match="malformed"):
        check_event(event)


def test_extra_blank_lines_between_events_are_valid() -> None:
    splitter = SSESplitter()
    for event in splitter.feed(b"data: a\n\n\ndata: b\n\n"):
        check_event(event)


@pytest.mark.parametrize(
    ("event", "done"),
    [
        (DONE_EVENT, True),
        (b"data:[DONE]\n\n", True),
        (b'data: {"x": "[DONE]"}\n\n', False),
        (b": data: [DONE]\n\n", False),
    ],
)
def test_is_done(event: bytes, done: bool) -> None:
    assert is_done(event) is done


def test_data_event_is_one_compact_event() -> None:
    payload = {"text": "你好 😀", "lines": "a\n\nb", "n": [1, 2]}
    event = data_event(payload)
    assert event.startswith(b"data: {")
    assert event.count(b"\n\n") == 1 and event.endswith(b"\n\n")
    assert b", " not in event and b": " not in event[len(b"data: ") :]
    assert SSESplitter().feed(event) == [event]
    assert json.loads(event[len(b"data: ") : -2]) == payload


def test_error_event_carries_openai_error_object() -> None:
    error = ApiError(502, "upstream went away", type="upstream_error", code="upstream_eof")
    event = error_event(error)
    check_event(event)
    assert json.loads(event[len(b"data: ") : -2]) == {
        "error": {
            "message": "upstream went away",
            "type": "upstream_error",
            "param": None,
            "code": "upstream_eof",
        }
    }


async def test_stream_delivers_each_event_as_it_is_produced(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    """The upstream sends each token only once the client has read the one before: a relay
    that held an event back for the next would never finish. Lockstep, not gaps between
    arrival times, so that a loaded machine cannot fail it, nor a buffering relay pass it."""
    with trio.fail_after(DEADLINE):
        read = [trio.Event() for _ in LOCKSTEP_WORDS]
        port = await nursery.start(serve_in_lockstep, read)
        proxy = await start_proxy(nursery, {"lockstep": [f"http://127.0.0.1:{port}"]})
        payloads: list[str] = []
        async with client.stream("POST", proxy.url + CHAT, json=chat_body("lockstep")) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["cache-control"] == "no-cache"
            assert response.headers["x-accel-buffering"] == "no"
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    payloads.append(line[6:])
                    mark_read(read, stream_text(payloads))
        assert payloads[-1] == "[DONE]"
        assert stream_text(payloads) == "".join(LOCKSTEP_WORDS)
        assert all(event.is_set() for event in read)


def _token(text: str) -> bytes:
    delta = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return data_event(delta)


async def _serve_a_burst(task_status: trio.TaskStatus[str]) -> None:
    """An upstream whose answer has three token events in one chunk (one send), between an
    opening event and [DONE] sent on their own."""

    async def handle(stream: trio.SocketStream) -> None:
        if await read_request_head(stream) is None:
            return
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        )
        for piece in (_token(""), _token("a") + _token("b") + _token("c"), DONE_EVENT):
            await stream.send_all(b"%x\r\n%b\r\n" % (len(piece), piece))
            await trio.sleep(0.05)
        await stream.send_all(b"0\r\n\r\n")
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
        task_status.started(f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}")


async def test_events_that_arrive_together_go_out_in_one_write(nursery: trio.Nursery) -> None:
    """What one upstream read brought is written at once, not event by event: the same bytes,
    in order, in one chunk (fewer sends on a loaded loop); what came apart stays apart."""
    with trio.fail_after(DEADLINE):
        url = await nursery.start(_serve_a_burst)
        proxy = await start_proxy(nursery, {"burst": [url]})
        client = await RawClient.post(proxy, CHAT, chat_body("burst"))
        await client.read_until(b"0\r\n\r\n")
        head, chunks, _ = split_chunked(client.received)
        assert head.startswith(b"HTTP/1.1 200")
        assert chunks == [_token(""), _token("a") + _token("b") + _token("c"), DONE_EVENT]
        await client.stream.aclose()
        await proxy.state.tracker.wait_idle()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_curl_sees_tokens_one_by_one(nursery: trio.Nursery) -> None:
    """What the quick start promises: `curl -N` through the proxy shows each token as it comes
    (in lockstep: the upstream sends the next token once curl has printed the one before)."""
    with trio.fail_after(DEADLINE):
        read = [trio.Event() for _ in LOCKSTEP_WORDS]
        port = await nursery.start(serve_in_lockstep, read)
        proxy = await start_proxy(nursery, {"lockstep": [f"http://127.0.0.1:{port}"]})
        payloads: list[str] = []
        process = await trio.lowlevel.open_process(
            [
                "curl",
                "-sN",
                proxy.url + CHAT,
                "-H",
                "Content-Type: application/json",
                "-d",
                json.dumps(chat_body("lockstep")),
            ],
            stdout=subprocess.PIPE,
        )
        try:
            assert process.stdout is not None
            buffer = b""
            while chunk := await process.stdout.receive_some():
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    payloads.append(event.decode().removeprefix("data: "))
                    mark_read(read, stream_text(payloads))
            await process.wait()
        finally:
            process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()
            assert process.stdout is not None
            await process.stdout.aclose()
        assert process.returncode == 0
        assert payloads[-1] == "[DONE]"
        assert stream_text(payloads) == "".join(LOCKSTEP_WORDS)


async def test_content_length_with_transfer_encoding_is_refused_and_closed(
    proxy: Proxy,
) -> None:
    with trio.fail_after(DEADLINE):
        smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
        body = b"0\r\n\r\n"
        stream = await connect_client(proxy)
        await stream.send_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n%b%b"
            % (len(body) + len(smuggled), body, smuggled)
        )
        received = b""
        while data := await stream.receive_some(65536):
            received += data
        await stream.aclose()
        assert received.startswith(b"HTTP/1.1 400 ")
        assert b"connection: close" in received.lower()
        assert received.count(b"HTTP/1.1") == 1  # the smuggled request was never answered
        error = json.loads(received.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "invalid_framing"


async def test_chunked_body_on_http_1_0_is_refused(proxy: Proxy) -> None:
    with trio.fail_after(DEADLINE):
        stream = await connect_client(proxy)
        payload = json.dumps(chat_body(stream=False)).encode()
        await stream.send_all(
            b"POST /v1/chat/completions HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Type: application/json\r\n\r\n%x\r\n%b\r\n0\r\n\r\n" % (len(payload), payload)
        )
        received = b""
        while data := await stream.receive_some(65536):
            received += data
        await stream.aclose()
        assert b" 400 " in received.split(b"\r\n", 1)[0]
