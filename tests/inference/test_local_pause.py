"""The local backend's pause at the request level, with the engine's thread held between two
steps: a stream asked to pause again just after its request asked to resume it, before the
engine has taken that resume, gives its slot up again, and once resumed ends whole (the text of
an uninterrupted run), its slot given back and nothing of it left in the engine."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import trio

from proxy.ops.logs import ACCESS_LOGGER
from tests.model_fixtures import smol_tokenizer, tiny_loaded_model
from tests.support import (
    DEADLINE,
    RawClient,
    access_lines,
    chat_body,
    chunked_body,
    local_model,
    poll_until,
    slowed,
    sse_payloads,
    start_proxy,
    stream_text,
)

__all__ = ["smol_tokenizer", "tiny_loaded_model"]

CHAT = "/v1/chat/completions"
# One decode step of the slowed tiny model: a stream of TOKENS lasts a fraction of a second.
STEP = 0.01
TOKENS = 40
# Where the engine stops itself in a stream (Gate.hold_at), so that the stream is still
# running when the test asks its pause, however slow the machine; more than the 4 tokens the
# test reads before it asks.
HOLD_AT = 10


def body() -> dict[str, Any]:
    return chat_body(
        "tiny",
        messages=[{"role": "user", "content": "Tell me about the sea."}],
        max_tokens=TOKENS,
        ignore_eos=True,
    )


async def read_to_the_end(client: RawClient) -> str:
    await client.read_until(b"data: [DONE]")
    await client.read_until(b"\r\n0\r\n\r\n")
    return chunked_body(client.received)


def text_of(stream: str) -> str:
    return stream_text(sse_payloads(stream.replace(": paused\n\n", "")))


class Gate:
    """What every engine step passes through (``lock``): held, the engine stops between two
    steps. After ``hold_at(tokens)``, the engine takes the lock itself after the step that
    gives a running stream its ``tokens``-th token; the test waits for that (``held``), and
    lets it go on with ``release``."""

    def __init__(self, engine: Any) -> None:
        self.lock = threading.Lock()
        self.engine = engine
        self._hold_at: int | None = None
        self._held = threading.Event()

    def step(self, step: Any) -> None:
        # Bounded: a test that fails with the gate shut must not hold the engine's thread,
        # which the server's shutdown waits for.
        entered = self.lock.acquire(timeout=DEADLINE)
        try:
            step()
        finally:
            if entered:
                self.lock.release()
        at = self._hold_at
        # The engine's running rows: read in its own thread, between two steps.
        if at is not None and any(seq.produced >= at for seq in self.engine._rows):
            self._hold_at = None
            if self.lock.acquire(timeout=DEADLINE):
                self._held.set()

    def hold_at(self, tokens: int) -> None:
        self._held.clear()
        self._hold_at = tokens

    async def held(self) -> None:
        await poll_until(self._held.is_set)

    def release(self) -> None:
        self._held.clear()
        self.lock.release()


async def gated_proxy(
    nursery: trio.Nursery, tiny_loaded_model: Any, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, list[Any], Gate]:
    """A proxy serving the slowed tiny model in one slot; the pause each admitted stream
    registers (what the dispatcher would ask), and the gate every engine step passes
    through."""
    proxy = await start_proxy(
        nursery,
        {"tiny": local_model(slots=1)},
        local_models={"tiny": slowed(tiny_loaded_model, STEP)},
    )
    local = proxy.state.local_backends["tiny"]
    engine = local.engine
    dispatcher = local.admission.dispatcher
    pausables: list[Any] = []
    track = dispatcher.track

    def tracked(*args: Any, **kwargs: Any) -> None:
        if kwargs.get("pause") is not None:
            pausables.append(kwargs["pause"])
        track(*args, **kwargs)

    gate = Gate(engine)
    step = engine.step

    def gated_step() -> None:
        gate.step(step)

    monkeypatch.setattr(dispatcher, "track", tracked)
    monkeypatch.setattr(engine, "step", gated_step)
    return proxy, pausables, gate


async def test_a_stream_paused_again_before_its_resume_is_taken_gives_its_slot_up_and_ends_whole(
    nursery: trio.Nursery,
    tiny_loaded_model: Any,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    proxy, pausables, gate = await gated_proxy(nursery, tiny_loaded_model, monkeypatch)
    local = proxy.state.local_backends["tiny"]
    engine = local.engine
    # The gate held from the first resume until the test has asked its pause: the engine
    # cannot take that resume before the pause comes.
    held = [False]
    resume = engine.resume
    resumed = [trio.Event(), trio.Event()]

    def held_resume(sequence: Any) -> None:
        if not resumed[0].is_set():
            gate.lock.acquire()
            held[0] = True
        resume(sequence)
        (resumed[1] if resumed[0].is_set() else resumed[0]).set()

    monkeypatch.setattr(engine, "resume", held_resume)
    try:
        with trio.fail_after(DEADLINE):
            alone = await RawClient.post(proxy, CHAT, body())
            uninterrupted = text_of(await read_to_the_end(alone))
            gate.hold_at(HOLD_AT)
            client = await RawClient.post(proxy, CHAT, body())
            await client.read_until(b'"content":"', 4)
            await gate.held()
            held[0] = True
            pausable = pausables[-1]
            assert pausable.ask()
            gate.release()
            held[0] = False
            # Paused: its request gave the slot up, took it back at once (nothing waits for
            # it), and asked to resume; the engine's next step waits at the gate.
            await resumed[0].wait()
            await client.read_until(b": paused")
            assert pausable.ask()
            gate.lock.release()
            held[0] = False
            # The second pause is noticed too: its request gives the slot up once more, and
            # resumes again.
            await resumed[1].wait()
            stream = await read_to_the_end(client)
            await proxy.state.tracker.wait_idle()
    finally:
        if held[0]:
            gate.lock.release()
    assert stream.count(": paused\n\n") >= 2 and text_of(stream) == uninterrupted
    [line] = [line for line in access_lines(caplog) if line["pauses"]]
    assert line["pauses"] == 2 and line["outcome"] == "completed"
    assert engine.sequences == 0 and engine.paused_kv_bytes == 0
    assert local.room.in_flight == 0 and local.admission.waiting == 0
    # Its stream over, it declines: no notice could come any more.
    assert not pausable.ask()


async def test_a_pause_withdrawn_before_the_engine_takes_it_leaves_the_stream_running(
    nursery: trio.Nursery,
    tiny_loaded_model: Any,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The request a stream was asked to pause for got another slot first: the pause is
    withdrawn while the engine is between two steps, and the stream runs on, never paused;
    a pause left to the engine goes ahead."""
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    proxy, pausables, gate = await gated_proxy(nursery, tiny_loaded_model, monkeypatch)
    local = proxy.state.local_backends["tiny"]
    engine = local.engine
    held = False
    try:
        with trio.fail_after(DEADLINE):
            gate.hold_at(HOLD_AT)
            client = await RawClient.post(proxy, CHAT, body())
            await client.read_until(b'"content":"', 4)
            pausable = pausables[-1]
            # Between two steps: asked, then withdrawn before the engine could take it.
            await gate.held()
            held = True
            assert pausable.ask()
            assert pausable.withdraw()
            gate.release()
            held = False
            stream = await read_to_the_end(client)
            # Asked, and left to the engine: it pauses (its client is told), and withdrawing
            # then changes nothing. (Whether a pause a step has taken can be withdrawn is
            # test_pause.py's: here the request may have asked to resume already.)
            gate.hold_at(HOLD_AT)
            late = await RawClient.post(proxy, CHAT, body())
            await late.read_until(b'"content":"', 4)
            await gate.held()
            held = True
            assert pausables[-1].ask()
            gate.release()
            held = False
            await late.read_until(b": paused")
            assert not pausables[-1].withdraw()
            late_stream = await read_to_the_end(late)
            await proxy.state.tracker.wait_idle()
    finally:
        if held:
            gate.release()
    assert ": paused" not in stream and text_of(stream) == text_of(late_stream)
    first, second = access_lines(caplog)
    assert (first["pauses"], first["outcome"]) == (0, "completed")
    assert (second["pauses"], second["outcome"]) == (1, "completed")
    assert engine.sequences == 0 and local.room.in_flight == 0
