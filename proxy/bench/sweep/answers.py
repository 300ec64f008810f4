"""Reading what the sweep's client received: whether the answer is whole, and how many tokens
(content delta events, one per token, as Sluice's meter counts them) it carried. Sans-IO; a
WebSocket's frames are read by wsproto."""

from __future__ import annotations

import json
import re
from typing import Any

from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import TextMessage

_LENGTH = re.compile(rb"(?im)^content-length: *(\d+)\r?$")


def split_head(received: bytes) -> tuple[int | None, bytes, bytes]:
    """(status, head, body as received, framing and all); status None before a whole head."""
    head, sep, body = received.partition(b"\r\n\r\n")
    if not sep:
        return None, b"", b""
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return None, head, body
    return status, head, body


def dechunk(framed: bytes) -> tuple[bytes, bool]:
    """The chunks' payload as far as it arrived whole, and whether the last chunk came."""
    body = b""
    while True:
        size_line, sep, rest = framed.partition(b"\r\n")
        if not sep:
            return body, False
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            return body, False
        if size == 0:
            return body, True
        if len(rest) < size + 2:
            return body, False
        body, framed = body + rest[:size], rest[size + 2 :]


def ws_read(data: bytes) -> tuple[list[str], bool]:
    """What a server sent over a WebSocket, from the bytes after its 101 head: its whole text
    messages, in order, and whether its close frame came. A message cut short ends the list
    (wsproto hands a frame's payload on as it arrives: only a finished message counts)."""
    # wsproto's connection past the handshake: the handshake's own would want the request it
    # answers (and its key), which is the client's.
    connection = Connection(ConnectionType.CLIENT)
    connection.receive_data(data)
    messages = []
    pieces = ""
    for event in connection.events():
        if isinstance(event, TextMessage):
            pieces += event.data
            if event.message_finished:
                messages.append(pieces)
                pieces = ""
    # Frames wsproto cannot read end the list too: it then yields a close of its own (a
    # protocol error's), but only the server's close frame moves the state.
    return messages, connection.state is ConnectionState.REMOTE_CLOSING


def ws_messages(received: bytes) -> list[dict[str, Any]]:
    """The JSON messages of a WebSocket answer (after its 101 head), in order."""
    status, _head, body = split_head(received)
    if status != 101:
        return []
    return _parsed(ws_read(body)[0])


def _parsed(messages: list[str]) -> list[dict[str, Any]]:
    """Each text message as its JSON, or an ``unparsed`` placeholder."""
    found = []
    for message in messages:
        try:
            found.append(json.loads(message))
        except ValueError:
            found.append({"type": "unparsed"})
    return found


# The messages that end a WebSocket generation.
WS_ENDS = ("done", "error", "cancelled")


def ws_over(received: bytes) -> bool:
    """Whether a WebSocket answer is over: a refused handshake answered whole, a message that
    ends the generation, or the server's close frame."""
    status, _head, body = split_head(received)
    if status is None:
        return False
    if status != 101:
        return whole(received)
    messages, closed = ws_read(body)
    return closed or any(message.get("type") in WS_ENDS for message in _parsed(messages))


def whole(received: bytes) -> bool:
    """Whether ``received`` holds one whole HTTP/1.1 answer (Content-Length or chunked), or a
    WebSocket's generation that is over."""
    status, head, body = split_head(received)
    if status is None:
        return False
    if status == 101:
        return ws_over(received)
    length = _LENGTH.search(head)
    if length is not None:
        return len(body) >= int(length[1])
    return dechunk(body)[1]


def payload(received: bytes) -> bytes:
    """The answer's body as far as it arrived, its framing taken off."""
    status, head, body = split_head(received)
    if status is None:
        return b""
    if _LENGTH.search(head) is not None:
        return body
    return dechunk(body)[0]


def events(body: bytes) -> list[tuple[str, Any]]:
    """The whole SSE events of ``body``: (event name or "", its data parsed, or the raw text)."""
    found: list[tuple[str, Any]] = []
    for block in body.decode("utf-8", "replace").split("\n\n")[:-1]:
        name = ""
        data = []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip())
        if not data:
            continue
        text = "\n".join(data)
        try:
            found.append((name, json.loads(text)))
        except ValueError:
            found.append((name, text))
    return found


def is_token(endpoint: str, name: str, data: Any) -> bool:
    """Whether one event carries a token of answer text, on ``endpoint``'s stream."""
    if not isinstance(data, dict):
        return False
    if endpoint == "chat":
        return any(
            (choice.get("delta") or {}).get("content")
            or (choice.get("delta") or {}).get("reasoning_content")
            for choice in data.get("choices") or []
        )
    if endpoint == "responses":
        return str(data.get("type", name)).endswith(".delta")
    if endpoint == "messages":
        return (data.get("type") or name) == "content_block_delta"
    return False


def tokens_received(endpoint: str, stream: bool, received: bytes) -> int:
    """Tokens the client got: a stream's token events; a whole answer's, if it came whole (its
    usage block's count), else none."""
    if endpoint == "ws":
        return sum(message.get("type") == "token" for message in ws_messages(received))
    body = payload(received)
    if stream:
        return sum(is_token(endpoint, name, data) for name, data in events(body))
    if not whole(received):
        return 0
    try:
        answer = json.loads(body)
    except ValueError:
        return 0
    usage = answer.get("usage") or {}
    return int(usage.get("completion_tokens") or usage.get("output_tokens") or 0)


# The last event of each endpoint's stream.
STREAM_ENDS = {
    "chat": b"data: [DONE]",
    "responses": b"event: response.completed",
    "messages": b"event: message_stop",
}


def answered(endpoint: str, stream: bool, received: bytes) -> bool:
    """Whether the client has the whole answer: a whole HTTP/1.1 message (a chunked body's
    terminator included: without it a client cannot tell a whole body from a cut one, RFC 9112
    7.1; a client that half-closed after the last event still reads it), and, of a stream,
    its last event or an in-band error."""
    if endpoint == "ws":
        # Its last message, the done (or an error: the client was told).
        return any(message.get("type") in ("done", "error") for message in ws_messages(received))
    if not whole(received):
        return False
    if stream and split_head(received)[0] == 200:
        return STREAM_ENDS[endpoint] in payload(received) or ended_in_band(received)
    return True


def ended_in_band(received: bytes) -> bool:
    """Whether a stream carries an in-band error event (an OpenAI-shaped ``error``)."""
    return any(isinstance(data, dict) and "error" in data for _, data in events(payload(received)))
