"""A request's way in: hypercorn's body messages put without a checkpoint
(connection_server.AppTaskGroup), the waiting ones taken at once and the handler run in the
request's own task (asgi.RelayHTTPConnection), a whole body read without waiting
(asgi.SluiceRequest). Each saved scheduler turn is a wait behind every other ready stream."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import httpx
import hypercorn.trio
import hypercorn.trio.tcp_server as hypercorn_tcp_server
import pytest
import trio
import trio.testing
from hypercorn.config import Config as HypercornConfig
from werkzeug.datastructures import Headers

from proxy import asgi as asgi_module
from proxy import connection_server
from proxy.asgi import SluiceBody, SluiceRequest, take_waiting_messages
from proxy.connection_server import AppTaskGroup, _put_at_once

from .support import Fake, Proxy, RawClient, chat_body, poll_until, producer_tasks


def checkpoints_of(task: trio.lowlevel.Task) -> int:
    return task._cancel_points + task._schedule_points


def request_message(body: bytes, *, more: bool) -> dict[str, Any]:
    return {"type": "http.request", "body": body, "more_body": more}


def stand_in_request() -> Any:
    """What take_waiting_messages uses of a request: its body."""
    return SimpleNamespace(body=SluiceBody(None, None))


async def test_put_at_once_takes_no_checkpoint_while_there_is_room() -> None:
    send, receive = trio.open_memory_channel[Any](2)
    task = trio.lowlevel.current_task()
    before = checkpoints_of(task)
    await _put_at_once(send, "body")
    await _put_at_once(send, "end")
    assert checkpoints_of(task) == before
    assert [receive.receive_nowait(), receive.receive_nowait()] == ["body", "end"]


async def test_put_at_once_waits_for_room_when_the_app_is_behind() -> None:
    send, receive = trio.open_memory_channel[Any](1)
    await _put_at_once(send, "first")
    done: list[str] = []

    async def put_second() -> None:
        await _put_at_once(send, "second")
        done.append("second")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(put_second)
        await trio.testing.wait_all_tasks_blocked()
        assert done == []  # the queue is full: it waits, as hypercorn's own put would
        assert await receive.receive() == "first"
        await trio.testing.wait_all_tasks_blocked()
        assert done == ["second"]
    assert receive.receive_nowait() == "second"


def test_install_puts_the_app_task_group_in_hypercorn() -> None:
    connection_server.install()
    assert hypercorn_tcp_server.TaskGroup is AppTaskGroup


def test_install_leaves_a_task_group_it_does_not_know(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class Unknown:
        pass

    monkeypatch.setattr(hypercorn_tcp_server, "TaskGroup", Unknown)
    with caplog.at_level(logging.WARNING, logger="sluice.connection_server"):
        connection_server.install()
    assert hypercorn_tcp_server.TaskGroup is Unknown
    assert "task group is not the expected one" in caplog.text


async def test_a_request_in_one_read_is_whole_when_the_app_first_runs(
    nursery: trio.Nursery,
) -> None:
    # Through hypercorn itself: what the app's first step finds queued in its receive channel.
    connection_server.install()
    queued: list[int] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        queued.append(receive.__self__.statistics().current_buffer_used)
        while (await receive())["more_body"]:
            pass
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = config.errorlog = None
    binds = await nursery.start(hypercorn.trio.serve, app, config)
    host, port = urlsplit(binds[0]).hostname, urlsplit(binds[0]).port
    assert host is not None and port is not None
    stream = await trio.open_tcp_stream(host, port)
    client = RawClient(stream)
    try:
        # One write, as most clients send a small request (httpx: two, head then body).
        await stream.send_all(
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 8\r\n\r\n" + b'{"x": 1}'
        )
        await client.read_until(b"\r\n\r\n")
    finally:
        await stream.aclose()
    assert client.received.startswith(b"HTTP/1.1 204")
    # The body and its end: hypercorn's put took a scheduler turn after each, so the app could
    # run between them.
    assert queued == [2]


def test_waiting_messages_make_the_body_whole_and_leave_the_rest() -> None:
    send, receive = trio.open_memory_channel[Any](10)
    for message in (
        request_message(b'{"a":', more=True),
        request_message(b" 1}", more=False),
        {"type": "http.disconnect"},
    ):
        send.send_nowait(message)
    request = stand_in_request()
    assert take_waiting_messages(request, receive.receive)
    assert request.body.whole == b'{"a": 1}'
    # A disconnect after the body is for handle_messages, which cancels the request.
    assert receive.statistics().current_buffer_used == 1


def test_a_body_still_arriving_is_left_to_handle_messages() -> None:
    send, receive = trio.open_memory_channel[Any](10)
    send.send_nowait(request_message(b'{"a":', more=True))
    request = stand_in_request()
    assert take_waiting_messages(request, receive.receive)
    assert not request.body.complete
    assert request.body.whole is None


def test_a_client_gone_before_its_body_ended_is_not_answered() -> None:
    send, receive = trio.open_memory_channel[Any](10)
    send.send_nowait(request_message(b'{"a":', more=True))
    send.send_nowait({"type": "http.disconnect"})
    assert not take_waiting_messages(stand_in_request(), receive.receive)


def test_another_servers_receive_is_left_alone() -> None:
    taken: list[str] = []

    async def receive() -> dict[str, Any]:
        taken.append("called")
        return request_message(b"", more=False)

    request = stand_in_request()
    assert take_waiting_messages(request, receive)
    assert taken == []
    assert not request.body.complete


def make_request(*, max_content_length: int | None = None, length: int = 8) -> SluiceRequest:
    headers = Headers({"Content-Length": str(length)})
    scope: Any = {"type": "http"}

    async def no_push(path: str, headers: Headers) -> None:
        raise AssertionError("no push promises here")

    return SluiceRequest(
        "POST",
        "http",
        "/v1/chat/completions",
        b"",
        headers,
        "",
        "1.1",
        scope,
        max_content_length=max_content_length,
        send_push_promise=no_push,
    )


async def test_read_body_takes_a_whole_body_without_a_checkpoint() -> None:
    request = make_request()
    request.body.set_result(b'{"a": 1}')
    task = trio.lowlevel.current_task()
    before = checkpoints_of(task)
    assert await request.read_body() == b'{"a": 1}'
    assert checkpoints_of(task) == before
    assert request.body.whole == b""  # not cached, as get_data(cache=False)


async def test_read_body_waits_for_a_body_still_arriving() -> None:
    request = make_request()
    request.body.append(b'{"a":')
    got: list[bytes] = []

    async def read() -> None:
        got.append(await request.read_body())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []
        request.body.append(b" 1}")
        request.body.set_complete()
    assert got == [b'{"a": 1}']


async def test_read_body_refuses_a_body_over_the_limit() -> None:
    # Content-Length over the limit: quart's 413, raised by get_data, not a whole body.
    request = make_request(max_content_length=4, length=8)
    request.body.set_complete()
    with pytest.raises(Exception, match="Request Entity Too Large"):
        await request.read_body()


async def test_the_handler_runs_in_the_task_that_took_the_messages(
    proxy: Proxy, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    takers: list[trio.lowlevel.Task] = []
    handlers: list[trio.lowlevel.Task] = []
    take = asgi_module.take_waiting_messages

    def recording_take(request: Any, receive: Any) -> bool:
        takers.append(trio.lowlevel.current_task())
        return take(request, receive)

    monkeypatch.setattr(asgi_module, "take_waiting_messages", recording_take)
    # The route's handler reads its body here; record which task does.
    read_body = SluiceRequest.read_body

    async def recording_read_body(self: SluiceRequest) -> bytes:
        handlers.append(trio.lowlevel.current_task())
        return await read_body(self)

    monkeypatch.setattr(SluiceRequest, "read_body", recording_read_body)
    response = await client.post(f"{proxy.url}/v1/chat/completions", json=chat_body())
    assert response.status_code == 200
    assert "[DONE]" in response.text
    assert len(takers) == 1
    assert handlers == takers


async def test_a_client_that_leaves_mid_body_leaves_nothing_behind(
    fake: Fake, proxy: Proxy, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    host, port = proxy.host_port
    stream = await trio.open_tcp_stream(host, port)
    await stream.send_all(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        'Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{"model":'.encode()
    )
    await trio.sleep(0.05)
    await stream.aclose()
    # The server is unharmed: the next request is answered.
    response = await client.post(f"{proxy.url}/v1/chat/completions", json=chat_body())
    assert response.status_code == 200
    await poll_until(lambda: not proxy.state.tracker.active)
    assert producer_tasks() == []
    assert proxy.state.tracker.started == 1  # only the second request's relay
    assert len(fake.recorder.records) == 1
    assert "Error in ASGI" not in caplog.text


async def test_a_body_sent_in_pieces_still_reaches_the_handler(proxy: Proxy, fake: Fake) -> None:
    payload = json.dumps(chat_body()).encode()
    host, port = proxy.host_port
    stream = await trio.open_tcp_stream(host, port)
    try:
        await stream.send_all(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
            + payload[:10]
        )
        await trio.sleep(0.05)  # the app has started, with part of the body
        await stream.send_all(payload[10:])
        client = RawClient(stream)
        await client.read_until(b"[DONE]")
    finally:
        await stream.aclose()
    assert b"HTTP/1.1 200" in client.received
    assert len(fake.recorder.records) == 1
