"""What every backend offers the relay: produce one request's response into a sink."""

from __future__ import annotations

from typing import Protocol

from proxy.protocol.openai import CompletionRequest
from proxy.relay.body import Sink


class Backend(Protocol):
    async def produce(self, request: CompletionRequest, request_id: str, sink: Sink) -> None:
        """Decide the response head, then send its body; raise ApiError for failures."""
        ...
