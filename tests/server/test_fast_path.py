"""The fast path (proxy/server/fast_path.py) and its hand-off to hypercorn, over real sockets.

Every contract test already runs over the fast path; these prove what is its own: that it is
the layer that reads plain requests to the API and hands them to the one responder (each Call it
makes is counted),
that its answers are the ones hypercorn and Quart give (a second proxy with ``fast_path =
false`` answers the same bytes), that every request that is not plain, and everything after it
on the connection, is hypercorn's, and that it keeps hypercorn's connection handling:
keep-alive, pipelining, ``Connection: close``, the idle timer, graceful shutdown, a client
that leaves and one that stops reading.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import trio

from proxy.api.auth import hash_key
from proxy.server import fast_path
from proxy.server.adapters.hypercorn_adapter import HypercornConfig
from proxy.server.call import Call
from tests.contracts.test_lifetime import assert_request_gone
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
)

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
SECRET = "sk-fast-path-test"


@pytest.fixture
def served_fast(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths of the requests the fast path answered, in order."""
    paths: list[str] = []
    make = fast_path.Call

    def counting(*args: Any, **kwargs: Any) -> Call:
        call = make(*args, **kwargs)
        paths.append(call.path)
        return call

    monkeypatch.setattr(fast_path, "Call", counting)
    return paths


# --- a hand-written HTTP/1.1 client -------------------------------------------------------


def post(
    proxy: Proxy,
    body: dict[str, Any] | bytes,
    *,
    path: str = CHAT,
    headers: str = "",
    version: str = "HTTP/1.1",
) -> bytes:
    """A POST's bytes; ``headers`` are more header lines, each ending in CRLF."""
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    host, port = proxy.host_port
    head = (
        f"POST {path} {version}\r\nHost: {host}:{port}\r\n{headers}"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


def get(proxy: Proxy, path: str = "/healthz") -> bytes:
    host, port = proxy.host_port
    return f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()


@dataclass
class Answer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        return next((value for key, value in self.headers if key == name), None)

    def json(self) -> Any:
        return json.loads(self.body)

    def comparable(self) -> tuple[int, list[tuple[str, str]], bytes]:
        """What a client sees, but the values that differ from one answer to the next (a
        completion's id and time: only a refusal's body is compared)."""
        varying = {"date", "x-request-id"} | ({"content-length"} if self.status < 300 else set())
        headers = sorted((k, "*" if k in varying else v) for k, v in self.headers)
        return self.status, headers, self.body if self.status >= 300 else b"..."


async def connect(proxy: Proxy, *, rcvbuf: int | None = None) -> RawClient:
    raw = RawClient(await connect_client(proxy, rcvbuf=rcvbuf))
    OPEN_RAW_CLIENTS.append(raw)
    return raw


async def _receive(raw: RawClient) -> None:
    data = await raw.stream.receive_some(65536)
    if not data:
        raise EOFError(f"connection closed; received {raw.received[-300:]!r}")
    raw.received += data


async def _take_line(raw: RawClient) -> bytes:
    while b"\r\n" not in raw.received:
        await _receive(raw)
    line, _, raw.received = raw.received.partition(b"\r\n")
    return line


async def _take(raw: RawClient, size: int) -> bytes:
    while len(raw.received) < size:
        await _receive(raw)
    data, raw.received = raw.received[:size], raw.received[size:]
    return data


async def read_answer(raw: RawClient) -> Answer:
    """The next response on ``raw`` (an informational one too), read whole."""
    while b"\r\n\r\n" not in raw.received:
        await _receive(raw)
    head, _, raw.received = raw.received.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = [(k.strip().lower(), v.strip()) for k, _, v in (x.partition(":") for x in lines)]
    answer = Answer(int(status_line.split(" ")[1]), headers, b"")
    if answer.status < 200:
        return answer
    if (length := answer.header("content-length")) is not None:
        answer.body = await _take(raw, int(length))
    elif answer.header("transfer-encoding") == "chunked":
        while size := int(await _take_line(raw), 16):
            answer.body += await _take(raw, size)
            await _take(raw, 2)
        await _take(raw, 2)
    else:
        await closed(raw)
        answer.body, raw.received = raw.received, b""
    return answer


async def closed(raw: RawClient) -> bool:
    """Whether the server closes the connection (EOF or reset) once what it sent is read;
    False if it sends more instead."""
    try:
        data = await raw.stream.receive_some(65536)
    except trio.BrokenResourceError:
        return True
    raw.received += data
    return not data


async def exchange(proxy: Proxy, *requests: bytes) -> list[Answer]:
    """``requests`` sent one after another on one connection, each once the last is answered;
    every answer (1xx included)."""
    raw = await connect(proxy)
    answers = []
    for request in requests:
        await raw.stream.send_all(request)
        answers.append(await read_answer(raw))
        while answers[-1].status < 200:
            answers.append(await read_answer(raw))
    return answers


async def fast_and_hypercorn(
    nursery: trio.Nursery, fake: Fake, **sections: Any
) -> tuple[Proxy, Proxy]:
    """Two proxies on ``fake``, the same but for the fast path: on, then off."""
    models = {"fake-model": [fake.url]}
    server = sections.pop("server", {})
    fast = await start_proxy(nursery, models, server=server, **sections)
    hypercorn = await start_proxy(
        nursery, models, server={**server, "fast_path": False}, **sections
    )
    return fast, hypercorn


async def assert_same_answers(
    fast: Proxy, hypercorn: Proxy, request: Callable[[Proxy], bytes]
) -> Answer:
    """The fast-path proxy answers ``request`` as hypercorn and Quart do; its answer."""
    (fast_answer,) = [a for a in await exchange(fast, request(fast)) if a.status >= 200]
    (slow_answer,) = [a for a in await exchange(hypercorn, request(hypercorn)) if a.status >= 200]
    assert fast_answer.comparable() == slow_answer.comparable()
    assert fast_answer.header("x-request-id")
    return fast_answer


# --- what the fast path serves, and how ----------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
async def test_a_plain_request_is_served_by_the_fast_path(
    stream: bool, nursery: trio.Nursery, fake: Fake, served_fast: list[str]
) -> None:
    with trio.fail_after(DEADLINE):
        fast, hypercorn = await fast_and_hypercorn(nursery, fake)
        (answer,) = await exchange(fast, post(fast, chat_body(stream=stream)))
        assert served_fast == [CHAT]
        assert answer.status == 200
        if stream:
            assert sse_payloads(answer.body.decode())[-1] == "[DONE]"
        else:
            assert answer.json()["choices"][0]["message"]["content"]
        # The same head as hypercorn's and Quart's (the completion's ids and times differ).
        (slow,) = await exchange(hypercorn, post(hypercorn, chat_body(stream=stream)))
        assert answer.comparable()[:2] == slow.comparable()[:2]
        assert served_fast == [CHAT]


REFUSALS: dict[str, tuple[str, bytes | dict[str, Any], str, int]] = {
    # path, body, more header lines, status
    "bad JSON": (CHAT, b'{"model": ', "", 400),
    "unknown model": (CHAT, chat_body("no-such-model"), "", 404),
    "no key": (CHAT, chat_body(), "", 401),
    "wrong key": (CHAT, chat_body(), "Authorization: Bearer sk-wrong\r\n", 401),
    "messages, bad JSON": (MESSAGES, b"[", "", 400),
    "messages, unknown model": (
        MESSAGES,
        {"model": "nope", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
        f"Authorization: Bearer {SECRET}\r\n",
        404,
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
async def test_a_refusal_is_the_fast_paths_and_the_same_as_quarts(
    case: str, nursery: trio.Nursery, fake: Fake, served_fast: list[str]
) -> None:
    path, body, more, status = REFUSALS[case]
    if "key" not in case and "Authorization" not in more:
        more += f"Authorization: Bearer {SECRET}\r\n"
    cors = "Origin: https://app.example\r\n"
    with trio.fail_after(DEADLINE):
        fast, hypercorn = await fast_and_hypercorn(
            nursery,
            fake,
            keys=[{"name": "alice", "sha256": hash_key(SECRET)}],
            server={"cors_origins": ["https://app.example"]},
        )
        answer = await assert_same_answers(
            fast, hypercorn, lambda proxy: post(proxy, body, path=path, headers=more + cors)
        )
        assert served_fast == [path]
        assert answer.status == status
        assert answer.header("content-type") == "application/json"
        assert answer.header("access-control-allow-origin") == "https://app.example"
        error = answer.json()
        if path == MESSAGES:  # Anthropic's shape
            assert error["type"] == "error" and error["error"]["type"], error
        else:  # OpenAI's
            assert error["error"]["message"] and "type" in error["error"], error


UPSTREAM_FAILURES: dict[str, dict[str, Any]] = {
    "429 before the stream": chat_body(fake={"mode": "status", "status": 429}),
    "500, not streamed": chat_body(stream=False, fake={"mode": "status", "status": 500}),
    "reset before the first token": chat_body(fake={"mode": "reset", "at": 0}),
    "malformed": chat_body(stream=False, fake={"mode": "malformed"}),
}


@pytest.mark.parametrize("case", list(UPSTREAM_FAILURES))
async def test_an_upstream_failure_is_answered_as_quart_answers_it(
    case: str, nursery: trio.Nursery, fake: Fake, served_fast: list[str]
) -> None:
    body = UPSTREAM_FAILURES[case]
    with trio.fail_after(DEADLINE):
        fast, hypercorn = await fast_and_hypercorn(nursery, fake)
        answer = await assert_same_answers(fast, hypercorn, lambda proxy: post(proxy, body))
        assert answer.status >= 400
        assert served_fast == [CHAT]


async def test_a_pass_through_path_is_the_fast_paths(
    nursery: trio.Nursery, fake: Fake, served_fast: list[str]
) -> None:
    model = {"upstreams": [fake.url], "passthrough": ["/tokenize"]}
    with trio.fail_after(DEADLINE):
        fast = await start_proxy(nursery, {"fake-model": model})
        hypercorn = await start_proxy(nursery, {"fake-model": model}, server={"fast_path": False})
        body = {"model": "fake-model", "prompt": "hello there"}
        answers = [await exchange(p, post(p, body, path="/tokenize")) for p in (fast, hypercorn)]
        assert served_fast == ["/tokenize"]
        (fast_answer,), (slow_answer,) = answers
        assert fast_answer.status == 200
        assert fast_answer.comparable()[:2] == slow_answer.comparable()[:2]
        assert fast_answer.body == slow_answer.body


def request_counts(proxy: Proxy) -> dict[tuple[str, ...], float]:
    (metric,) = [m for m in proxy.state.metrics.registry.collect() if m.name == "sluice_requests"]
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for sample in metric.samples
        if sample.name == "sluice_requests_total"
    }


async def test_the_same_requests_count_the_same_in_the_metrics(
    nursery: trio.Nursery, fake: Fake, served_fast: list[str]
) -> None:
    bodies: list[dict[str, Any] | bytes] = [
        chat_body(),
        chat_body(stream=False),
        b"{",
        chat_body("no-such-model"),
        chat_body(fake={"mode": "status", "status": 429}),
    ]
    with trio.fail_after(DEADLINE):
        fast, hypercorn = await fast_and_hypercorn(nursery, fake)
        for proxy in (fast, hypercorn):
            await exchange(proxy, *(post(proxy, body) for body in bodies))
            await proxy.state.tracker.wait_idle()
        assert len(served_fast) == len(bodies)
        assert request_counts(fast) == request_counts(hypercorn)
        assert sum(request_counts(fast).values()) == len(bodies)


@pytest.mark.parametrize("excess", [0, 1])
async def test_max_body_bytes_is_the_same_bound_as_quarts(
    excess: int, nursery: trio.Nursery, fake: Fake, served_fast: list[str]
) -> None:
    limit = 4096
    with trio.fail_after(DEADLINE):
        fast, hypercorn = await fast_and_hypercorn(nursery, fake, server={"max_body_bytes": limit})
        body = b"{" + b" " * (limit + excess - 1)  # bad JSON, unless it is too big to read
        answer = await assert_same_answers(fast, hypercorn, lambda proxy: post(proxy, body))
        assert answer.status == (413 if excess else 400)
        assert answer.json()["error"]["type"] == "invalid_request_error"  # OpenAI's shape
        assert served_fast == ([] if excess else [CHAT])


async def test_keep_alive_then_hand_off_for_the_rest_of_the_connection(
    nursery: trio.Nursery, proxy: Proxy, served_fast: list[str]
) -> None:
    with trio.fail_after(DEADLINE):
        answers = await exchange(
            proxy,
            post(proxy, chat_body()),
            post(proxy, b"not json"),
            post(proxy, chat_body()),
            get(proxy),
            post(proxy, chat_body(stream=False)),
            post(proxy, chat_body()),
        )
        assert [answer.status for answer in answers] == [200, 400] + [200] * 4
        assert answers[3].json()["status"] == "ok", answers[3].body
        assert sse_payloads(answers[5].body.decode())[-1] == "[DONE]"
        # The three before the GET were the fast path's; the GET and all after, hypercorn's.
        assert served_fast == [CHAT] * 3
        assert all(answer.header("connection") is None for answer in answers)


async def test_pipelined_requests_are_answered_in_order(
    nursery: trio.Nursery, proxy: Proxy, served_fast: list[str]
) -> None:
    def tagged(tag: str, **body: Any) -> bytes:
        return post(proxy, chat_body(**body), headers=f"X-Request-ID: {tag}\r\n")

    with trio.fail_after(DEADLINE):
        raw = await connect(proxy)
        await raw.stream.send_all(
            tagged("one", fake={"ttft": 0.2})
            + tagged("two", stream=False)
            + get(proxy)
            + tagged("four")
        )
        answers = [await read_answer(raw) for _ in range(4)]
        tags = [a.header("x-request-id") for a in answers]
        assert tags[:2] + tags[3:] == ["one", "two", "four"]
        assert answers[2].json()["status"] == "ok"
        assert [a.status for a in answers] == [200] * 4
        assert sse_payloads(answers[0].body.decode())[-1] == "[DONE]"
        assert served_fast == [CHAT] * 2  # the GET handed the connection over


# --- everything that is not plain is hypercorn's -------------------------------------------


def chunked(proxy: Proxy) -> bytes:
    host, port = proxy.host_port
    payload = json.dumps(chat_body(stream=False)).encode()
    return (
        (
            f"POST {CHAT} HTTP/1.1\r\nHost: {host}:{port}\r\nTransfer-Encoding: chunked\r\n"
            f"Content-Type: application/json\r\n\r\n{len(payload):x}\r\n"
        ).encode()
        + payload
        + b"\r\n0\r\n\r\n"
    )


_LENGTH = len(json.dumps(chat_body(stream=False)))


def with_head(extra: str, version: str = "HTTP/1.1") -> Callable[[Proxy], bytes]:
    return lambda proxy: post(proxy, chat_body(stream=False), headers=extra, version=version)


def replace(old: bytes, new: bytes) -> Callable[[Proxy], bytes]:
    return lambda proxy: post(proxy, chat_body(stream=False)).replace(old, new, 1)


NOT_PLAIN: dict[str, tuple[Callable[[Proxy], bytes], int | None]] = {
    # the request, and its status (None: whatever hypercorn answers)
    "chunked body": (chunked, 200),
    "Expect: 100-continue": (with_head("Expect: 100-continue\r\n"), 200),
    "HTTP/1.0": (with_head("", "HTTP/1.0"), 200),
    "two Content-Lengths": (
        replace(b"Content-Length", b"Content-Length: 1\r\nContent-Length"),
        None,
    ),
    "same Content-Length twice": (with_head(f"Content-Length: {_LENGTH}\r\n"), None),
    # Unfinished at 16 KiB (hypercorn's bound; a whole head that came at once is read, as h11
    # reads it).
    "head over 64 KiB": (with_head(f"X-Big: {'y' * 70000}\r\n"), 431),
    "obs-fold": (with_head("X-Folded: one\r\n two\r\n"), None),
    "no Host": (replace(b"Host:", b"X-Host:"), 400),
    "GET to an API route": (lambda proxy: get(proxy, CHAT), 405),
    "not an API route": (lambda proxy: post(proxy, b"{}", path="/v1/models"), 405),
    "Upgrade": (with_head("Connection: upgrade\r\nUpgrade: h2c\r\n"), None),
    "absolute-form target": (replace(CHAT.encode(), b"http://localhost" + CHAT.encode()), None),
    "bare LF line ends": (
        lambda proxy: post(proxy, chat_body(stream=False)).replace(b"\r\n", b"\n"),
        None,
    ),
}


@pytest.mark.parametrize("case", list(NOT_PLAIN))
async def test_a_request_that_is_not_plain_is_hypercorns(
    case: str, nursery: trio.Nursery, fake: Fake, served_fast: list[str]
) -> None:
    request, status = NOT_PLAIN[case]
    with trio.fail_after(DEADLINE):
        fast, hypercorn = await fast_and_hypercorn(nursery, fake)
        fast_answers = await exchange(fast, request(fast))
        slow_answers = await exchange(hypercorn, request(hypercorn))
        assert [a.comparable() for a in fast_answers] == [a.comparable() for a in slow_answers]
        assert served_fast == []
        if status is not None:
            assert fast_answers[-1].status == status


async def test_ambiguous_framing_is_refused_and_the_connection_closed(
    nursery: trio.Nursery, proxy: Proxy, served_fast: list[str]
) -> None:
    with trio.fail_after(DEADLINE):
        raw = await connect(proxy)
        smuggled = post(proxy, chat_body(stream=False)).replace(
            b"Content-Length", b"Transfer-Encoding: chunked\r\nContent-Length", 1
        )
        await raw.stream.send_all(post(proxy, chat_body(stream=False)) + smuggled + get(proxy))
        assert (await read_answer(raw)).status == 200
        refused = await read_answer(raw)
        assert refused.status == 400
        assert refused.json()["error"]["code"] == "invalid_framing"
        assert refused.header("connection") == "close"
        assert await closed(raw)  # and the GET smuggled after it never answered
        assert served_fast == [CHAT]


async def test_a_slow_head_is_waited_for_and_a_slow_body_handed_off(
    nursery: trio.Nursery, autojump_clock: trio.abc.Clock, served_fast: list[str]
) -> None:
    """A head is waited for while the keep-alive timer runs, as hypercorn waits for it; a body
    slower than PROMPT_REQUEST_SECONDS is hypercorn's (Quart's body timeout then applies)."""
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.02, interval=0.01, tokens=5)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        request = post(proxy, chat_body())
        head_end = request.index(b"\r\n\r\n")
        for cut, fast in ((head_end // 2, True), (head_end + 10, False)):
            served_fast.clear()
            raw = await connect(proxy)
            await raw.stream.send_all(request[:cut])
            await trio.sleep(2)
            await raw.stream.send_all(request[cut:])
            answer = await read_answer(raw)
            assert answer.status == 200
            assert sse_payloads(answer.body.decode())[-1] == "[DONE]"
            assert served_fast == ([CHAT] if fast else [])


# --- connection handling -------------------------------------------------------------------


async def test_connection_close_is_answered_with_close_then_closed(
    nursery: trio.Nursery, proxy: Proxy, served_fast: list[str]
) -> None:
    with trio.fail_after(DEADLINE):
        for body in (chat_body(), chat_body(stream=False), b"not json"):
            raw = await connect(proxy)
            await raw.stream.send_all(
                post(proxy, body, headers="Connection: close\r\n") + get(proxy)
            )
            answer = await read_answer(raw)
            assert answer.header("connection") == "close"
            assert await closed(raw)  # the GET after it is not read
        assert served_fast == [CHAT] * 3


@pytest.mark.parametrize("second", ["fast path's", "hypercorn's"])
async def test_keep_alive_max_requests_counts_every_request_of_the_connection(
    second: str,
    nursery: trio.Nursery,
    fake: Fake,
    monkeypatch: pytest.MonkeyPatch,
    served_fast: list[str],
) -> None:
    # Not in Sluice's config: hypercorn's own setting, which the fast path keeps.
    monkeypatch.setattr(HypercornConfig, "keep_alive_max_requests", 2)
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        raw = await connect(proxy)
        await raw.stream.send_all(post(proxy, chat_body()))
        assert (await read_answer(raw)).header("connection") is None
        # The second request is the connection's last, whoever serves it: the count of the
        # requests before a hand-off goes with the connection.
        await raw.stream.send_all(post(proxy, b"{") if second == "fast path's" else get(proxy))
        assert (await read_answer(raw)).header("connection") == "close"
        assert await closed(raw)
        assert len(served_fast) == (2 if second == "fast path's" else 1)


async def test_an_unfinished_head_is_closed_when_hypercorn_would_close_it(
    nursery: trio.Nursery, autojump_clock: trio.abc.Clock, served_fast: list[str]
) -> None:
    """A slowloris head, begun late in the keep-alive period: hypercorn closes it when the
    period ends (its timer stops only once a whole head has come), and so does the fast path,
    whose timer runs until a whole head has come too."""
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.02, interval=0.01, tokens=5)
        fast, hypercorn = await fast_and_hypercorn(nursery, fake, server={"keep_alive_timeout": 2})
        lasted = []
        for proxy in (fast, hypercorn):
            raw = await connect(proxy)
            connected = trio.current_time()
            await trio.sleep(1.9)
            await raw.stream.send_all(post(proxy, chat_body())[:20])
            assert await closed(raw)
            lasted.append(trio.current_time() - connected)
        assert lasted[1] == pytest.approx(2.0, abs=0.05)
        assert lasted[0] == pytest.approx(lasted[1], abs=0.05), lasted
        assert served_fast == []


async def test_an_idle_connection_is_closed_after_keep_alive_timeout(
    nursery: trio.Nursery, autojump_clock: trio.abc.Clock, served_fast: list[str]
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.02, interval=0.01, tokens=5)
        proxy = await start_proxy(
            nursery, {"fake-model": [fake.url]}, server={"keep_alive_timeout": 1}
        )
        raw = await connect(proxy)
        for _ in range(2):  # before the first request, and between requests
            idle_since = trio.current_time()
            with trio.move_on_after(0.9):
                await closed(raw)
                pytest.fail("closed before keep_alive_timeout")
            await raw.stream.send_all(post(proxy, chat_body(stream=False)))
            assert (await read_answer(raw)).status == 200
            assert trio.current_time() - idle_since >= 0.9
        idle_since = trio.current_time()
        assert await closed(raw)
        assert 0.99 < trio.current_time() - idle_since < 1.1
        assert served_fast == [CHAT] * 2


async def test_graceful_shutdown_closes_idle_connections_and_finishes_streams(
    nursery: trio.Nursery, fake: Fake, monkeypatch: pytest.MonkeyPatch, served_fast: list[str]
) -> None:
    shutdown = shutdown_trigger(monkeypatch)
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        idle = await connect(proxy)
        await idle.stream.send_all(post(proxy, chat_body(stream=False)))
        assert (await read_answer(idle)).status == 200
        streaming = await connect(proxy)
        await streaming.stream.send_all(
            post(proxy, chat_body(fake={"ttft": 0, "interval": 0.05, "tokens": 20}))
        )
        await streaming.read_until(b"data: ", count=2)
        shutdown.set()
        began = trio.current_time()
        assert await closed(idle)
        assert trio.current_time() - began < 0.5  # at once, not at keep_alive_timeout
        answer = await read_answer(streaming)
        assert sse_payloads(answer.body.decode())[-1] == "[DONE]"
        assert await closed(streaming)
        assert served_fast == [CHAT] * 2


async def test_an_answer_begun_during_the_shutdown_says_connection_close(
    nursery: trio.Nursery, fake: Fake, monkeypatch: pytest.MonkeyPatch, served_fast: list[str]
) -> None:
    shutdown = shutdown_trigger(monkeypatch)
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        waiting = await connect(proxy)
        await waiting.stream.send_all(post(proxy, chat_body(fake={"ttft": 0.5})))
        await fake.recorder.wait_for(lambda r: len(r.records) == 1)
        with trio.move_on_after(0.1):
            await _receive(waiting)
        assert waiting.received == b""  # its head goes out with the first token
        shutdown.set()
        answer = await read_answer(waiting)
        assert sse_payloads(answer.body.decode())[-1] == "[DONE]"
        # The server closes the connection after this answer, and says so in it (RFC 9112
        # 9.6), as the fast path's docstring promises for a graceful shutdown.
        assert answer.header("connection") == "close"
        assert await closed(waiting)
        assert served_fast == [CHAT]


@pytest.mark.parametrize("phase", ["awaiting upstream headers", "mid-stream", "pipelined"])
async def test_a_client_that_leaves_cancels_its_request(
    phase: str, nursery: trio.Nursery, fake: Fake, proxy: Proxy, served_fast: list[str]
) -> None:
    """The fast path's own watch for the client's leaving (a task waiting for its EOF, and
    the loop's hangup watcher); pipelined: with the next request's bytes unread in front of
    the EOF, which that task cannot see past."""
    streaming = {"ttft": 0, "interval": 0.02, "tokens": 1000}
    override = {"mode": "stall_headers"} if phase.startswith("awaiting") else streaming
    with trio.fail_after(DEADLINE):
        raw = await connect(proxy)
        request = post(proxy, chat_body(fake=override))
        await raw.stream.send_all(request + (request if phase == "pipelined" else b""))
        await fake.recorder.wait_for(lambda r: len(r.records) == 1)
        if override is streaming:
            await raw.read_until(b"data: ", count=3)
        else:
            await trio.sleep(0.05)
        assert served_fast == [CHAT]
        closed_at = await raw.close()
        await assert_request_gone(proxy, fake, closed_at)


async def test_a_stalled_reader_is_reset_after_stall_timeout(
    nursery: trio.Nursery, served_fast: list[str]
) -> None:
    stall_timeout = 1.0
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=200_000, sndbuf=4096)
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            relay={"channel_capacity": 4, "stall_timeout": stall_timeout},
            upstream={"socket_rcvbuf": 4096},
        )
        raw = await RawClient.post(proxy, CHAT, chat_body(), rcvbuf=4096)
        await raw.read_until(b"data: ", count=3)
        stopped_reading = trio.current_time()
        assert served_fast == [CHAT]
        await fake.recorder.wait_for(lambda r: r.last().disconnected_at is not None)
        await proxy.state.tracker.wait_idle()
        assert stall_timeout <= trio.current_time() - stopped_reading < stall_timeout + 3
        assert proxy.state.tracker.stalled == 1
        with pytest.raises(trio.BrokenResourceError):  # reset, not closed
            while await raw.stream.receive_some(65536):
                pass


async def test_with_the_fast_path_off_hypercorn_serves_everything(
    nursery: trio.Nursery, fake: Fake, served_fast: list[str]
) -> None:
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]}, server={"fast_path": False})
        answers = await exchange(
            proxy, post(proxy, chat_body()), post(proxy, chat_body(stream=False)), post(proxy, b"{")
        )
        assert [answer.status for answer in answers] == [200, 200, 400]
        assert sse_payloads(answers[0].body.decode())[-1] == "[DONE]"
        await poll_until(lambda: not proxy.state.tracker.active)
        assert served_fast == []
