"""vLLM's KV-event wire format, sans-IO: the frames its ``ZmqEventPublisher`` sends, decoded
into :mod:`proxy.protocol.kv_cache`'s events.

The publisher (``vllm/distributed/kv_events.py``, ``--kv-events-config '{"enable_kv_cache_events":
true, "publisher": "zmq", ...}'``) sends each batch on a PUB socket as three frames::

    topic (its "topic" setting, "" by default) | sequence (8 bytes, big-endian, from 0) | payload

The payload is msgspec's msgpack of a ``KVEventBatch``: ``[ts, events, data_parallel_rank]``
(an array: ``array_like``; the rank omitted when unset), each event a tagged struct. vLLM up to
0.10 encodes an event as an array, its tag first (``["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium]``); later releases as a map whose
``"type"`` is the tag (``{"type": "BlockStored", "block_hashes": ..., ...}``), with more fields
(``lora_name``, ``extra_keys``, ``group_idx``...). Both are read; fields left at their default
may be missing from the end of an array (``omit_defaults``) or from a map; an event of a tag
this module does not know is passed over. A block hash is bytes (sha256) or an int.

Replay (its ``replay_endpoint``, a ROUTER socket): a client sends ``[b"", start]`` from a
DEALER (``start``: 8 bytes, big-endian) and gets ``[b"", seq, payload]`` for every buffered
batch from ``start`` on, then ``[b"", -1 as 8 signed bytes, b""]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgpack

from proxy.protocol.kv_cache import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
)

# The replay stream's last frame's sequence number.
END_SEQ = -1

# Each tag's fields, in the order an array-encoded event has them; the required ones first.
_FIELDS: dict[str, tuple[tuple[str, ...], int]] = {
    "BlockStored": (
        (
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
        ),
        4,
    ),
    "BlockRemoved": (("block_hashes", "medium", "group_idx"), 1),
    "AllBlocksCleared": (("medium",), 0),
}


class KvEventsError(ValueError):
    """Frames or a payload that are not vLLM's KV events."""


def decode_frames(frames: Sequence[bytes]) -> tuple[int, bytes]:
    """A published message's (sequence number, payload)."""
    if len(frames) != 3:
        raise KvEventsError(f"a KV event message has 3 frames, not {len(frames)}")
    return decode_seq(frames[1]), frames[2]


def decode_seq(raw: bytes) -> int:
    if len(raw) != 8:
        raise KvEventsError(f"a sequence number is 8 bytes, not {len(raw)}")
    return int.from_bytes(raw, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_batch(payload: bytes) -> EventBatch:
    """One payload, decoded; raises :class:`KvEventsError` if it is not a KV event batch."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as error:
        raise KvEventsError(f"not msgpack: {error}") from error
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict) and "events" in raw:
        ts, events, rank = raw.get("ts", 0.0), raw["events"], raw.get("data_parallel_rank")
    else:
        raise KvEventsError("a batch is [ts, events, ...] or a map with 'events'")
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise KvEventsError("a batch's ts is a number and its events a list")
    if rank is not None and not isinstance(rank, int):
        raise KvEventsError("a batch's data_parallel_rank is an int")
    decoded = [event for raw_event in events if (event := _event(raw_event)) is not None]
    return EventBatch(float(ts), tuple(decoded), rank)


def _event(raw: object) -> KvEvent | None:
    """One event; None for a tag this module does not know."""
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag, values = raw[0], raw[1:]
        known = _FIELDS.get(tag)
        if known is None:
            return None
        names, required = known
        if len(values) < required:
            raise KvEventsError(f"{tag} has {len(values)} fields, fewer than {required}")
        fields: Mapping[str, Any] = dict(zip(names, values, strict=False))
    elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
        tag, fields = raw["type"], raw
        known = _FIELDS.get(tag)
        if known is None:
            return None
        names, required = known
        missing = [name for name in names[:required] if name not in fields]
        if missing:
            raise KvEventsError(f"{tag} lacks {', '.join(missing)}")
    else:
        raise KvEventsError("an event is [tag, ...] or a map with 'type'")
    if tag == "BlockStored":
        return BlockStored(
            block_hashes=_hashes(fields["block_hashes"]),
            parent_block_hash=_optional_hash(fields["parent_block_hash"]),
            token_ids=_ints(fields["token_ids"], "token_ids"),
            block_size=_int(fields["block_size"], "block_size"),
            lora_id=_optional_int(fields.get("lora_id"), "lora_id"),
            medium=_optional_str(fields.get("medium"), "medium"),
            lora_name=_optional_str(fields.get("lora_name"), "lora_name"),
            extra_keys=_optional_tuple(fields.get("extra_keys"), "extra_keys"),
            group_idx=_optional_int(fields.get("group_idx"), "group_idx"),
        )
    if tag == "BlockRemoved":
        return BlockRemoved(
            block_hashes=_hashes(fields["block_hashes"]),
            medium=_optional_str(fields.get("medium"), "medium"),
            group_idx=_optional_int(fields.get("group_idx"), "group_idx"),
        )
    return AllBlocksCleared(medium=_optional_str(fields.get("medium"), "medium"))


def _hash(value: object) -> BlockHash:
    if isinstance(value, bytes) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise KvEventsError(f"a block hash is bytes or an int, not {type(value).__name__}")


def _optional_hash(value: object) -> BlockHash | None:
    return None if value is None else _hash(value)


def _hashes(value: object) -> tuple[BlockHash, ...]:
    if not isinstance(value, list):
        raise KvEventsError("block_hashes is a list")
    return tuple(_hash(item) for item in value)


def _int(value: object, name: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise KvEventsError(f"{name} is an int")


def _optional_int(value: object, name: str) -> int | None:
    return None if value is None else _int(value, name)


def _ints(value: object, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(item, int) and not isinstance(item, bool) for item in value
    ):
        raise KvEventsError(f"{name} is a list of ints")
    return tuple(value)


def _optional_str(value: object, name: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise KvEventsError(f"{name} is a string")


def _optional_tuple(value: object, name: str) -> tuple[object, ...] | None:
    if value is None:
        return None
    if isinstance(value, list):
        return tuple(value)
    raise KvEventsError(f"{name} is a list")
