"""What guards read of a request and of its answer, and how an answer is cut into windows and
released: sans-IO (no trio, no sockets), so that every decision is a pure step a test drives.

The text of an event, of every endpoint's shape: chat's ``delta.content`` (and
``reasoning_content``, and a tool call's ``function.arguments``), completions' ``text``,
Responses' ``response.*.delta``, Messages' ``content_block_delta`` (``text``,
``partial_json``, ``thinking``); of a whole answer, its message's content. One token is one
event that carries text, as the token meter counts (protocol/token_usage.py).

:class:`OutputLedger` keeps an answer's chunks in order, each with its events and tokens, and
says when a window is due (``window_tokens`` of text, or the hold-back's bound reached so that
an answer without text cannot wait forever), which chunks a passed window frees (``release =
"after"``), and when the producer must wait (the guards behind by more than the hold-back).

An event's text is read without parsing the whole event when it has one of the delta shapes
upstreams stream token by token (chat's, completions', Messages' and Responses', compact or
spaced): one precompiled pattern matches the *whole* line as a strict subset of JSON, so the
text field it captures is the one ``json.loads`` would give, and only that JSON string is
decoded. Any other line (nested values, several choices, a key written with escapes, a
duplicate text field, a number too long for ``int``) goes through ``json.loads`` as before.
A :class:`TextReader` also remembers the bytes around the last text field it found: an
upstream writes the same frame around every token, so the next event costs two comparisons and
one string match (replacing one JSON string with another cannot change what the line means).
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from json.decoder import scanstring  # type: ignore[attr-defined]  # json's C scanner
from typing import Any, NamedTuple

_DATA = b"data:"


def payload_text(payload: Mapping[str, Any]) -> str:
    """The answer text one streamed event (or a whole answer) carries; "" for none."""
    kind = payload.get("type")
    if isinstance(kind, str):
        if kind == "content_block_delta":
            delta = payload.get("delta")
            if isinstance(delta, Mapping):
                for name in ("text", "partial_json", "thinking"):
                    value = delta.get(name)
                    if isinstance(value, str):
                        return value
            return ""
        if kind.startswith("response.") and kind.endswith(".delta"):
            delta = payload.get("delta")
            return delta if isinstance(delta, str) else ""
        if kind == "message":  # a whole Messages answer
            return _parts_text(payload.get("content"))
        return ""
    if payload.get("object") == "response":  # a whole Responses answer
        return "".join(
            _parts_text(item.get("content"))
            for item in payload.get("output") or ()
            if isinstance(item, Mapping)
        )
    texts: list[str] = []
    for choice in payload.get("choices") or ():
        if not isinstance(choice, Mapping):
            continue
        if isinstance(choice.get("text"), str):
            texts.append(choice["text"])
        for part in ("delta", "message"):
            inner = choice.get(part)
            if isinstance(inner, Mapping):
                texts.extend(_message_texts(inner))
    return "".join(texts)


def _message_texts(message: Mapping[str, Any]) -> list[str]:
    texts = []
    for name in ("reasoning_content", "content"):
        value = message.get(name)
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, list):
            texts.append(_parts_text(value))
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("arguments"), str):
            texts.append(function["arguments"])
    return texts


def _parts_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "".join(
        part["text"]
        for part in content
        if isinstance(part, Mapping) and isinstance(part.get("text"), str)
    )


def _payload(event: bytes) -> dict[str, Any] | None:
    """The JSON object of an event's ``data:`` line; None for a comment, ``[DONE]``, or an
    event that is not JSON (relayed as it is, and never text)."""
    located = _data_line(event)
    if located is None:
        return None
    try:
        value = json.loads(located[0])
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


# -- the fast read: the delta shapes as a strict subset of JSON ------------------------------
#
# Each piece below matches exactly what JSON allows there (no NaN, no bad escape, no raw
# control character), so a line the pattern matches whole is valid JSON with one meaning.
_S = rb"[ \t]*"
_STRING = rb'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
# An int of up to 1,000 digits (CPython refuses more than 4,300: that line is json.loads's).
_NUMBER = rb"-?(?:0|[1-9][0-9]{0,999})(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
_SCALAR = rb"(?:" + _STRING + rb"|" + _NUMBER + rb"|true|false|null)"
_COMMA = _S + rb"," + _S
_FLAT = (
    rb"(?:" + _SCALAR
    + rb"|\[" + _S + rb"(?:" + _SCALAR + rb"(?:" + _COMMA + _SCALAR + rb")*)?" + _S + rb"\]"
    + rb"|\{" + _S + rb"(?:" + _STRING + _S + rb":" + _S + _SCALAR
    + rb"(?:" + _COMMA + _STRING + _S + rb":" + _S + _SCALAR + rb")*)?" + _S + rb"\})"
)  # fmt: skip
# Every key payload_text reads, at any level: never an "other" member (so a duplicate of one,
# which json.loads would resolve to its last, makes the line fall back). A key with an escape
# in it (``"con\u0074ent"``) is no other member either.
_READ_KEYS = (
    rb"choices|type|object|delta|message|text|content|reasoning_content|tool_calls"
    rb"|partial_json|thinking|output"
)
_OTHER = rb'"(?!(?:' + _READ_KEYS + rb')")[^"\\\x00-\x1f]*"' + _S + rb":" + _S + _FLAT


def _members(*middle: bytes, other: bytes = _OTHER) -> bytes:
    """An object's members: others around ``middle`` (a sequence of members, in order)."""
    comma = _S + rb"," + _S
    inner = (comma + rb"(?:" + other + comma + rb")*").join(middle)
    return (
        rb"\{" + _S + rb"(?:" + other + comma + rb")*" + inner
        + rb"(?:" + comma + other + rb")*" + _S + rb"\}"
    )  # fmt: skip


def _field(name: bytes, value: bytes) -> bytes:
    return rb'"' + name + rb'"' + _S + rb":" + _S + value


_CHAT_DELTA = (
    rb"(?:" + _members(
        rb'"(?:reasoning_)?content"' + _S + rb":" + _S + rb"(?:(?P<content>" + _STRING + rb")|null)"
    )
    + rb"|\{" + _S + rb"(?:" + _OTHER + rb"(?:" + _S + rb"," + _S + _OTHER + rb")*)?" + _S
    + rb"\})"
)  # fmt: skip
_CHOICE = _members(
    rb"(?:" + _field(b"delta", _CHAT_DELTA)
    + rb"|" + _field(b"text", rb"(?P<completion>" + _STRING + rb")") + rb")"
)  # fmt: skip
# The top of a chat or completions chunk: its "object" anything but "response".
_TOP_OTHER = (
    rb"(?:" + _OTHER + rb"|" + _field(b"object", rb'"(?!response")[^"\\\x00-\x1f]*"') + rb")"
)
_CHAT = _members(_field(b"choices", rb"\[" + _S + _CHOICE + _S + rb"\]"), other=_TOP_OTHER)
# Messages: a content_block_delta, its delta's one text field (its own "type" beside it).
_BLOCK_OTHER = rb"(?:" + _OTHER + rb"|" + _field(b"type", _FLAT) + rb")"
_MESSAGES = _members(
    _field(b"type", rb'"content_block_delta"'),
    _field(
        b"delta",
        _members(
            rb'"(?:text|partial_json|thinking)"' + _S + rb":" + _S
            + rb"(?P<block>" + _STRING + rb")",
            other=_BLOCK_OTHER,
        ),
    ),
)  # fmt: skip
# Responses: a response.*.delta event, its "delta" a string.
_RESPONSES = _members(
    _field(b"type", rb'"response\.[^"\\\x00-\x1f]*\.delta"'),
    _field(b"delta", rb"(?P<response>" + _STRING + rb")"),
)
# One line, one of the shapes, whole. No text group matched: a matched event with no text
# (the opening role delta's content "" has one; ``"delta":{}`` none).
_DELTA_LINE = re.compile(b"|".join((_CHAT, _MESSAGES, _RESPONSES)))
_STRING_ONLY = re.compile(_STRING)


def _decode(string: bytes) -> str:
    """A JSON string's value (``string`` with its quotes, matched by _STRING), as
    ``json.loads`` gives it; ValueError where it would fail (bytes that are not UTF-8)."""
    if b"\\" in string:
        # json's own C scanner, as json.loads runs it, without the rest of a parse.
        value: str = scanstring(string.decode(), 1)[0]
        return value
    return string[1:-1].decode()


def _data_line(event: bytes) -> tuple[bytes, int] | None:
    """An event's ``data:`` line, stripped, and where it starts in ``event``, when it may be
    a JSON object (else None)."""
    at = event.find(_DATA)
    if at < 0:
        return None
    raw = event[at + 5 :].split(b"\n", 1)[0]
    line = raw.lstrip()
    offset = at + 5 + len(raw) - len(line)
    line = line.rstrip()
    return (line, offset) if line.startswith(b"{") else None


def _payload_text(line: bytes) -> str:
    """What payload_text gives for the JSON object of ``line``, through the full parse."""
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):
        return ""
    return payload_text(value) if isinstance(value, dict) else ""


class TextReader:
    """Reads the text of one answer's events, fast (see the module's docstring); what a full
    parse gives, always. One per answer: it remembers that answer's frame."""

    __slots__ = ("_prefix", "_suffix")

    def __init__(self) -> None:
        # The event around the last text field found: its bytes before the string, and after.
        # Kept for the whole event, not its data line: the string holds no newline, and the
        # prefix ends in a key's colon, so the same bytes around it are the same data line.
        self._prefix = b""
        self._suffix = b""

    def event_text(self, event: bytes) -> str:
        """The text of one event (without its blank line)."""
        prefix, suffix = self._prefix, self._suffix
        if prefix and event.startswith(prefix) and event.endswith(suffix):
            string = event[len(prefix) : len(event) - len(suffix)]
            if _STRING_ONLY.fullmatch(string) is not None:
                try:
                    return _decode(string)
                except ValueError:
                    pass  # not UTF-8: the full parse says what it is
        located = _data_line(event)
        if located is None:
            return ""
        line, offset = located
        found = _DELTA_LINE.fullmatch(line)
        if found is None:
            return _payload_text(line)
        if found.lastindex is None:
            return ""
        start, end = found.span(found.lastindex)
        try:
            text = _decode(line[start:end])
        except ValueError:
            return _payload_text(line)
        self._prefix = event[: offset + start]
        self._suffix = event[offset + end :]
        return text

    def read_chunk(self, chunk: bytes) -> ChunkText:
        """The text of a chunk of whole SSE events."""
        events = chunk.split(b"\n\n")
        events.pop()
        if len(events) == 1 and events[0]:  # one event a chunk: the common case
            text = self.event_text(events[0])
            return ChunkText(1, 1 if text else 0, text)
        count = tokens = 0
        texts = []
        for event in events:
            if not event:
                continue
            count += 1
            text = self.event_text(event)
            if text:
                tokens += 1
                texts.append(text)
        return ChunkText(count, tokens, "".join(texts))


def events_of(chunk: bytes) -> list[bytes]:
    """The events of a chunk of whole SSE events, each with its blank line."""
    parts = chunk.split(b"\n\n")
    return [part + b"\n\n" for part in parts[:-1] if part]


class ChunkText(NamedTuple):
    """A chunk as guards count it: its events, those that carry text (its tokens), and the
    text."""

    events: int
    tokens: int
    text: str


def read_chunk(chunk: bytes) -> ChunkText:
    """The text of a chunk of whole SSE events (a reader of its own: nothing remembered)."""
    return TextReader().read_chunk(chunk)


def whole_text(body: bytes) -> str:
    """The answer text of a whole (non-streamed) JSON answer; "" if it is not one."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return ""
    return payload_text(payload) if isinstance(payload, dict) else ""


def prompt_text(body: Mapping[str, Any]) -> str:
    """A request's prompt as text, whatever its endpoint: its system text (``system``,
    ``instructions``), then each message's (``messages``, ``input``) or the prompt's
    (``prompt``), one per line."""
    lines: list[str] = []
    for name in ("system", "instructions"):
        value = body.get(name)
        if value:
            lines.append(_content_text(value))
    for name in ("messages", "input", "prompt"):
        value = body.get(name)
        if isinstance(value, str):
            lines.append(value)
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, Mapping):
                    lines.append(_content_text(item.get("content")))
                elif isinstance(item, str):
                    lines.append(item)
    return "\n".join(line for line in lines if line)


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part if isinstance(part, str) else str(part.get("text", ""))
            for part in content
            if isinstance(part, str | Mapping)
        )
    return ""


# -- rewriting (a guard's redaction) --------------------------------------------------------


def _set_text(payload: dict[str, Any], text: str) -> bool:
    """Put ``text`` in the first text field of ``payload`` and empty the others; whether it
    had one (the fields payload_text reads)."""
    fields = list(_text_fields(payload))
    for index, (holder, name) in enumerate(fields):
        holder[name] = text if index == 0 else ""
    return bool(fields)


def _text_fields(payload: dict[str, Any]) -> Iterable[tuple[dict[str, Any], str]]:
    kind = payload.get("type")
    if kind == "content_block_delta":
        delta = payload.get("delta")
        if isinstance(delta, dict):
            for name in ("text", "partial_json", "thinking"):
                if isinstance(delta.get(name), str):
                    yield delta, name
                    return
        return
    if isinstance(kind, str) and kind.startswith("response.") and kind.endswith(".delta"):
        if isinstance(payload.get("delta"), str):
            yield payload, "delta"
        return
    if kind == "message" or payload.get("object") == "response":
        items = payload.get("output") if kind != "message" else [payload]
        for item in items or ():
            for part in item.get("content") or () if isinstance(item, dict) else ():
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    yield part, "text"
        return
    for choice in payload.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if isinstance(choice.get("text"), str):
            yield choice, "text"
        for part in ("delta", "message"):
            inner = choice.get(part)
            if isinstance(inner, dict):
                for name in ("reasoning_content", "content"):
                    if isinstance(inner.get(name), str):
                        yield inner, name


def rewrite_events(chunks: Iterable[bytes], text: str) -> bytes:
    """``chunks`` (whole SSE events) with their text replaced by ``text``: the first event that
    carries text carries all of it, the others none; every other event as it was."""
    out: list[bytes] = []
    placed = False
    for chunk in chunks:
        for event in events_of(chunk):
            payload = _payload(event)
            if payload is None or not payload_text(payload):
                out.append(event)
                continue
            if not _set_text(payload, "" if placed else text):
                out.append(event)
                continue
            placed = True
            head = event[: event.find(_DATA)]
            out.append(head + b"data: " + json.dumps(payload).encode() + b"\n\n")
    return b"".join(out)


def rewrite_closing(chunk: bytes, text: str, whole: int) -> bytes:
    """``chunk`` with the text that Responses' closing events repeat (``response.*.done``'s
    ``text``, a part's, an item's, ``response.completed``'s output) made what the client got
    in the deltas, once a guard rewrote some of it: ``text``, the answer's text as sent, where
    the event held the answer's whole original text (``whole`` characters, so the answer's
    only text); any other text there is emptied, since which part of ``text`` it became is
    not known, and it must not bring back what a guard took out. Other events as they are."""
    if b"response." not in chunk:
        return chunk
    out: list[bytes] = []
    for event in events_of(chunk):
        payload = _payload(event)
        kind = None if payload is None else payload.get("type")
        if (
            payload is None
            or not isinstance(kind, str)
            or not kind.startswith("response.")
            or kind.endswith(".delta")
            or not _replace_texts(payload, text, whole)
        ):
            out.append(event)
            continue
        head = event[: event.find(_DATA)]
        out.append(head + b"data: " + json.dumps(payload).encode() + b"\n\n")
    return b"".join(out)


def _replace_texts(value: object, text: str, whole: int) -> bool:
    """Every ``text`` string inside ``value`` (dicts and lists, in place) made ``text`` when it
    is ``whole`` long, else emptied; whether any was found."""
    found = False
    if isinstance(value, dict):
        for name, inner in value.items():
            if name == "text" and isinstance(inner, str):
                if inner:
                    value[name] = text if len(inner) == whole else ""
                found = True
            elif isinstance(inner, dict | list):
                found = _replace_texts(inner, text, whole) or found
    elif isinstance(value, list):
        for inner in value:
            found = _replace_texts(inner, text, whole) or found
    return found


def rewrite_whole(body: bytes, text: str) -> bytes:
    """A whole JSON answer with its text replaced by ``text`` (the body as it was when it
    holds none)."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return body
    if not isinstance(payload, dict) or not _set_text(payload, text):
        return body
    return json.dumps(payload).encode()


# -- windows --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DueWindow:
    """A window to check: its text (the overlap, then its own), its own text, its number,
    whether it is the answer's last, and the chunks it frees once passed (``release =
    "after"``: ``upto`` is the ledger's count of chunks taken when it closed)."""

    text: str
    new_text: str
    index: int
    final: bool
    upto: int


class OutputLedger:
    """One answer's chunks as its output guards see them: pure bookkeeping, no I/O.

    ``take`` a chunk (with its :class:`ChunkText`): it is held (``release = "after"``) or
    counted as gone out (``"before"``); a :class:`DueWindow` comes back when a window closed.
    ``passed`` frees a window's chunks; ``finish`` closes the last window.
    """

    def __init__(
        self,
        window_tokens: int,
        overlap_tokens: int,
        hold_back_tokens: int,
        *,
        release_after: bool,
    ) -> None:
        self.window_tokens = window_tokens
        self.overlap_tokens = overlap_tokens
        self.release_after = release_after
        # Events taken but not yet checked that the producer may run ahead by; past it, it
        # waits (and a window is closed at once, text or not).
        self.bound = window_tokens + hold_back_tokens
        self._pieces: list[str] = []
        self._tail: deque[str] = deque(maxlen=overlap_tokens or None)
        self._window_tokens = 0
        # Events taken since the last window closed (its text or not).
        self._open_events = 0
        # Events taken and in windows not yet passed.
        self._checking_events: deque[tuple[int, int]] = deque()
        # Chunks held (release = "after"), with their tokens.
        self.held: deque[tuple[bytes, int]] = deque()
        self.taken = 0  # chunks taken
        self.released = 0  # chunks freed (release = "after")
        self.windows = 0
        self.tokens = 0

    @property
    def unchecked(self) -> int:
        """Events taken and not yet passed (in the open window, or being checked)."""
        return self._open_events + sum(events for _, events in self._checking_events)

    @property
    def full(self) -> bool:
        """Whether the producer must wait before another chunk: the guards are behind by the
        window and the hold-back."""
        return self.unchecked >= self.bound

    def take(self, chunk: bytes, read: ChunkText) -> DueWindow | None:
        self.taken += 1
        if self.release_after:
            self.held.append((chunk, read.tokens))
        # A chunk is at least one event, so that every chunk taken is in a window.
        self._open_events += max(1, read.events)
        if read.tokens:
            self.tokens += read.tokens
            self._window_tokens += read.tokens
            self._pieces.append(read.text)
        if self._window_tokens >= self.window_tokens or (
            self._open_events and self.unchecked >= self.bound
        ):
            return self._close(final=False)
        return None

    def finish(self) -> DueWindow | None:
        """The answer ended: its last window (None when every token was checked already and
        nothing is held). A window that closed on the answer's last event (the hold-back's
        bound reached, or its last token) kept the chunks of its overlap held for the next one:
        that next one is this, with no text of its own, so that they are released."""
        if not self._open_events and not self.held:
            return None
        return self._close(final=True)

    def _close(self, *, final: bool) -> DueWindow:
        new_text = "".join(self._pieces)
        window = DueWindow(
            "".join(self._tail) + new_text, new_text, self.windows, final, self.taken
        )
        if self.overlap_tokens:
            self._tail.extend(self._pieces)
        self._pieces = []
        self._window_tokens = 0
        self._checking_events.append((self.windows, self._open_events))
        self._open_events = 0
        self.windows += 1
        return window

    def passed(self, window: DueWindow) -> list[bytes]:
        """``window`` passed: the chunks it frees, in order (none with ``release =
        "before"``, whose chunks went out as they came).

        The chunks that hold its last ``overlap_tokens`` tokens stay held until the next
        window passes too: they are seen again there, so that a value split across the two
        windows (up to the overlap and one token) is refused before any of it went out."""
        while self._checking_events and self._checking_events[0][0] <= window.index:
            self._checking_events.popleft()
        count = min(window.upto - self.released, len(self.held))
        if not window.final and self.overlap_tokens:
            kept = 0
            while count > 0 and kept < self.overlap_tokens:
                kept += self.held[count - 1][1]
                count -= 1
        freed = [self.held.popleft()[0] for _ in range(count)]
        self.released += count
        return freed

    def kept(self, window: DueWindow) -> list[bytes]:
        """The chunks of ``window`` (or before it) that :meth:`passed` kept held for the next
        window's overlap."""
        held = self.held
        return [held[index][0] for index in range(min(window.upto - self.released, len(held)))]

    def release_kept(self, window: DueWindow) -> list[bytes]:
        """Free the chunks :meth:`kept` names now, in order."""
        count = min(window.upto - self.released, len(self.held))
        self.released += count
        return [self.held.popleft()[0] for _ in range(count)]

    def drop(self) -> int:
        """Refused: what is held is dropped; how many events of text it held is not known
        here (they were counted as made); the chunks' count."""
        dropped = len(self.held)
        self.held.clear()
        return dropped
