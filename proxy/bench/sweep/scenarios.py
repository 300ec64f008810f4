"""The sweep's scenarios: one request each, through a Sluice configured for it.

A scenario is data: the config (its models' upstreams say ``"fake:"``, the in-process fake), the
fake's settings, the request, and what it needs (the tiny local model, a redis-server). What
differs in how a scenario runs (a request that holds the only slot first, an urgent request
that pauses this one) is an :class:`Around`: started before the swept request, in the sweep's
nursery, and awaited after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from proxy.api.auth import hash_key
from proxy.bench.sweep.client import Request
from proxy.bench.sweep.extras import LIMITED_KEY

if TYPE_CHECKING:
    import trio

    from proxy.bench.sweep.rig import Rig

PATHS = {
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
    "embeddings": "/v1/embeddings",
    "ws": "/v1/ws",
}
# Every scenario's answer from the fake: few tokens, so that a run has few checkpoints, each
# a little apart so that the relay waits between them as it does in life.
TOKENS = 4
FAKE = {"ttft": 0.0, "interval": 0.002, "tokens": TOKENS}
SECRET = "sk-sweep"
BUDGETED = "sk-sweep-budgeted"
LIMITED = "sk-sweep-limited"
# The preempted scenario: its stream is of a less urgent band, and an urgent request that waits
# this long for the replica's only slot pauses it.
BATCH_BAND = 5
PREEMPT_AFTER = 0.003

# Started before the swept request (in the sweep's nursery), awaited once it is done: the work a
# scenario puts beside its request (a holder of the only slot, an urgent request).
Around = Callable[["Rig", "trio.Nursery"], Awaitable[Callable[[], Awaitable[None]]]]


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    endpoint: str = "chat"
    stream: bool = True
    model: str = "fake-model"
    # Extra fields of the request's body (a per-request "fake" override among them).
    extra: dict[str, Any] = field(default_factory=dict)
    bearer: str = SECRET
    config: dict[str, Any] = field(default_factory=dict)
    fake: dict[str, Any] = field(default_factory=lambda: dict(FAKE))
    local: bool = False
    redis: bool = False
    around: Around | None = None
    # What an uncut run's access line says: "completed", an error code, or None: whatever the
    # warm-up's said (not a cancellation), for an upstream that fails on purpose.
    ending: str | None = "completed"
    # Which server paths it runs on.
    servers: tuple[bool, ...] = (True, False)
    # How its runs end early: the client leaves (``close``, ``fin``), or the request's
    # deadline expires (``deadline``: the rig's clock jumps past it at the cut).
    endings: tuple[str, ...] = ("close", "fin")

    @property
    def hedged(self) -> bool:
        """Whether a second attempt may race the first (a model with ``hedge_after``)."""
        return any("hedge_after" in table for table in self.config.get("models", {}).values())

    @property
    def transport(self) -> str:
        """The upstream transport its replicas are reached by (``lean`` or ``httpx``)."""
        upstream = self.config.get("upstream", {})
        return "httpx" if upstream.get("transport") == "httpx" else "lean"

    def request(self, request_id: str, *, deadline: float | None = None) -> Request:
        body: dict[str, Any]
        if self.endpoint in ("chat", "ws"):
            body = {"messages": [{"role": "user", "content": "hello there"}]}
        elif self.endpoint in ("responses", "embeddings"):
            body = {"input": "hello there"}
        else:
            body = {"max_tokens": 64, "messages": [{"role": "user", "content": "hello there"}]}
        body = {"model": self.model, **body, **self.extra}
        if self.endpoint not in ("embeddings", "ws"):
            body["stream"] = self.stream
        headers = {"Authorization": f"Bearer {self.bearer}", "X-Request-ID": request_id}
        if deadline is not None:
            headers["X-Sluice-Deadline"] = f"{deadline:g}"
        return Request(PATHS[self.endpoint], body, headers, websocket=self.endpoint == "ws")

    def configured(self) -> dict[str, Any]:
        """The config mapping: the scenario's, over one fake model and the sweep's keys."""
        config: dict[str, Any] = {
            "models": {"fake-model": {"upstreams": ["fake:"]}},
            "keys": [
                {"name": "sweep", "sha256": hash_key(SECRET)},
                {
                    "name": "budgeted",
                    "sha256": hash_key(BUDGETED),
                    "tokens_per_minute": 1_000_000,
                    "max_concurrent_streams": 4,
                },
                {
                    "name": LIMITED_KEY,
                    "sha256": hash_key(LIMITED),
                    "requests_per_minute": 1_000_000,
                    "tokens_per_minute": 1_000_000,
                    "max_concurrent_streams": 4,
                },
            ],
            # One connection per replica: a slot or a connection leaked by a run makes the
            # next run wait, and fail.
            "upstream": {"max_connections": 1, "queue_timeout": 5},
        }
        for section, table in self.config.items():
            if isinstance(table, dict) and isinstance(config.get(section), dict):
                config[section] = {**config[section], **table}
            else:
                config[section] = table
        return config


async def hold_the_room(rig: Rig, nursery: trio.Nursery) -> Callable[[], Awaitable[None]]:
    """A request that holds the replica's only slot for a while (a stream of 20 tokens, 2 ms
    apart), read to its end by a task of the sweep: the swept request waits in Sluice's queue
    behind it, then runs."""
    import trio

    from proxy.bench.sweep.answers import whole
    from proxy.bench.sweep.client import SweepClient

    holder = SweepClient()
    body = Scenario("holder", "", extra={"fake": {"tokens": 20}}).request("sweep-holder")
    started = trio.Event()
    done = trio.Event()

    records = len(rig.fake.recorder.records)

    async def hold() -> None:
        try:
            await holder.send(*rig.address, body)
            await rig.fake.recorder.wait_for(
                lambda r: len(r.records) > records and r.records[records].tokens_sent > 0
            )
            started.set()
            await holder.read_until(whole)
        finally:
            holder.close()
            started.set()
            done.set()

    nursery.start_soon(hold, name="sweep holder")
    await started.wait()

    async def after() -> None:
        await done.wait()

    return after


async def urgent_once_streaming(rig: Rig, nursery: trio.Nursery) -> Callable[[], Awaitable[None]]:
    """An urgent request (band 0), sent once the swept stream (of band BATCH_BAND) has had two
    tokens from the fake: it waits for the replica's only slot, pauses the swept stream after
    PREEMPT_AFTER, is answered, and the swept stream is continued. Not sent if the swept
    request ends (or its client leaves) before it streams."""
    import trio

    from proxy.bench.sweep.answers import whole
    from proxy.bench.sweep.client import SweepClient
    from proxy.bench.sweep.rig import POLL

    records = len(rig.fake.recorder.records)
    swept_over = trio.Event()
    done = trio.Event()

    def streaming() -> bool:
        fresh = rig.fake.recorder.records[records:]
        return bool(fresh) and fresh[0].tokens_sent >= 2

    async def urgent() -> None:
        client = SweepClient()
        try:
            while not streaming():
                if swept_over.is_set():
                    return
                await trio.sleep(POLL)
            body = Scenario("urgent", "").request("sweep-urgent")
            await client.send(*rig.address, body)
            await client.read_until(whole)
        finally:
            client.close()
            done.set()

    nursery.start_soon(urgent, name="sweep urgent")

    async def after() -> None:
        swept_over.set()
        await done.wait()

    return after


def guard(stage: str, *, refuse: bool = False, **table: Any) -> dict[str, Any]:
    """A ``[[guards]]`` table: the sweep's waiting guard at ``stage`` (it sleeps 3 ms, so that a
    cut can land while it works), refusing or not."""
    return {
        "name": f"sweep-{stage}",
        "use": "proxy.bench.sweep.guards:waiting",
        "stage": stage,
        **table,
        "options": {"seconds": 0.003, "refuse": refuse},
    }


# Output guards see the fake's 4 tokens in windows of 2 (overlapping by 1): each window is
# checked while the stream runs, not once at its end.
WINDOWS: dict[str, Any] = {"window_tokens": 2, "overlap_tokens": 1, "hold_back_tokens": 2}


def _scenarios() -> list[Scenario]:
    hedged = {"upstreams": ["fake:", "fake-localhost:"], "hedge_after": 0.001}
    two = {"upstreams": ["fake:", "fake-localhost:"]}
    # Where a deadline can expire at every step: a stream, a whole answer, one queued first.
    deadline = ("close", "fin", "deadline")
    upstream = [
        Scenario("chat-stream", "a streamed chat completion", endings=deadline),
        Scenario(
            "chat-whole", "a chat completion answered whole (JSON)", stream=False, endings=deadline
        ),
        Scenario("responses-stream", "a streamed Responses API answer", endpoint="responses"),
        Scenario("messages-stream", "a streamed Anthropic Messages answer", endpoint="messages"),
        Scenario("embeddings", "an embeddings request (a whole JSON answer)", "embeddings", False),
        Scenario(
            "websocket",
            "a chat over the WebSocket (/v1/ws): the handshake, then one message; the client "
            "leaves by dropping its TCP connection, or with a close frame",
            endpoint="ws",
            endings=("close", "close-frame"),
        ),
        Scenario(
            "budgeted",
            "a streamed chat of a key with a token budget (reserved, then settled)",
            bearer=BUDGETED,
        ),
        Scenario(
            "queued",
            "a streamed chat queued behind a request holding the replica's only slot",
            around=hold_the_room,
            endings=deadline,
        ),
        Scenario(
            "hedged",
            "a streamed chat hedged after 1 ms on a second replica (the fake's first token "
            "comes after 5 ms): the first to stream wins, the other is cancelled",
            config={"models": {"fake-model": hedged}},
            fake={**FAKE, "ttft": 0.005},
        ),
        Scenario(
            "retried",
            "a streamed chat whose every attempt gets 503 from the upstream: retried once on "
            "the other replica, then answered 503",
            # Never ejected: every run tries both replicas.
            config={"models": {"fake-model": two}, "upstream": {"failure_threshold": 1_000_000}},
            extra={"fake": {"mode": "status", "status": 503}},
            ending="upstream_http_error",
        ),
        Scenario(
            "preempted",
            "a streamed chat of a batch band (12 tokens) paused by an urgent request once it "
            "streams, then continued",
            extra={"priority": BATCH_BAND, "fake": {"tokens": 12}},
            config={"scheduling": {"preempt_after": PREEMPT_AFTER}},
            around=urgent_once_streaming,
        ),
        Scenario(
            "redis-limited",
            "a streamed chat of a key whose request rate, streams and tokens a redis-server "
            "counts (leases and reservations there)",
            bearer=LIMITED,
            redis=True,
        ),
        Scenario(
            "retried-answered",
            "a streamed chat whose first attempt gets 503: retried on the other replica, "
            "which answers",
            config={"models": {"fake-model": two}, "upstream": {"failure_threshold": 1_000_000}},
            extra={"fake": {"mode": "status", "status": 503, "fail_attempts": 1}},
        ),
        *(
            Scenario(
                f"guard-{stage}",
                f"a streamed chat with a guard at the {stage} stage that waits 3 ms, then passes",
                config={"guards": [guard(stage, **(WINDOWS if stage == "output" else {}))]},
            )
            for stage in ("request", "prompt", "output", "after")
        ),
        *(
            Scenario(
                f"guard-{stage}-refuses",
                f"a streamed chat whose {stage} guard refuses after 3 ms",
                config={
                    "guards": [guard(stage, refuse=True, **(WINDOWS if stage == "output" else {}))]
                },
                ending="guard_refused",
            )
            for stage in ("request", "prompt", "output")
        ),
        *(
            Scenario(
                f"upstream-{mode}-at-{at}",
                f"a streamed chat whose upstream {what} at event boundary {at} of {TOKENS}",
                extra={"fake": {"mode": mode, "at": at}},
                # Never ejected for its failures: every run reaches the fake. A short limit
                # only for the wait the stall is in (the first token's at 0, the idle one
                # after): on a loaded machine any other could pass before the fault is read,
                # and the run end another way.
                config={
                    "upstream": {
                        "idle_timeout": 0.05 if mode == "stall" and at else 5,
                        "first_token_timeout": 0.05 if mode == "stall" and not at else 5,
                        "failure_threshold": 1_000_000,
                    }
                },
                ending=None,
            )
            for mode, what in (
                ("reset", "resets the connection"),
                ("malformed", "sends a malformed event"),
                ("stall", "stalls past the first-token or idle limit (50 ms)"),
            )
            for at in range(TOKENS + 1)
        ),
    ]
    # Every scenario of an upstream again on the other transport: httpx's pool, not the lean
    # HTTP/1.1 client (its own cut points, and its own way of closing a connection).
    local = {
        "backend": "local",
        "path": "unused-preloaded",
        "default_temperature": 0.0,
        "slots": 2,
        "queue_timeout": 5,
    }
    on_the_local_model = [
        Scenario(
            "local-stream",
            "a streamed chat of the tiny local model (4 tokens, 2 ms a decode step)",
            model="tiny",
            extra={"max_tokens": 4},
            config={"models": {"tiny": local}},
            local=True,
        ),
        Scenario(
            "local-whole",
            "a chat of the tiny local model answered whole (JSON)",
            model="tiny",
            stream=False,
            extra={"max_tokens": 4},
            config={"models": {"tiny": local}},
            local=True,
        ),
    ]
    # (A request its guard refuses never reaches a replica: once is enough.)
    return [
        *upstream,
        *(over_httpx(s) for s in upstream if s.name != "guard-request-refuses"),
        *on_the_local_model,
    ]


def over_httpx(scenario: Scenario) -> Scenario:
    upstream = {**scenario.config.get("upstream", {}), "transport": "httpx"}
    return dataclasses.replace(
        scenario,
        name=f"{scenario.name}@httpx",
        what=f"{scenario.what}; over the httpx transport",
        config={**scenario.config, "upstream": upstream},
    )


SCENARIOS: dict[str, Scenario] = {scenario.name: scenario for scenario in _scenarios()}
