"""Guards in the request's nursery (relay/guarded.py), under virtual time: a scripted producer
(its head after T seconds, then one event per interval, recording what it made and when it
was stopped) inside a real RelayBody, read as the server's writer reads it. What each stage
holds, when the client gets what, and that a refusal stops the producer within one event."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing

from proxy.guards import Outcome, OutputVerdict, Prompt, Refusal, Stage, Window
from proxy.guards.window import read_chunk
from proxy.ops.logs import AccessRecord
from proxy.protocol.responses import ResponsesStream
from proxy.protocol.shapes import RESPONSES
from proxy.relay.body import SSE_CONTENT_TYPE, RelayBody
from proxy.relay.guarded import AfterHooks, Guard, GuardObserver, RequestGuards, guarded_producer
from proxy.relay.state import Phase

DONE = b"data: [DONE]\n\n"


def chat(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"delta": {"content": text}}]}).encode() + b"\n\n"


class Script:
    """A producer: ``first`` seconds to its head, then ``words`` one per ``interval``."""

    def __init__(self, words: list[str], first: float = 0.5, interval: float = 0.1) -> None:
        self.words = words
        self.first = first
        self.interval = interval
        self.made = 0
        self.stopped_at_made: int | None = None
        self.aborted_at_made: int | None = None

    async def __call__(self, sink: Any) -> None:
        sink.set_phase(Phase.CONNECTING)
        sink.on_disconnect(self.abort)
        try:
            await trio.sleep(self.first)
            sink.set_phase(Phase.FIRST_TOKEN)
            sink.begin(200, SSE_CONTENT_TYPE)
            for word in self.words:
                self.made += 1
                event = chat(word)
                if not sink.offer(event):
                    await sink.send(event)
                await trio.sleep(self.interval)
            await sink.send(DONE)
        except trio.Cancelled:
            self.stopped_at_made = self.made
            raise

    def abort(self) -> None:
        if self.aborted_at_made is None:
            self.aborted_at_made = self.made


def guard(
    stage: Stage,
    call: Callable[[Any], Awaitable[Any]],
    *,
    window: int = 4,
    overlap: int = 3,
    hold_back: int = 4,
    after: bool = True,
    timeout: float = 60.0,
    deny: bool = True,
) -> Guard:
    return Guard(f"g-{stage}", stage, call, timeout, deny, {}, window, overlap, hold_back, after)


def plan(
    *guards: Guard, access: AccessRecord | None = None, endpoint: str = "chat"
) -> RequestGuards:
    context = Prompt("", "prompt", "r1", endpoint, "m", None, {}, "a prompt")
    return RequestGuards(
        tuple(g for g in guards if g.stage == "prompt"),
        tuple(g for g in guards if g.stage == "output"),
        context,
        GuardObserver(None, access),
    )


async def read(body: RelayBody) -> list[tuple[float, bytes]]:
    """What the client got, and when (trio's clock)."""
    got = []
    async with body:
        async for chunk in body:
            if chunk:
                got.append((trio.current_time(), chunk))
    return got


def body_of(script: Script, guards: RequestGuards, access: AccessRecord | None = None) -> RelayBody:
    return RelayBody(
        guarded_producer(script, guards),
        streaming=True,
        channel_capacity=16,
        stall_timeout=60,
        description="t",
        access=access,
    )


def text(got: list[tuple[float, bytes]]) -> str:
    return "".join(read_chunk(chunk).text for _, chunk in got)


def access_record() -> AccessRecord:
    return AccessRecord("r1", "POST", "/v1/chat/completions", "-", 0.0)


def regex(pattern: str) -> Callable[[Window], Awaitable[Refusal | None]]:
    compiled = re.compile(pattern)

    async def check(window: Window) -> Refusal | None:
        if compiled.search(window.text):
            return Refusal("no secrets here", reason="secret")
        return None

    return check


async def test_a_secret_split_across_three_events_is_refused_before_any_of_it_is_sent(
    autojump_clock: trio.abc.Clock,
) -> None:
    words = ["The ", "code ", "is ", "SEC", "RET-", "42", " and ", "more ", "words ", "here"]
    script = Script(words)
    access = access_record()
    seen_made: list[int] = []

    async def secret(window: Window) -> Refusal | None:
        if re.search(r"SECRET-\d+", window.text):
            seen_made.append(script.made)
            return Refusal("no secrets here", reason="secret")
        return None

    got = await read(body_of(script, plan(guard("output", secret), access=access), access))
    sent = b"".join(chunk for _, chunk in got)
    assert b"SEC" not in sent and b"RET-" not in sent and b"42" not in sent
    # "The " passed with the first window ("The code is SEC"); its last three tokens, the
    # overlap, were held for the second window, which refused.
    assert text(got) == "The "
    # Ended with the in-band error, no [DONE].
    assert b'"code":"guard_refused"' in got[-1][1]
    assert not sent.endswith(DONE)
    # The upstream was shut in the verdict's step, and the producer stopped with it.
    assert script.aborted_at_made == seen_made[0]
    assert script.stopped_at_made is not None and script.stopped_at_made - seen_made[0] <= 1
    assert access.guard == "g-output" and access.guard_reason == "secret"
    # Every token made but "The " was kept from the client: held at the verdict (the
    # overlap and the refused window) or made after it. Sent + for nobody = made.
    sent_tokens = sum(read_chunk(chunk).tokens for _, chunk in got)
    assert sent_tokens == 1
    assert access.guard_waste == script.stopped_at_made - sent_tokens


async def test_release_after_sends_a_window_once_it_passed_and_the_whole_answer_at_its_end(
    autojump_clock: trio.abc.Clock,
) -> None:
    words = [f"w{i} " for i in range(10)]
    script = Script(words, first=0.5, interval=0.1)

    async def slow_pass(window: Window) -> None:
        await trio.sleep(0.05)

    got = await read(body_of(script, plan(guard("output", slow_pass, overlap=1)), None))
    assert text(got) == "".join(words)
    assert got[-1][1].endswith(DONE)
    # The first text went out once its window (4 tokens) closed and passed: the head at 0.5
    # s, four tokens 0.1 s apart, and the check's 0.05 s; one token (the overlap) held.
    first_at, first = got[0]
    assert first_at == pytest.approx(0.5 + 0.3 + 0.05)
    assert read_chunk(first).text == "w0 w1 w2 "


async def test_release_before_sends_at_once_and_a_refusal_cuts_what_follows(
    autojump_clock: trio.abc.Clock,
) -> None:
    words = [f"w{i} " for i in range(12)]
    script = Script(words, first=0.5, interval=0.1)
    got = await read(body_of(script, plan(guard("output", regex("w5"), after=False)), None))
    # The first token went out as it came.
    assert got[0][0] == pytest.approx(0.5)
    assert "w5" in text(got) and "w8" not in text(got)
    assert b"guard_refused" in got[-1][1]


@pytest.mark.parametrize(("checking", "first_byte"), [(1.0, 0.4), (0.2, 0.4)])
async def test_a_prompt_guard_adds_only_what_it_takes_beyond_the_first_byte(
    autojump_clock: trio.abc.Clock, checking: float, first_byte: float
) -> None:
    started: list[float] = []

    async def judge(prompt: Prompt) -> None:
        started.append(trio.current_time())
        await trio.sleep(checking)

    script = Script(["a ", "b "], first=first_byte, interval=0.0)
    begun = trio.current_time()
    got = await read(body_of(script, plan(guard("prompt", judge)), None))
    # Beside the upstream from its dispatch: TTFT = T + max(0, L - T), not T + L.
    assert started == [begun]
    assert got[0][0] - begun == pytest.approx(first_byte + max(0.0, checking - first_byte))
    assert text(got) == "a b "


async def test_a_refused_prompt_closes_the_upstream_before_its_first_byte_is_released(
    autojump_clock: trio.abc.Clock,
) -> None:
    async def refuse_late(prompt: Prompt) -> Refusal:
        await trio.sleep(0.7)
        return Refusal("not this prompt", status=403, code="prompt_refused")

    script = Script([f"t{i} " for i in range(20)], first=0.4, interval=0.1)
    access = access_record()
    body = body_of(script, plan(guard("prompt", refuse_late, hold_back=8), access=access), access)
    got = await read(body)
    # Nothing of the answer went out: the refusal is the HTTP answer.
    assert body.status == 403
    (only,) = got
    assert json.loads(only[1])["error"]["code"] == "prompt_refused"
    # The upstream sent tokens from 0.4 s; at the verdict (0.7 s) it had made 3 or 4.
    assert script.aborted_at_made is not None and script.aborted_at_made <= 4
    assert script.stopped_at_made == script.aborted_at_made
    # What it had made was held for the verdict and never sent: all of it for nobody.
    assert access.guard_waste == script.stopped_at_made


async def test_the_hold_back_bounds_what_a_slow_prompt_guard_holds(
    autojump_clock: trio.abc.Clock,
) -> None:
    async def slow(prompt: Prompt) -> None:
        await trio.sleep(5)

    script = Script([f"t{i} " for i in range(50)], first=0.1, interval=0.01)
    body = body_of(script, plan(guard("prompt", slow, hold_back=6)), None)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(read, body)
        await trio.sleep(2)
        # The producer waits (the upstream is not read) once 6 events are held.
        assert script.made == 7
        await trio.sleep(4)
        assert script.made == 50


async def test_a_guard_that_hangs_is_bounded_by_its_timeout_and_on_error_decides(
    autojump_clock: trio.abc.Clock,
) -> None:
    async def hangs(window: Window) -> None:
        await trio.sleep_forever()

    allowed = Script(["a ", "b "], first=0.1, interval=0.1)
    got = await read(body_of(allowed, plan(guard("output", hangs, timeout=0.5, deny=False)), None))
    assert text(got) == "a b "
    denied = Script(["a ", "b "], first=0.1, interval=0.1)
    body = body_of(denied, plan(guard("output", hangs, timeout=0.5)), None)
    got = await read(body)
    assert body.status == 503
    assert json.loads(got[0][1])["error"]["code"] == "guard_unavailable"


async def test_a_client_that_leaves_cancels_its_guards(autojump_clock: trio.abc.Clock) -> None:
    cancelled: list[str] = []

    async def waits(prompt: Prompt) -> None:
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            cancelled.append("prompt")
            raise

    script = Script(["a "] * 5, first=0.1)
    body = body_of(script, plan(guard("prompt", waits)), None)
    with trio.move_on_after(1):
        await read(body)
    body.client_disconnected()
    assert cancelled == ["prompt"]
    assert script.stopped_at_made is not None


class PausedScript(Script):
    """A stream paused after ``paused_after`` words for ``pause`` seconds, a keep-alive comment
    offered at its start and every second, as the scheduler's pause does."""

    def __init__(self, words: list[str], paused_after: int, pause: float) -> None:
        super().__init__(words, first=0.1, interval=0.1)
        self.paused_after = paused_after
        self.pause = pause
        self.comments_offered: list[float] = []

    async def __call__(self, sink: Any) -> None:
        sink.set_phase(Phase.CONNECTING)
        await trio.sleep(self.first)
        sink.begin(200, SSE_CONTENT_TYPE)
        for index, word in enumerate(self.words):
            if index == self.paused_after:
                sink.set_phase(Phase.PAUSED)
                with trio.move_on_after(self.pause):
                    while True:
                        self.comments_offered.append(trio.current_time())
                        sink.offer(b": paused\n\n")
                        await trio.sleep(1)
                sink.set_phase(Phase.MID_STREAM)
            event = chat(word)
            if not sink.offer(event):
                await sink.send(event)
            await trio.sleep(self.interval)
        await sink.send(DONE)


@pytest.mark.parametrize("stage", ["prompt", "output"])
async def test_a_paused_streams_keep_alive_reaches_the_client_while_the_answer_is_held(
    autojump_clock: trio.abc.Clock, stage: Stage
) -> None:
    # The output guard keeps its last window's overlap held while the stream is paused; the
    # prompt guard (its verdict at 3 s, from the dispatch) holds everything until then, in
    # the middle of the pause (0.3 s to 10.3 s).
    words = [f"w{i} " for i in range(8)]
    script = PausedScript(words, paused_after=2, pause=10.0)

    async def slow_pass(context: Any) -> None:
        await trio.sleep(3.0 if stage == "prompt" else 0.0)

    got = await read(body_of(script, plan(guard(stage, slow_pass, window=2, overlap=1)), None))
    comments = [(at, chunk) for at, chunk in got if chunk.startswith(b":")]
    assert text(got) == "".join(words)
    assert got[-1][1].endswith(DONE)
    if stage == "output":
        # Each comment went out as it was offered, none held for a next window, and the
        # answer's order is kept around them.
        assert [at for at, _ in comments] == script.comments_offered
    else:
        # Before the prompt's verdict the head is not out: those comments are dropped (they
        # cannot precede the head); the later ones go at once.
        verdict_at = 3.0
        assert [at for at, _ in comments] == [
            at for at in script.comments_offered if at > verdict_at
        ]
    assert all(chunk == b": paused\n\n" for _, chunk in comments), (got, script.comments_offered)


@pytest.mark.parametrize("overlap", [0, 1, 3])
@pytest.mark.parametrize("at", [0, 2, 5, 9])
async def test_a_rewrite_in_any_window_sends_each_token_once(
    autojump_clock: trio.abc.Clock, overlap: int, at: int
) -> None:
    # A window's freed chunks begin with the previous window's overlap and end before its
    # own: the rewritten text must neither repeat the overlap nor lose it, in whichever
    # window the rewrite falls, the last included.
    words = [f"w{i} " for i in range(12)]
    words[at] = "bob@example.com "

    async def redact(window: Window) -> str | None:
        if "@" not in window.new_text:
            return None
        return re.sub(r"\S+@\S+", "[email]", window.new_text)

    script = Script(words, first=0.1, interval=0.1)
    guards = plan(guard("output", redact, window=4, overlap=overlap))
    got = await read(body_of(script, guards, None))
    assert text(got) == "".join(words).replace("bob@example.com", "[email]")
    assert got[-1][1].endswith(DONE)


class ResponsesScript(Script):
    """A Responses stream (the local model's shaping, as OpenAI numbers it): its opening
    events, one delta per word, its closing events."""

    async def __call__(self, sink: Any) -> None:
        stream = ResponsesStream(model="m", response_id="resp_1", created_at=0)
        sink.set_phase(Phase.CONNECTING)
        sink.on_disconnect(self.abort)
        await trio.sleep(self.first)
        sink.begin(200, SSE_CONTENT_TYPE)
        await sink.send(stream.start())
        for word in self.words:
            self.made += 1
            event = stream.text(word)
            if not sink.offer(event):
                await sink.send(event)
            await trio.sleep(self.interval)
        await sink.send(stream.finish("stop", 3, len(self.words)))


def sequence_numbers(got: list[tuple[float, bytes]]) -> list[tuple[str, int]]:
    """Each event's type and sequence number, as the client read them."""
    numbered = []
    for _, chunk in got:
        for line in chunk.split(b"\n"):
            if line.startswith(b"data:"):
                data = json.loads(line[5:])
                numbered.append((data["type"], data["sequence_number"]))
    return numbered


@pytest.mark.parametrize("verdict", ["pass", "rewrite", "refuse"])
async def test_responses_events_stay_numbered_in_order_through_held_windows(
    autojump_clock: trio.abc.Clock, verdict: str
) -> None:
    words = [f"w{i} " for i in range(12)]

    async def judge(window: Window) -> OutputVerdict:
        if verdict == "rewrite":
            return window.new_text.upper()
        if verdict == "refuse" and window.index == 2:
            return Refusal("no", reason="third window")
        return None

    script = ResponsesScript(words, first=0.1, interval=0.1)
    body = RelayBody(
        guarded_producer(
            script, plan(guard("output", judge, window=3, overlap=1), endpoint="responses")
        ),
        streaming=True,
        channel_capacity=16,
        stall_timeout=60,
        description="t",
        errors=RESPONSES,
    )
    got = await read(body)
    numbered = sequence_numbers(got)
    numbers = [number for _, number in numbered]
    # Strictly increasing from 0, whatever was held, rewritten or dropped.
    assert numbers[0] == 0 and all(a < b for a, b in itertools.pairwise(numbers))
    if verdict == "refuse":
        # Held events were dropped at the refusal: the error follows the last one the client
        # got, not the upstream's next (nor 0).
        assert numbered[-1][0] == "error"
        assert numbers[-1] == numbers[-2] + 1
    else:
        # Every event went out, numbered as made (a rewrite keeps each event).
        assert numbers == list(range(len(numbers)))
        assert numbered[-1][0] == "response.completed"
        expected = "".join(words).upper() if verdict == "rewrite" else "".join(words)
        assert text(got) == expected
        # The closing events repeat the text as the deltas gave it, not as it was made.
        closing = json.loads(got[-1][1].split(b"data: ")[-1])
        assert closing["response"]["output"][0]["content"][0]["text"] == expected
        events = b"".join(chunk for _, chunk in got)
        for kind in (b"response.output_text.done", b"response.content_part.done"):
            assert kind in events
        if verdict == "rewrite":
            assert b"w1 " not in events


async def test_an_output_guard_may_rewrite_what_the_client_gets(
    autojump_clock: trio.abc.Clock,
) -> None:
    async def redact(window: Window) -> str:
        return re.sub(r"\S+@\S+", "[email]", window.new_text)

    script = Script(["write ", "to ", "bob@", "example.com ", "today"], first=0.1)
    got = await read(body_of(script, plan(guard("output", redact, window=8, overlap=0)), None))
    assert text(got) == "write to [email] today"


async def test_after_hooks_run_in_the_servers_nursery_and_the_drain_bounds_them(
    autojump_clock: trio.abc.Clock,
) -> None:
    seen: list[tuple[str, float]] = []

    async def record(outcome: Outcome) -> None:
        await trio.sleep(outcome.duration)
        seen.append((outcome.request_id, trio.current_time()))

    hooks = AfterHooks(None, limit=2)
    hook = guard("after", record)

    def outcome(request_id: str, seconds: float) -> Outcome:
        return Outcome(
            "",
            request_id,
            "chat",
            "m",
            None,
            200,
            "completed",
            1,
            2,
            0,
            False,
            None,
            None,
            seconds,
            None,
        )

    async with trio.open_nursery() as nursery:
        await nursery.start(hooks.run)
        hooks.submit([hook], outcome("quick", 1.0))
        hooks.submit([hook], outcome("slow", 100.0))
        hooks.submit([hook], outcome("dropped", 0.0))  # over the bound of 2
        assert hooks.running == 2
        await hooks.drain(trio.current_time() + 10)
        # The drain waited for the quick one, then cancelled the slow one at its deadline.
        assert [name for name, _ in seen] == ["quick"]
        assert seen[0][1] == pytest.approx(1.0)
        assert trio.current_time() == pytest.approx(10.0)
        hooks.submit([hook], outcome("late", 0.0))  # after the drain: dropped
        assert hooks.running == 0
