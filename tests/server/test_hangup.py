"""proxy/hangup.py: the loop's own epoll set of client sockets, polled between scheduler batches
and, on a saturated loop, between task steps, so that a client's FIN or reset reaches its relay
without waiting for the connection's read task to be scheduled.

The HangupWatcher unit tests need no trio loop: ``poll()`` is called by hand, on socketpairs
(a close is visible to the peer before ``close()`` returns) and on TCP pairs over 127.0.0.1
port 0 where TCP is the point (a FIN, a FIN behind unread bytes, a half-close, a reset). Then
the watcher inside trio: installed by ``watching()`` (one per server), polling after each wait
for I/O and whenever a watched socket hangs up (its own task waits on its epoll set), and,
while the loop is saturated, between task steps. Last, through a real proxy: the client's
socket is watched exactly while its stream is relayed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable, Iterator
from traceback import walk_stack

import h2.exceptions
import httpx
import pytest
import trio

from proxy.server import hangup
from proxy.server.connection_server import ConnectionServer
from proxy.server.hangup import HangupWatcher
from tests.support import DEADLINE, Fake, Proxy, RawClient, chat_body, poll_until, start_proxy

pytestmark = pytest.mark.skipif(not hangup.available(), reason="the watcher needs epoll (Linux)")

CHAT = "/v1/chat/completions"


class Hook:
    """A hangup callback that counts its calls and records who called it (the qualified names
    of the frames above it: the watcher's after_io_wait, or its per-step hook)."""

    def __init__(self, *, fail: bool = False) -> None:
        self.calls = 0
        self.callers: list[set[str]] = []
        self.fail = fail

    def __call__(self) -> None:
        self.calls += 1
        self.callers.append({frame.f_code.co_qualname for frame, _ in walk_stack(None)})
        if self.fail:
            raise RuntimeError("a broken hangup callback")


SocketPair = tuple[socket.socket, socket.socket]


@pytest.fixture
def watcher() -> Iterator[HangupWatcher]:
    """A watcher outside any trio loop: only ``poll()`` runs its callbacks."""
    watcher = HangupWatcher()
    yield watcher
    watcher.close()


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    """Every socket a test opens, closed at its end (filterwarnings = error: a socket left to
    the GC fails a later test). Closing one twice is harmless."""
    opened: list[socket.socket] = []
    yield opened
    for sock in opened:
        sock.close()


def unix_pair(opened: list[socket.socket]) -> SocketPair:
    """(watched end, peer)."""
    pair = socket.socketpair()
    opened.extend(pair)
    return pair


def tcp_pair(opened: list[socket.socket]) -> SocketPair:
    """(the accepted end, as the proxy holds a client's connection; the client), on 127.0.0.1."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(DEADLINE)
        client = socket.create_connection(listener.getsockname(), timeout=DEADLINE)
        opened.append(client)
        accepted, _ = listener.accept()
        opened.append(accepted)
    return accepted, client


def poll_watcher_until(watcher: HangupWatcher, predicate: Callable[[], bool]) -> None:
    """Poll by hand until ``predicate``: over TCP the kernel may process a loopback FIN or RST
    a moment after the peer's ``close()`` returned (softirq), so a single poll could be early."""
    deadline = time.monotonic() + DEADLINE
    while True:
        watcher.poll()
        if predicate():
            return
        assert time.monotonic() < deadline, "no hangup seen"
        time.sleep(0.001)


def still_registered(watcher: HangupWatcher) -> list[int]:
    """The fds the kernel's epoll set reports now. A hung-up socket left in the set would be
    reported by every poll from then on (level-triggered), a silent cost on every batch."""
    return [fd for fd, _ in watcher._epoll.poll(0)]


# ------------------------------------------------------------------------ the watcher alone


@pytest.mark.parametrize("make_pair", [unix_pair, tcp_pair], ids=["socketpair", "tcp-fin"])
def test_a_peer_close_runs_the_callback_once_and_leaves_the_set(
    watcher: HangupWatcher,
    sockets: list[socket.socket],
    make_pair: Callable[[list[socket.socket]], SocketPair],
) -> None:
    watched, peer = make_pair(sockets)
    hook = Hook()
    watcher.watch(watched.fileno(), hook)
    assert watcher.watched == 1
    watcher.poll()
    assert hook.calls == 0  # an open, idle connection is not a hangup
    peer.close()
    poll_watcher_until(watcher, lambda: hook.calls > 0)
    assert hook.calls == 1
    assert watcher.watched == 0
    # Out of the kernel's set as well as the dict: the socket (still open on our side, as the
    # proxy's is until its read task gets there) is not reported again.
    assert still_registered(watcher) == []
    watcher.poll()
    assert hook.calls == 1


def test_a_peer_reset_runs_the_callback(
    watcher: HangupWatcher, sockets: list[socket.socket]
) -> None:
    accepted, client = tcp_pair(sockets)
    hook = Hook()
    watcher.watch(accepted.fileno(), hook)
    # SO_LINGER on, timeout 0: close() sends a RST instead of a FIN.
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()
    poll_watcher_until(watcher, lambda: hook.calls > 0)
    assert hook.calls == 1
    assert watcher.watched == 0
    # It was a reset (not a FIN): the test covers the EPOLLHUP/EPOLLERR path.
    with pytest.raises(ConnectionResetError):
        accepted.recv(1)


def test_a_half_close_counts_as_leaving(
    watcher: HangupWatcher, sockets: list[socket.socket]
) -> None:
    # EPOLLRDHUP is the peer's FIN, whether or not it still reads: the same as the read task's
    # EOF, which has always counted as the client leaving.
    accepted, client = tcp_pair(sockets)
    hook = Hook()
    watcher.watch(accepted.fileno(), hook)
    client.shutdown(socket.SHUT_WR)
    poll_watcher_until(watcher, lambda: hook.calls > 0)
    assert hook.calls == 1


def test_unread_data_is_not_a_hangup(watcher: HangupWatcher, sockets: list[socket.socket]) -> None:
    accepted, client = tcp_pair(sockets)
    hook = Hook()
    watcher.watch(accepted.fileno(), hook)
    client.sendall(b"GET / HTTP/1.1\r\n\r\n")
    # The bytes have arrived (readable), and nobody reads them: still no hangup.
    assert select.select([accepted], [], [], DEADLINE)[0] == [accepted]
    for _ in range(3):
        watcher.poll()
    assert hook.calls == 0
    assert watcher.watched == 1
    # A FIN queued behind the unread bytes is seen at once: the client has left, whatever it
    # sent before.
    client.close()
    poll_watcher_until(watcher, lambda: hook.calls > 0)
    assert hook.calls == 1


def test_unwatch_before_the_close_means_no_callback(
    watcher: HangupWatcher, sockets: list[socket.socket]
) -> None:
    watched, peer = unix_pair(sockets)
    hook = Hook()
    watcher.watch(watched.fileno(), hook)
    watcher.unwatch(watched.fileno(), hook)
    assert watcher.watched == 0
    peer.close()
    watcher.poll()
    assert hook.calls == 0
    assert still_registered(watcher) == []  # unregistered from the kernel's set too


def test_unwatch_with_another_callback_keeps_the_newer_registration(
    watcher: HangupWatcher, sockets: list[socket.socket]
) -> None:
    # The same fd registered twice (the second through epoll's modify): the first owner's late
    # unwatch must not take the second registration away.
    watched, peer = unix_pair(sockets)
    old, new = Hook(), Hook()
    watcher.watch(watched.fileno(), old)
    watcher.watch(watched.fileno(), new)
    assert watcher.watched == 1
    late_unwatch_leaves_the_new_registration(watcher, watched.fileno(), old, new, peer)


def late_unwatch_leaves_the_new_registration(
    watcher: HangupWatcher, fd: int, old: Hook, new: Hook, new_peer: socket.socket
) -> None:
    """The old owner's unwatch of ``fd`` comes after ``new`` registered it: the new
    registration stays, and only it fires when its peer closes."""
    watcher.unwatch(fd, old)
    assert watcher.watched == 1
    new_peer.close()
    watcher.poll()
    assert (old.calls, new.calls) == (0, 1)
    assert watcher.watched == 0


def test_a_reused_fd_number_belongs_to_its_new_socket(
    watcher: HangupWatcher, sockets: list[socket.socket]
) -> None:
    # A connection closed while still watched (its relay_ended not run yet); the kernel drops
    # it from the epoll set, and its number comes back for the next socket.
    first, _ = unix_pair(sockets)
    number = first.fileno()
    old = Hook()
    watcher.watch(number, old)
    first.close()
    second, second_peer = unix_pair(sockets)
    # POSIX gives the lowest free number: the test depends on the reuse it means to test.
    assert number in (second.fileno(), second_peer.fileno())
    if second_peer.fileno() == number:
        second, second_peer = second_peer, second
    # The stale entry runs nothing for the new socket, and does not stop it being watched.
    watcher.poll()
    assert old.calls == 0
    new = Hook()
    watcher.watch(number, new)
    assert watcher.watched == 1
    late_unwatch_leaves_the_new_registration(watcher, number, old, new, second_peer)


def test_unwatch_after_the_socket_closed_is_quiet(
    watcher: HangupWatcher, sockets: list[socket.socket]
) -> None:
    # relay_ended after the connection's socket was closed: the kernel dropped it already (the
    # unregister fails, EBADF), and nothing is left behind.
    watched, _ = unix_pair(sockets)
    number = watched.fileno()
    hook = Hook()
    watcher.watch(number, hook)
    watched.close()
    watcher.unwatch(number, hook)
    assert watcher.watched == 0
    watcher.poll()
    assert hook.calls == 0


def test_a_failing_callback_is_logged_and_the_others_still_run(
    watcher: HangupWatcher, sockets: list[socket.socket], caplog: pytest.LogCaptureFixture
) -> None:
    hooks = [Hook(), Hook(fail=True), Hook()]
    peers = []
    for hook in hooks:
        watched, peer = unix_pair(sockets)
        watcher.watch(watched.fileno(), hook)
        peers.append(peer)
    for peer in peers:
        peer.close()
    with caplog.at_level(logging.ERROR, logger="sluice.hangup"):
        watcher.poll()  # raises nothing: a hook on the trio thread must not break the loop
    assert [hook.calls for hook in hooks] == [1, 1, 1]
    (record,) = caplog.records
    assert record.getMessage() == "hangup callback failed"
    assert record.exc_info is not None and record.exc_info[0] is RuntimeError
    # The failing one is gone from the set like the others: not retried on every poll.
    assert watcher.watched == 0
    watcher.poll()
    assert [hook.calls for hook in hooks] == [1, 1, 1]


# -------------------------------------------------------------------------- inside trio


class HookCounter:
    """Counts the calls of one of a watcher's instrument hooks (trio looks the hook up on the
    instrument at each call, so an instance attribute takes its place)."""

    def __init__(self, watcher: HangupWatcher, name: str) -> None:
        self.calls = 0
        original = getattr(watcher, name)

        def counted(*args: object) -> None:
            self.calls += 1
            original(*args)

        setattr(watcher, name, counted)


async def quiet(watcher: HangupWatcher) -> None:
    """Checkpoints until the per-step hook is off: a watcher installs it in its first batch
    (no batch measured yet), and a loaded machine may stretch a batch past the interval."""
    while True:
        if not watcher._stepping:
            return
        await trio.lowlevel.checkpoint()


@pytest.fixture
def served_watchers(monkeypatch: pytest.MonkeyPatch) -> list[HangupWatcher]:
    """The watcher of every server started from now on (each server has its own), in order."""
    made: list[HangupWatcher] = []
    original = hangup.watching

    @contextlib.asynccontextmanager
    async def recording(
        interval: float | None = None, busy_batch: float | None = None
    ) -> AsyncIterator[HangupWatcher | None]:
        async with original(interval, busy_batch) as watcher:
            if watcher is not None:
                made.append(watcher)
            yield watcher

    monkeypatch.setattr(hangup, "watching", recording)
    return made


async def test_watching_installs_a_watcher_and_removes_it() -> None:
    with trio.fail_after(DEADLINE):
        async with hangup.watching() as watcher:
            assert watcher is not None
            io_waits = HookCounter(watcher, "after_io_wait")
            async with hangup.watching() as other:
                assert other is not None and other is not watcher  # one per server
            assert other._epoll.closed and not watcher._epoll.closed
            await trio.lowlevel.checkpoint()
            assert io_waits.calls > 0  # installed: the loop calls it
        # Out of the loop and closed: no hook runs any more.
        seen = io_waits.calls
        for _ in range(3):
            await trio.lowlevel.checkpoint()
        assert io_waits.calls == seen
        assert watcher._epoll.closed


async def test_a_hangup_wakes_an_idle_loop(sockets: list[socket.socket]) -> None:
    # Nothing else runs or waits for I/O: without the watcher's own task waiting on its epoll
    # set, the close would be seen when something next woke the loop (here: a minute).
    with trio.fail_after(DEADLINE):
        async with hangup.watching() as watcher:
            assert watcher is not None
            watched, peer = unix_pair(sockets)
            heard = trio.Event()
            watcher.watch(watched.fileno(), heard.set)
            await quiet(watcher)
            closed_at = trio.current_time()
            peer.close()
            with trio.move_on_after(60):
                await heard.wait()
            assert heard.is_set()
            assert trio.current_time() - closed_at < 0.5
            assert watcher.watched == 0


async def test_unread_data_does_not_wake_the_watchers_task(sockets: list[socket.socket]) -> None:
    # A pipelined byte is not a hangup: the task waits on, and the close after it is heard.
    with trio.fail_after(DEADLINE):
        async with hangup.watching() as watcher:
            assert watcher is not None
            watched, peer = unix_pair(sockets)
            hook = Hook()
            watcher.watch(watched.fileno(), hook)
            peer.send(b"x")
            await trio.sleep(0.05)
            assert hook.calls == 0 and watcher.watched == 1
            peer.close()
            await poll_until(lambda: hook.calls == 1)


async def test_a_hangup_is_acted_on_after_the_next_io_wait(sockets: list[socket.socket]) -> None:
    # Nobody reads the socket: the watcher's poll after trio's wait for I/O sees the close,
    # before any task runs in the next batch (polling after every wait: interval 0).
    with trio.fail_after(DEADLINE):
        async with hangup.watching(interval=0) as watcher:
            assert watcher is not None
            watched, peer = unix_pair(sockets)
            hook = Hook()
            watcher.watch(watched.fileno(), hook)
            await quiet(watcher)
            await trio.lowlevel.checkpoint()
            assert hook.calls == 0
            peer.close()
            await trio.lowlevel.checkpoint()  # to the next batch, through one wait for I/O
            assert hook.calls == 1
            assert "HangupWatcher.after_io_wait" in hook.callers[0]
            assert watcher.watched == 0
            for _ in range(3):
                await trio.lowlevel.checkpoint()
            assert hook.calls == 1


# 30 tasks of 2 ms each: every scheduler batch lasts at least 60 ms, a saturated loop in
# miniature.
HOGS = 30
HOG_STEP = 0.002
# From the close to the callback with the per-step hook: microseconds, plus whatever a loaded
# machine adds; well under a batch.
STEP_BOUND = 0.02


class Saturation:
    """What the hogs saw: steps run in all, the longest batch, and the close (when, after how
    many steps, and whether the per-step hook was in)."""

    def __init__(self) -> None:
        self.steps = 0
        self.closed_at = 0.0
        self.closed_after = -1
        self.stepping_at_close = False
        self.batch_began = 0.0
        self.batch_seconds = 0.0


async def saturate_then_close(
    watcher: HangupWatcher,
    peer: socket.socket,
    hook: Hook,
    seen: Saturation,
    *,
    wait_for_stepper: bool,
) -> None:
    """Runs the hogs until ``hook`` has been called, counting in ``seen``. Every hog steps
    once a batch (a checkpoint's task is rescheduled for the next), in no set order; whichever
    runs a batch's middle step closes ``peer`` at its end, once two whole batches have run (one
    measured) and, if asked, the per-step hook is in."""
    stop = False

    async def hog() -> None:
        while not stop:
            began = time.perf_counter()
            end = began + HOG_STEP
            while time.perf_counter() < end:
                pass
            seen.steps += 1
            if seen.steps % HOGS == 1:  # a batch's first step
                seen.batch_began = began
            elif seen.steps % HOGS == 0:  # and its last
                seen.batch_seconds = max(seen.batch_seconds, end - seen.batch_began)
            ready = seen.steps > 2 * HOGS and (watcher._stepping or not wait_for_stepper)
            if seen.steps % HOGS == HOGS // 2 and seen.closed_after < 0 and ready:
                seen.stepping_at_close = watcher._stepping
                peer.close()
                seen.closed_at = time.perf_counter()
                seen.closed_after = seen.steps
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        for _ in range(HOGS):
            nursery.start_soon(hog)
        while not hook.calls:
            await trio.lowlevel.checkpoint()
        stop = True


async def test_a_hangup_is_seen_between_task_steps_on_a_saturated_loop(
    sockets: list[socket.socket],
) -> None:
    with trio.fail_after(DEADLINE):
        async with hangup.watching() as watcher:
            assert watcher is not None
            watched, peer = unix_pair(sockets)
            hook = Hook()
            fired: list[tuple[float, int]] = []
            seen = Saturation()

            def on_hangup() -> None:
                fired.append((time.perf_counter(), seen.steps))
                hook()

            watcher.watch(watched.fileno(), on_hangup)
            await quiet(watcher)
            await saturate_then_close(watcher, peer, hook, seen, wait_for_stepper=True)
            ((fired_at, fired_after),) = fired
            assert seen.batch_seconds >= HOGS * HOG_STEP  # saturated, as meant
            # The long batches put the per-step hook in; with it, the close was seen before the
            # next task step, in mid-batch, not after the rest of the batch.
            assert seen.stepping_at_close
            assert "HangupWatcher.step" in hook.callers[0]
            assert fired_after == seen.closed_after  # not one more hog step in between
            assert fired_at - seen.closed_at < STEP_BOUND, fired_at - seen.closed_at
            # The hogs gone, short batches take the per-step hook out again.
            await quiet(watcher)
            steps = HookCounter(watcher, "step")
            # A preempted batch on a loaded machine puts the hook back in for STEPPING_HOLD: try
            # for several of those before calling it stuck.
            give_up = time.perf_counter() + 20 * hangup.STEPPING_HOLD
            while True:
                before = steps.calls
                await trio.lowlevel.checkpoint()
                # A whole batch with no step call: the hook is out.
                if not watcher._stepping and steps.calls == before:
                    break
                if time.perf_counter() > give_up:
                    pytest.fail("the per-step hook stayed in on a quiet loop")


async def test_without_the_per_step_hook_a_hangup_waits_for_the_batch(
    sockets: list[socket.socket],
) -> None:
    # The contrast that gives the test above its meaning: with a busy threshold no batch
    # reaches, the per-step hook never goes in, and the same close is only seen after the
    # batch's remaining hogs have run (about half of them).
    with trio.fail_after(DEADLINE):
        async with hangup.watching(interval=0, busy_batch=3600) as watcher:
            assert watcher is not None
            watched, peer = unix_pair(sockets)
            seen = Saturation()
            fired: list[int] = []
            hook = Hook()

            def on_hangup() -> None:
                fired.append(seen.steps)
                hook()

            watcher.watch(watched.fileno(), on_hangup)
            await quiet(watcher)
            await saturate_then_close(watcher, peer, hook, seen, wait_for_stepper=False)
            assert not seen.stepping_at_close
            assert "HangupWatcher.after_io_wait" in hook.callers[0]
            (fired_after,) = fired
            # The rest of the batch (every hog steps once a batch) ran first.
            assert fired_after == seen.closed_after + (HOGS - HOGS // 2)


# ------------------------------------------------------------------- through a real proxy


async def send_request(raw: RawClient, proxy: Proxy, body: dict[str, object]) -> None:
    """Another request on the same (keep-alive) connection."""
    host, port = proxy.host_port
    payload = json.dumps(body).encode()
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    await raw.stream.send_all(head + payload)


def watched_connection(watcher: HangupWatcher) -> tuple[int, ConnectionServer]:
    """The one registration, and the connection server it calls."""
    ((fd, callback),) = watcher._callbacks.items()
    server = getattr(callback, "__self__", None)
    assert isinstance(server, ConnectionServer)
    return fd, server


async def test_a_relayed_stream_watches_its_client_until_it_ends(
    nursery: trio.Nursery, fake: Fake, served_watchers: list[HangupWatcher]
) -> None:
    # Streams of 0.2 s, looked at a few tokens in: the proxy, the fake upstream and this test
    # share one loop, so a loaded machine slows all three alike.
    body = chat_body(fake={"ttft": 0, "interval": 0.005, "tokens": 40})
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        (watcher,) = served_watchers  # serve() installed it
        assert watcher.watched == 0
        raw = await RawClient.post(proxy, CHAT, body)
        # Two requests on one keep-alive connection: the same socket is watched again for the
        # second stream once the first one's registration has gone.
        for request in (1, 2):
            if request == 2:
                await send_request(raw, proxy, body)
            await raw.read_until(b"data: ", count=raw.received.count(b"data: ") + 3)
            assert raw.received.count(b"data: [DONE]") == request - 1  # mid-stream
            assert watcher.watched == 1
            fd, server = watched_connection(watcher)
            # The proxy's end of this client's connection.
            client_socket = raw.stream.socket
            assert server.stream.socket.getpeername() == client_socket.getsockname()
            assert server.stream.socket.fileno() == fd
            await raw.read_until(b"data: [DONE]", count=request)
            # Unwatched as the relay ends (just after its last bytes went out).
            await poll_until(lambda: watcher.watched == 0)
        await proxy.state.tracker.wait_idle()
        assert watcher.watched == 0


async def test_a_client_leaving_mid_stream_leaves_nothing_watched(
    nursery: trio.Nursery, fake: Fake, served_watchers: list[HangupWatcher]
) -> None:
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        (watcher,) = served_watchers
        raw = await RawClient.post(
            proxy, CHAT, chat_body(fake={"ttft": 0, "interval": 0.02, "tokens": 1000})
        )
        await raw.read_until(b"data: ", count=3)
        assert watcher.watched == 1
        await raw.close()
        await fake.recorder.wait_for(lambda r: r.last().disconnected_at is not None)
        assert fake.recorder.last().outcome == "client_disconnected"
        await proxy.state.tracker.wait_idle()
        await poll_until(lambda: watcher.watched == 0)
        # And it stays so: nothing re-registers the closed connection's socket.
        await trio.sleep(0.05)
        assert watcher.watched == 0


async def test_long_batches_with_nothing_watched_leave_the_per_step_hook_out() -> None:
    # The hook costs every task step a call; with no client to watch there is nothing to gain.
    with trio.fail_after(DEADLINE):
        async with hangup.watching() as watcher:
            assert watcher is not None
            await quiet(watcher)

            async def hog() -> None:
                end = time.perf_counter() + 3 * HOG_STEP
                while time.perf_counter() < end:
                    pass
                await trio.lowlevel.checkpoint()

            for _ in range(3):
                async with trio.open_nursery() as nursery:
                    for _ in range(5):
                        nursery.start_soon(hog)
                assert not watcher._stepping


async def test_a_watch_the_kernel_refuses_leaves_the_request_to_the_read_task(
    nursery: trio.Nursery,
    fake: Fake,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    served_watchers: list[HangupWatcher],
) -> None:
    # epoll's limits (max_user_watches) must not fail a request: it streams, unwatched, and
    # the read task still sees its client go.
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        (watcher,) = served_watchers

        def refuse(fd: int, on_hangup: Callable[[], None]) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(watcher, "watch", refuse)
        with caplog.at_level(logging.WARNING, logger="sluice.connection_server"):
            raw = await RawClient.post(
                proxy, CHAT, chat_body(fake={"ttft": 0, "interval": 0.02, "tokens": 1000})
            )
            await raw.read_until(b"data: ", count=3)
        assert raw.received.startswith(b"HTTP/1.1 200")
        assert watcher.watched == 0
        assert any("not watched for hangups" in r.getMessage() for r in caplog.records)
        await raw.close()
        await fake.recorder.wait_for(lambda r: r.last().disconnected_at is not None)
        assert fake.recorder.last().outcome == "client_disconnected"
        await proxy.state.tracker.wait_idle()


async def test_http2_streams_are_not_watched_and_still_end_with_their_client(
    nursery: trio.Nursery, fake: Fake, served_watchers: list[HangupWatcher]
) -> None:
    # HTTP/2 multiplexes streams on one connection, whose server keeps a single disconnect
    # hook: a short stream ending would have taken a long one's hook and watch with it. So
    # HTTP/2 relays are left to quart-trio's cancellation, which sees the connection close.
    short = chat_body(fake={"ttft": 0, "interval": 0.005, "tokens": 5})
    long = chat_body(fake={"ttft": 0, "interval": 0.01, "tokens": 100_000})
    versions: list[str] = []
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        (watcher,) = served_watchers
        client = httpx.AsyncClient(http1=False, http2=True, timeout=DEADLINE, trust_env=False)
        long_started = trio.Event()

        async def stream_long() -> None:
            # The client's own close ends this read: httpx's error, or, when the close lands
            # between two of httpcore's reads, h2's own (httpcore lets it through).
            with contextlib.suppress(httpx.HTTPError, h2.exceptions.ProtocolError):
                async with client.stream("POST", proxy.url + CHAT, json=long) as response:
                    versions.append(response.http_version)
                    async for _ in response.aiter_bytes():
                        long_started.set()

        async with trio.open_nursery() as streams:
            streams.start_soon(stream_long)
            await long_started.wait()
            assert watcher.watched == 0  # an HTTP/1.1 stream would be watched by now
            response = await client.post(proxy.url + CHAT, json=short)
            versions.append(response.http_version)
            assert b"data: [DONE]" in response.content
            assert watcher.watched == 0
            assert len(proxy.state.tracker.active) == 1  # the long one streams on
            await client.aclose()  # the client leaves: its connection closes
        assert versions == ["HTTP/2", "HTTP/2"]
        await fake.recorder.wait_for(
            lambda r: any(rec.outcome == "client_disconnected" for rec in r.records)
        )
        await proxy.state.tracker.wait_idle()
