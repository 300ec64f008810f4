"""The phases an upstream attempt reports to its sink before the first token, in order, over
both transports: queued (for the replica's slot), connecting (slot held), head (the request
written, its head awaited), first_token (the head has come)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import trio

from proxy.backends.upstream.backend import UpstreamBackend
from proxy.backends.upstream.replica import UpstreamReplica
from proxy.backends.upstream.transports import ConnectionSettings
from proxy.config import config_from_mapping
from proxy.protocol.openai import Endpoint, parse_completion_request
from proxy.relay.state import Phase
from tests.support import DEADLINE, UPSTREAM_TRANSPORTS, chat_body, start_fake


class RecordingSink:
    """A sink with a client that reads everything at once, and a log of the phases it was
    told."""

    def __init__(self) -> None:
        self.phases: list[str] = []
        self.started = False
        self.client_gone = False

    def set_phase(self, phase: str) -> None:
        self.phases.append(phase)

    def offer(self, chunk: bytes) -> bool:
        return True

    def on_disconnect(self, callback: Callable[[], None]) -> None:
        pass

    def begin(self, *args: Any, **kwargs: Any) -> None:
        self.started = True

    async def send(self, chunk: bytes) -> None:
        await trio.lowlevel.checkpoint()


@pytest.mark.parametrize("transport", UPSTREAM_TRANSPORTS)
@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
async def test_an_attempt_reports_its_phases_in_order(
    nursery: trio.Nursery, transport: str, stream: bool
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=3)
        config = config_from_mapping({"models": {"m": {"upstreams": [fake.url]}}}, "test", env={})
        (model,) = config.models
        replica = UpstreamReplica(
            fake.url, config.upstream, ConnectionSettings(transport=transport)
        )
        backend = UpstreamBackend(model, [replica], config.relay)
        raw = json.dumps(chat_body("m", stream=stream)).encode()
        sink = RecordingSink()
        try:
            await backend.produce(parse_completion_request(raw, Endpoint.CHAT), "phases-1", sink)
        finally:
            await replica.aclose()
    assert sink.phases == [Phase.QUEUED, Phase.CONNECTING, Phase.HEAD, Phase.FIRST_TOKEN]
