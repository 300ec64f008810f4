"""Prefix affinity, sans-IO: what a request's conversation is called, and which replica a name
belongs to.

- :func:`affinity_key`: the value of the session header (``affinity_header``) when the client
  sent it, else a hash of the first ``affinity_prefix_bytes`` of a canonical serialisation of the
  prompt's beginning: system prompt and messages in order (chat, Anthropic Messages), the
  instructions and input (Responses), the prompt (completions), the input (embeddings). The
  serialisation is of roles and texts only, so two clients that format their JSON differently
  (key order, spaces) but say the same get the same key, and a conversation that grows keeps
  its key once its beginning is longer than the prefix.
- :func:`rendezvous_order`: highest-random-weight hashing. Each replica's weight for a key is a
  hash of (key, replica); the key goes to the highest. A replica that leaves moves only its own
  keys, and every process (each instance of Sluice) computes the same answer with no shared
  state.
- :func:`overloaded`: the load bound that keeps a key (or a cached prefix) from piling onto one
  replica.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import Any

from proxy.protocol.openai import CompletionRequest, Endpoint

# Between fields and between messages: bytes that JSON text never holds unescaped.
_FIELD = b"\x1f"
_RECORD = b"\x1e"


def _text(value: object) -> bytes:
    """A message content as bytes: a string as it is, anything else (content parts, a token
    list) as canonical JSON."""
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
        "utf-8", "surrogatepass"
    )


def _messages(messages: object) -> Iterable[bytes]:
    if not isinstance(messages, list):
        yield _text(messages)
        return
    for message in messages:
        if isinstance(message, dict):
            yield _text(message.get("role", "")) + _FIELD + _text(message.get("content", ""))
        else:
            yield _text(message)


def _parts(request: CompletionRequest) -> Iterable[bytes]:
    body: dict[str, Any] = request.body
    endpoint = request.endpoint
    if endpoint is Endpoint.CHAT:
        yield from _messages(body.get("messages"))
    elif endpoint is Endpoint.MESSAGES:
        if body.get("system") is not None:
            yield b"system" + _FIELD + _text(body["system"])
        yield from _messages(body.get("messages"))
    elif endpoint is Endpoint.RESPONSES:
        if body.get("instructions") is not None:
            yield b"system" + _FIELD + _text(body["instructions"])
        items = body.get("input")
        yield from (_messages(items) if isinstance(items, list) else [_text(items)])
    elif endpoint is Endpoint.COMPLETIONS:
        yield _text(body.get("prompt", ""))
    elif endpoint is Endpoint.EMBEDDINGS:
        yield _text(body.get("input", ""))
    else:
        # A pass-through: its bytes, as they came (nothing here knows their format).
        yield request.raw


def prompt_prefix(request: CompletionRequest, limit: int) -> bytes:
    """The first ``limit`` bytes of the request's canonical prompt (see the module doc)."""
    out = bytearray()
    for part in _parts(request):
        out += part + _RECORD
        if len(out) >= limit:
            break
    return bytes(out[:limit])


def affinity_key(request: CompletionRequest, prefix_bytes: int, session: str = "") -> bytes:
    """What the request's conversation is called: its session header's value when it sent
    one (``session``), else its prompt's first ``prefix_bytes``; a 16-byte digest either way."""
    if session:
        material = b"session" + _FIELD + session.encode("utf-8", "surrogatepass")
    else:
        material = b"prefix" + _FIELD + request.model.encode() + _FIELD
        material += prompt_prefix(request, prefix_bytes)
    return hashlib.blake2b(material, digest_size=16).digest()


def rendezvous_weight(key: bytes, name: str) -> int:
    """The weight of replica ``name`` for ``key``: the highest weight wins the key."""
    digest = hashlib.blake2b(name.encode(), digest_size=8, key=key).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: bytes, names: Sequence[str]) -> list[int]:
    """Indexes of ``names``, from the replica that owns ``key`` down (names break ties)."""
    return sorted(
        range(len(names)),
        key=lambda i: (rendezvous_weight(key, names[i]), names[i]),
        reverse=True,
    )


def overloaded(load: float, loads: Sequence[float], max_load: float) -> bool:
    """Whether the key's replica, at ``load``, is over the bound: more than ``max_load`` x the
    mean of ``loads`` (every candidate's, its own included) plus one.

    The +1 is SGLang's absolute threshold next to its relative one (its router rebalances only
    when max - min > balance_abs_threshold and max > balance_rel_threshold x min): with
    nothing in flight the mean is 0, and a single request must not count as an overload. With
    2 replicas and max_load 1.5, the key's replica gives way when it holds more than 3 x the
    other's + 4: at 5 while the other is idle (5 > 1.5 x 2.5 + 1), at 11 against 2."""
    if not loads:
        return False
    mean = sum(loads) / len(loads)
    return load > max_load * mean + 1
