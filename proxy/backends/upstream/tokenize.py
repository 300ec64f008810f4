"""A prompt's token ids as its engine makes them, for ``cache_aware`` routing: asked of a
replica's own ``/tokenize`` (vLLM's, with the request's messages and chat-template settings),
so the chat template, special tokens and tokenizer are exactly the engine's, and no tokenizer
runs in this process (none on the event loop, none in a thread).

It costs one small request before the request is queued; past ``kv_tokenize_timeout``, or on
any failure, the request is routed by load alone (``fallback``). The client is gated by a
semaphore no larger than its pool, so that nothing ever waits inside httpcore's pool
(httpcore #1093: a request cancelled there leaks a connection).

A chat request's tokens are remembered (:class:`~proxy.protocol.prompt_memory.PromptMemory`,
``MEMORY_BYTES`` per model): a conversation's next turn is routed at once by its previous
turn's tokens (:meth:`ReplicaTokenizer.recall`), which begin its own, and its own are learnt
beside it, so the round trip is paid on a conversation's first turn only.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import httpx
import trio

from proxy.backends.upstream.replica import USER_AGENT, UpstreamReplica
from proxy.protocol.kv_cache import token_key
from proxy.protocol.openai import CompletionRequest, Endpoint
from proxy.protocol.prompt_memory import PromptMemory, Recalled, message_chain

log = logging.getLogger("sluice.upstream")

# Requests to /tokenize at once per model; the client's pool holds as many connections.
MAX_TOKENIZING = 16
# A /tokenize answer of a long prompt: a few bytes per token; bounded all the same.
# Remembered chat prompts' tokens per model, at 4 bytes a token: about 2,800 conversations of
# 1,500 tokens.
MEMORY_BYTES = 16 * 1024 * 1024
_MAX_ANSWER = 16 * 1024 * 1024
# The chat request's fields that change the tokens its template makes (vLLM's /tokenize
# takes each of them as chat completions do).
_CHAT_FIELDS = (
    "messages",
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
)


class Tokenizer(Protocol):
    """Where cache_aware gets a prompt's tokens."""

    async def tokens(self, request: CompletionRequest) -> Sequence[int] | None:
        """The request's prompt as token ids, or None (no prompt, or not in time)."""
        ...

    def recall(self, request: CompletionRequest) -> Recalled | None:
        """Without waiting: the remembered tokens of this request, or of the longest earlier
        request its conversation began with; None when none are."""
        ...


def tokenize_body(request: CompletionRequest, model: str) -> dict[str, Any] | list[int] | None:
    """What to POST to /tokenize for ``request`` (sent as ``model``), its token ids when the
    request carries them already, or None when its endpoint has no single prompt."""
    body: Mapping[str, Any] = request.body
    if request.endpoint is Endpoint.CHAT and isinstance(body.get("messages"), list):
        asked = {name: body[name] for name in _CHAT_FIELDS if name in body}
        return {"model": model, **asked}
    if request.endpoint is Endpoint.COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return {"model": model, "prompt": prompt}
        if isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in prompt
        ):
            return list(prompt)
    return None


class ReplicaTokenizer:
    """:class:`Tokenizer` through the least busy healthy replica's ``/tokenize``."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        replicas: Sequence[UpstreamReplica],
        model: str,
        timeout: float,
    ) -> None:
        self._client = client
        self._replicas = list(replicas)
        self._model = model
        self._timeout = timeout
        self._gate = trio.Semaphore(MAX_TOKENIZING)
        self._memory = PromptMemory(MEMORY_BYTES)

    def _replica(self) -> UpstreamReplica:
        now = trio.current_time()
        healthy = [r for r in self._replicas if not r.load.ejected(now)] or self._replicas
        return min(healthy, key=lambda r: r.load.in_flight)

    def recall(self, request: CompletionRequest) -> Recalled | None:
        chain = _chain(tokenize_body(request, self._model))
        return None if chain is None else self._memory.recall(chain)

    async def tokens(self, request: CompletionRequest) -> Sequence[int] | None:
        body = tokenize_body(request, self._model)
        if body is None or isinstance(body, list):
            return body
        tokens = await self._ask(body)
        chain = _chain(body)
        if tokens is not None and chain is not None:
            self._memory.remember(chain, token_key(tokens))
        return tokens

    async def _ask(self, body: dict[str, Any]) -> list[int] | None:
        replica = self._replica()
        headers = {"User-Agent": USER_AGENT.decode(), "Content-Type": "application/json"}
        if replica.authorization is not None:
            headers["Authorization"] = replica.authorization
        problem = f"no answer within kv_tokenize_timeout={self._timeout:g}s"
        with trio.move_on_after(self._timeout):
            async with self._gate:
                try:
                    answer = await self._client.post(
                        replica.root_url + "/tokenize",
                        content=json.dumps(body).encode(),
                        headers=headers,
                    )
                except httpx.HTTPError as error:
                    problem = f"{type(error).__name__}: {error}"
                else:
                    tokens = _tokens(answer)
                    if tokens is not None:
                        return tokens
                    problem = f"HTTP {answer.status_code}, no token list"
        replica.warn(
            "tokenize",
            "model %s: %s/tokenize failed (%s); routing by load alone meanwhile",
            self._model,
            replica.root_url,
            problem,
        )
        return None


def _chain(body: dict[str, Any] | list[int] | None) -> list[bytes] | None:
    """The :func:`~proxy.protocol.prompt_memory.message_chain` of a chat request's
    /tokenize body; None for another."""
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return None
    head = {name: value for name, value in body.items() if name != "messages"}
    return message_chain(head, body["messages"])


def _tokens(answer: httpx.Response) -> list[int] | None:
    if answer.status_code != 200 or len(answer.content) > _MAX_ANSWER:
        return None
    try:
        tokens = answer.json().get("tokens")
    except (ValueError, AttributeError):
        return None
    if isinstance(tokens, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in tokens
    ):
        return tokens
    return None
