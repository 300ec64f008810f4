"""ZeroMQ sockets on trio's event loop, with no thread: what the KV-event subscriber
(:mod:`proxy.backends.upstream.kv_events`) and the fake vLLM publisher
(:mod:`proxy.testing.kv_events`) both read with.

A socket is non-blocking and polled through its ``zmq.FD`` with
``trio.lowlevel.wait_readable``, not read in a thread. A thread blocked in ``recv`` cannot be
cancelled (it would need a poll timeout, and a thread per socket held for its life); on the
event loop, a cancelled reader is gone at once, with its socket. The FD is edge-triggered: it
signals that the socket's state *may* have changed, once. So every wake-up drains the socket
with ``zmq.NOBLOCK`` until ``zmq.Again``, and the task waits on the FD again only once
``zmq.EVENTS`` says nothing is readable (reading ``EVENTS`` also processes what arrived
meanwhile, which re-arms the edge). The FD is libzmq's: ``notify_closing`` before the close.
"""

from __future__ import annotations

import trio
import zmq


async def receive(socket: zmq.Socket[bytes]) -> list[bytes]:
    """The next multipart message of a non-blocking ``socket``, waiting on its FD."""
    fd = _int_option(socket, zmq.FD)
    while True:
        try:
            frames: list[bytes] = socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            pass
        else:
            return frames
        # Edge-triggered: wait only when EVENTS (which processes what is pending) says no
        # message is there; otherwise the edge has passed and the wait would never end.
        if not _int_option(socket, zmq.EVENTS) & zmq.POLLIN:
            await trio.lowlevel.wait_readable(fd)


def _int_option(socket: zmq.Socket[bytes], option: int) -> int:
    value = socket.getsockopt(option)
    assert isinstance(value, int)
    return value


def close(socket: zmq.Socket[bytes]) -> None:
    """Close ``socket`` at once (linger 0), telling trio its FD goes first."""
    if socket.closed:
        return
    trio.lowlevel.notify_closing(_int_option(socket, zmq.FD))
    socket.close(linger=0)
