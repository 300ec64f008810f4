"""Faults of the server seam found by an adversarial raw-socket run, each pinned on both server
paths: the fast path (proxy/server/fast_path.py) and hypercorn (``[server] fast_path = false``).

Each test asserts the right behaviour, so it fails where the fault exists and passes once it is
fixed; where a fault exists on one path only, the other path's case passes already, and its
docstring says which. Real sockets on 127.0.0.1, port 0, a ``fail_after`` around all I/O. Where
a measure can be exact it is (lines per task step, bytes, a reset or not, virtual time with
``autojump_clock`` for the keep-alive timer); the one wall-clock bound (a departure noticed
within ``CANCEL_BOUND``) is measured with the test's own loop idle, as the fault needs.

1. Pipelined refusals served in one task step, starving every other task of the loop.
2. An answer's tail lost to a reset: the connection closed with the client's bytes unread.
3. Bytes that can never start a request (a TLS ClientHello) held until the keep-alive timer,
   then closed in silence, instead of a prompt 400.
4. A partial head of exactly 16 KiB handed to hypercorn, whose keep-alive timer starts again.
5. A client that pipelines a byte and then leaves, noticed seconds late (and, on hypercorn,
   its connection left open after its request is gone).
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
import trio

from proxy.api.auth import hash_key
from proxy.ops.logs import ACCESS_LOGGER
from proxy.server.adapters.hypercorn_adapter import HypercornConfig
from tests.contracts.test_lifetime_matrix import (
    CANCEL_BOUND,
    connection_handlers,
    leave_at_once,
    proxy_tasks,
    send_pipelined_byte,
    taken_in,
)
from tests.support import (
    DEADLINE,
    OPEN_RAW_CLIENTS,
    Fake,
    Proxy,
    RawClient,
    chat_body,
    connect_client,
    poll_until,
    shutdown_trigger,
    sse_payloads,
    start_fake,
    start_proxy,
    stream_text,
)

CHAT = "/v1/chat/completions"
SECRET = "sk-seam-faults"
SERVER_PATHS = [pytest.param(True, id="fast_path"), pytest.param(False, id="hypercorn")]


async def connect(proxy: Proxy) -> RawClient:
    raw = RawClient(await connect_client(proxy))
    OPEN_RAW_CLIENTS.append(raw)
    return raw


async def read_to_eof(raw: RawClient) -> bool:
    """Everything the server sends, into ``raw.received``, until it closes; whether it reset the
    connection (RST) rather than closing it (FIN)."""
    while True:
        try:
            data = await raw.stream.receive_some(65536)
        except trio.BrokenResourceError:
            return True
        if not data:
            return False
        raw.received += data


# -- 1. pipelined refusals hold the event loop ------------------------------------------------


class TaskSteps(trio.abc.Instrument):
    """Numbers the loop's task steps (the one running now: ``current``), and times the longest."""

    def __init__(self) -> None:
        self.current = 0
        self.began: float | None = None
        self.longest = 0.0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.current += 1
        self.began = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.began is not None:  # not the step that added the instrument
            self.longest = max(self.longest, time.perf_counter() - self.began)


class RefusalsPerStep(logging.Handler):
    """Counts the access lines of 401s written in each task step."""

    def __init__(self, steps: TaskSteps) -> None:
        super().__init__(logging.INFO)
        self.steps = steps
        self.per_step: Counter[int] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        if json.loads(record.getMessage())["status"] == 401:
            self.per_step[self.steps.current] += 1


PIPELINED_REFUSALS = 900
# With a checkpoint per request served from the buffer, one refusal per step; "a couple" leaves
# room for a step that ends one request and begins the next.
MOST_REFUSALS_PER_STEP = 2


@pytest.mark.parametrize("fast_path", SERVER_PATHS)
async def test_pipelined_refusals_are_served_a_few_per_task_step(
    fast_path: bool, nursery: trio.Nursery, fake: Fake
) -> None:
    """900 pipelined 401s in one write must not be served in one task step, which holds every
    other task of the loop (a concurrent stream went 147 ms without a byte on the fast path).
    Counted, not timed: the access lines written per task step. hypercorn serves each request
    in a task of its own: that case passes already."""
    steps = TaskSteps()
    lines = RefusalsPerStep(steps)
    access = logging.getLogger(ACCESS_LOGGER)
    access.addHandler(lines)
    access.setLevel(logging.INFO)  # put back by conftest's restore_logging
    access.propagate = False  # 900 lines need not go through pytest's capture too
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            keys=[{"name": "alice", "sha256": hash_key(SECRET)}],
            server={"fast_path": fast_path},
        )
        raw = await connect(proxy)
        request = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode()
        trio.lowlevel.add_instrument(steps)
        try:
            await raw.stream.send_all(request * PIPELINED_REFUSALS)
            while raw.received.count(b"HTTP/1.1 401 ") < PIPELINED_REFUSALS:
                data = await raw.stream.receive_some(65536)
                assert data, f"closed after {raw.received.count(b'HTTP/1.1 401 ')} answers"
                raw.received += data
        finally:
            trio.lowlevel.remove_instrument(steps)
            access.removeHandler(lines)
    assert sum(lines.per_step.values()) == PIPELINED_REFUSALS
    most = max(lines.per_step.values())
    assert most <= MOST_REFUSALS_PER_STEP, (
        f"{most} refusals served in one task step; the longest step took "
        f"{steps.longest * 1000:.0f} ms"
    )


# -- 2. the end of an answer is thrown away ---------------------------------------------------

# About 150 KB of SSE (800 events), about 100 KB of JSON (20,000 tokens of the fake's words).
LONG_ANSWER_TOKENS = {"sse": 800, "json": 20_000}
JUNK = b"junk after the request\r\n"


@dataclass
class WholeAnswer:
    status: int
    headers: dict[str, str]
    body: bytes


def parse_whole_answer(received: bytes) -> WholeAnswer:
    """The one answer in ``received``, checked complete: its Content-Length's bytes, or every
    chunk through the last one (``0\\r\\n\\r\\n``), and nothing after it."""
    head, sep, rest = received.partition(b"\r\n\r\n")
    assert sep, f"no whole head in {len(received)} bytes: {received[:300]!r}"
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines)}
    answer = WholeAnswer(int(status_line.split(" ")[1]), headers, b"")
    if "content-length" in headers:
        length = int(headers["content-length"])
        assert len(rest) == length, f"{len(rest)} of {length} body bytes arrived"
        answer.body = rest
        return answer
    assert headers.get("transfer-encoding") == "chunked", headers
    while True:
        size_line, sep, rest = rest.partition(b"\r\n")
        assert sep, f"cut in a chunk's size line, {len(answer.body)} body bytes in"
        size = int(size_line, 16)
        assert len(rest) >= size + 2, f"cut in a chunk, {len(answer.body)} body bytes in"
        answer.body += rest[:size]
        assert rest[size : size + 2] == b"\r\n"
        rest = rest[size + 2 :]
        if size == 0:
            assert rest == b"", rest[:100]
            return answer


def assert_whole_completion(answer: WholeAnswer, transport: str) -> None:
    tokens = LONG_ANSWER_TOKENS[transport]
    assert answer.status == 200, answer.body[:300]
    assert answer.headers.get("connection") == "close", answer.headers
    if transport == "sse":
        payloads = sse_payloads(answer.body.decode())
        assert payloads[-1] == "[DONE]", payloads[-2:]
        text = stream_text(payloads)
    else:
        text = json.loads(answer.body)["choices"][0]["message"]["content"]
    assert len(text.split()) == tokens


async def assert_answered_whole_then_closed(raw: RawClient, transport: str) -> None:
    reset = await read_to_eof(raw)
    answer = parse_whole_answer(raw.received)
    assert_whole_completion(answer, transport)
    assert not reset, "the answer arrived whole, but the connection was reset, not closed"


def long_answer(transport: str, **fake: Any) -> dict[str, Any]:
    schedule = {"ttft": 0.5, "interval": 0, "tokens": LONG_ANSWER_TOKENS[transport], **fake}
    return chat_body(stream=transport == "sse", fake=schedule)


@pytest.mark.parametrize("fast_path", SERVER_PATHS)
@pytest.mark.parametrize(
    ("transport", "junk_sent"),
    [
        ("sse", "with the request"),
        ("sse", "before the answer"),
        ("sse", "mid-answer"),
        ("json", "with the request"),
        ("json", "before the answer"),
    ],
)
async def test_connection_close_answer_arrives_whole_despite_pipelined_bytes(
    fast_path: bool, transport: str, junk_sent: str, nursery: trio.Nursery
) -> None:
    """A ``Connection: close`` request whose client sends more bytes after it: the answer must
    arrive whole and the connection end in a FIN, not a reset (RFC 9112 9.6: shut the write
    side, read and discard for a while, then close). Closing with the client's bytes unread
    sends RST, and the client loses what it has not read yet.

    Fast path: junk "with the request" is read into its buffer with the request (nothing left
    unread: that case passes); junk that comes once the request is read stays unread, and the
    connection is reset. hypercorn: h11 refuses any byte after a ``Connection: close`` request,
    with a 400 instead of the answer (before it) or by cutting the answer (mid-answer)."""
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery)
        proxy = await start_proxy(
            nursery, {"fake-model": [fake.url]}, server={"fast_path": fast_path}
        )
        # "mid-answer": the stream paced, so that the junk comes while it is being written.
        paced = {"ttft": 0, "interval": 0.001} if junk_sent == "mid-answer" else {}
        raw = await RawClient.post(
            proxy,
            CHAT,
            long_answer(transport, **paced),
            headers={"Connection": "close"},
            extra=JUNK if junk_sent == "with the request" else b"",
        )
        await fake.recorder.wait_for(lambda r: len(r.records) == 1)
        record = fake.recorder.last()
        if junk_sent == "mid-answer":
            await raw.read_until(b"data: ", count=3)
        if junk_sent != "with the request":
            await raw.stream.send_all(JUNK)
        # The client reads on only once the upstream is done: the proxy has the whole answer
        # (and has closed the connection, as it does).
        await fake.recorder.wait_for(lambda _: record.outcome != "pending")
        await assert_answered_whole_then_closed(raw, transport)


@pytest.mark.parametrize("fast_path", SERVER_PATHS)
@pytest.mark.parametrize("transport", ["sse", "json"])
async def test_the_last_answer_at_keep_alive_max_requests_arrives_whole(
    fast_path: bool, transport: str, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection's last request by ``keep_alive_max_requests`` (1 here), and bytes after
    it: its answer says ``Connection: close``, arrives whole, and the connection ends in a FIN.
    Fault on the fast path (it closes with the bytes unread: a reset). hypercorn reads the
    bytes into h11's buffer before it closes: that case passes."""
    monkeypatch.setattr(HypercornConfig, "keep_alive_max_requests", 1)
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery)
        proxy = await start_proxy(
            nursery, {"fake-model": [fake.url]}, server={"fast_path": fast_path}
        )
        raw = await RawClient.post(proxy, CHAT, long_answer(transport))
        await fake.recorder.wait_for(lambda r: len(r.records) == 1)
        record = fake.recorder.last()
        await raw.stream.send_all(JUNK)
        await fake.recorder.wait_for(lambda _: record.outcome != "pending")
        await assert_answered_whole_then_closed(raw, transport)


@pytest.mark.parametrize("fast_path", SERVER_PATHS)
async def test_an_answer_finished_during_a_drain_arrives_whole(
    fast_path: bool, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream under way when the graceful shutdown begins, its client having sent more bytes:
    the stream ends whole, and the connection in a FIN. Fault on the fast path (a reset, the
    bytes unread); hypercorn has read them into h11's buffer: that case passes."""
    shutdown = shutdown_trigger(monkeypatch)
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery)
        proxy = await start_proxy(
            nursery, {"fake-model": [fake.url]}, server={"fast_path": fast_path}
        )
        raw = await RawClient.post(proxy, CHAT, long_answer("sse", ttft=0, interval=0.001))
        await fake.recorder.wait_for(lambda r: len(r.records) == 1)
        record = fake.recorder.last()
        await raw.read_until(b"data: ", count=3)
        await raw.stream.send_all(JUNK)
        shutdown.set()
        await fake.recorder.wait_for(lambda _: record.outcome != "pending")
        reset = await read_to_eof(raw)
        answer = parse_whole_answer(raw.received)
        assert answer.status == 200
        payloads = sse_payloads(answer.body.decode())
        assert payloads[-1] == "[DONE]", payloads[-2:]
        assert len(stream_text(payloads).split()) == LONG_ANSWER_TOKENS["sse"]
        assert not reset, "the answer arrived whole, but the connection was reset, not closed"


# -- 3. bytes that can never be a request get no 400 ------------------------------------------


def client_hello() -> bytes:
    """The start of a TLS 1.2 ClientHello record (what a client that speaks TLS to a plain port
    sends first): no CR or LF in it, so no "line" ever ends."""
    body = b"\x03\x03" + bytes(range(0x20, 0x40)) + b"\x00" + b"\x00\x04\x13\x01\x13\x02"
    body += b"\x01\x00" + b"\x00\x00"
    handshake = b"\x01" + len(body).to_bytes(3, "big") + body
    return b"\x16\x03\x01" + len(handshake).to_bytes(2, "big") + handshake


NEVER_A_REQUEST = {"TLS ClientHello": client_hello(), "NUL first": b"\x00\x01\x02 junk"}


@pytest.mark.parametrize("fast_path", SERVER_PATHS)
@pytest.mark.parametrize("case", list(NEVER_A_REQUEST))
async def test_bytes_that_cannot_start_a_request_get_a_prompt_400(
    case: str, fast_path: bool, nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    """A first byte that no request method can begin with (a ClientHello's 0x16) is answered
    400 at once and the connection closed, as h11 does. Fault on the fast path: it waits for a
    head until ``keep_alive_timeout`` (5 s), then closes in silence. hypercorn passes. Virtual
    time: the fast path's silence measures exactly its keep-alive timer."""
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery)
        proxy = await start_proxy(
            nursery, {"fake-model": [fake.url]}, server={"fast_path": fast_path}
        )
        keep_alive = proxy.config.server.keep_alive_timeout
        raw = await connect(proxy)
        sent_at = trio.current_time()
        await raw.stream.send_all(NEVER_A_REQUEST[case])
        await read_to_eof(raw)
        took = trio.current_time() - sent_at
        assert raw.received.startswith(b"HTTP/1.1 400 "), (
            f"closed after {took:.2f} s with {raw.received[:100]!r}"
        )
        assert took < keep_alive / 2, took


# -- 4. a 16 KiB partial head doubles a slowloris's hold --------------------------------------

KEEP_ALIVE = 2.0
# Closed (or refused) by the end of the keep-alive period; virtual time, so the margin is only
# for the steps after the timer fires. The fault holds the connection twice as long.
HOLD_BOUND = KEEP_ALIVE + 0.25
HEAD_LIMIT = 16 * 1024


def unfinished_head(size: int) -> bytes:
    """``size`` bytes of a request head that has not ended (no blank line)."""
    start = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nX-Pad: ".encode()
    return start + b"a" * (size - len(start))


LATE = 0.9 * KEEP_ALIVE
# When each part of the head is sent (seconds after the connection), and how many bytes.
PARTIAL_HEADS: dict[str, list[tuple[float, int]]] = {
    "16383 late": [(LATE, HEAD_LIMIT - 1)],
    "16384 late": [(LATE, HEAD_LIMIT)],
    "16385 late": [(LATE, HEAD_LIMIT + 1)],
    "16384 dribbled": [(LATE * (i + 1) / 64, HEAD_LIMIT // 64) for i in range(64)],
    "16383 at once, then 1 late": [(0, HEAD_LIMIT - 1), (LATE, 1)],
}


@pytest.mark.parametrize("fast_path", SERVER_PATHS)
@pytest.mark.parametrize("case", list(PARTIAL_HEADS))
async def test_a_partial_head_is_held_no_longer_than_keep_alive_timeout(
    case: str, fast_path: bool, nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    """A head that never ends is closed (or refused with a 4xx and closed) within
    ``keep_alive_timeout`` of the connection's start, whatever its size and pace. Fault on the
    fast path when the head reaches exactly 16,384 bytes late in the period: it hands the
    connection to hypercorn, whose keep-alive timer starts again then (h11 fails a head only
    when it is *over* 16,384 bytes), so the connection is held up to twice as long. hypercorn
    passes (its timer runs from the connection's start until a whole head has come). Virtual
    time."""
    schedule = PARTIAL_HEADS[case]
    head = unfinished_head(sum(size for _, size in schedule))
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery)
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            server={"fast_path": fast_path, "keep_alive_timeout": KEEP_ALIVE},
        )
        raw = await connect(proxy)
        connected = trio.current_time()

        async def send() -> None:
            sent = 0
            try:
                for at, size in schedule:
                    await trio.sleep_until(connected + at)
                    await raw.stream.send_all(head[sent : sent + size])
                    sent += size
            except trio.BrokenResourceError:
                pass  # closed or refused before all of it was sent: the reader judges

        async with trio.open_nursery() as sending:
            sending.start_soon(send)
            await read_to_eof(raw)
            held = trio.current_time() - connected
            sending.cancel_scope.cancel()
        assert held <= HOLD_BOUND, f"held {held:.2f} s (keep_alive_timeout {KEEP_ALIVE} s)"
        if raw.received:
            assert raw.received[:13] in (b"HTTP/1.1 400 ", b"HTTP/1.1 431 "), raw.received[:100]


# -- 5. a departure noticed seconds late ------------------------------------------------------


# How long the test waits, idle, for the upstream to see the departure (the fault: seconds).
NOTICED_WITHIN = 5.0
# How long a departed client's connection may outlive its request (the matrix's SETTLE).
CONNECTION_GONE_WITHIN = 2.0


@pytest.mark.parametrize("fast_path", SERVER_PATHS)
@pytest.mark.parametrize("byte_sent", ["with the request", "once the request is read"])
async def test_a_client_that_pipelines_a_byte_and_leaves_is_noticed_at_once(
    byte_sent: str, fast_path: bool, nursery: trio.Nursery
) -> None:
    """A client that pipelines one byte and then leaves while its request waits for the first
    token: the upstream connection must close within CANCEL_BOUND of the client's close (the
    lifetime contract). The fast path's EOF watch (a MSG_PEEK) ends when the byte arrives, and
    hypercorn's reader is paused behind the first answer, so the FIN is seen only when the loop
    next wakes for something else. The test's loop stays idle after the close (no checkpoint,
    then one wait on the fake's record), as the fault needs.

    Fault on both paths once the byte comes after the request was read. A byte in the request's
    own write is read with it by the fast path, whose watch then sees the FIN: that fast-path
    case passes; hypercorn's does not."""
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery)
        proxy = await start_proxy(
            nursery, {"fake-model": [fake.url]}, server={"fast_path": fast_path}
        )
        raw = await RawClient.post(
            proxy,
            CHAT,
            chat_body(fake={"ttft": 60}),
            extra=b"P" if byte_sent == "with the request" else b"",
        )
        await fake.recorder.wait_for(lambda r: len(r.records) == 1)
        record = fake.recorder.last()
        if byte_sent == "with the request":
            await taken_in(raw.stream)
        else:
            # Once the proxy has read the request: not read with it.
            await send_pipelined_byte(raw.stream)
        closed_at = leave_at_once(raw)
        with trio.move_on_after(NOTICED_WITHIN):
            await fake.recorder.wait_for(lambda _: record.outcome != "pending")
        assert record.outcome == "client_disconnected", (
            f"the upstream saw nothing of the departure in {NOTICED_WITHIN} s"
        )
        noticed = record.disconnected_at - closed_at
        assert noticed < CANCEL_BOUND, (
            f"the upstream saw the departure {noticed * 1000:.0f} ms late"
        )


@pytest.mark.parametrize("fast_path", SERVER_PATHS)
async def test_the_connection_of_a_client_that_pipelined_a_byte_and_left_is_closed(
    fast_path: bool, nursery: trio.Nursery
) -> None:
    """Mid-stream (the loop busy, so the departure itself is seen at once), a client sends a
    byte and leaves: its request is cancelled, and its connection must go with it: no task or
    socket of it left (the lifetime contract). Fault on hypercorn: its reader stays paused
    behind the cancelled answer, which never ends the h11 cycle that would resume it, so the
    connection's task waits on, with the socket, long after (20 s measured, no timer running).
    The fast path passes."""
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery)
        proxy = await start_proxy(
            nursery, {"fake-model": [fake.url]}, server={"fast_path": fast_path}
        )
        raw = await RawClient.post(
            proxy, CHAT, chat_body(fake={"ttft": 0, "interval": 0.02, "tokens": 1000})
        )
        await raw.read_until(b"data: ", count=3)
        assert len(connection_handlers(proxy_tasks())) == 1
        await send_pipelined_byte(raw.stream)
        await raw.close()
        await proxy.state.tracker.wait_idle()
        with trio.move_on_after(CONNECTION_GONE_WITHIN):
            await poll_until(lambda: not connection_handlers(proxy_tasks()))
        assert not connection_handlers(proxy_tasks()), (
            f"the connection's task remains {CONNECTION_GONE_WITHIN} s after its request ended"
        )
