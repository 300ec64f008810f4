"""OpenAI response shapes for locally generated text, sans-IO: bytes ready for the wire.

Streaming chunks are built from a prefix serialised once per request, so each token costs one
``json.dumps`` of its text.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def to_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class ChunkFormatter:
    """Chunks of one response: chat (``chat.completion.chunk``) or text (``text_completion``)."""

    def __init__(self, *, chat: bool, model: str, response_id: str, created: int | None = None):
        self.chat = chat
        self.model = model
        self.response_id = response_id
        self.created = int(time.time()) if created is None else created
        head = {
            "id": response_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": self.created,
            "model": model,
        }
        self._head = _dumps(head)[:-1]  # without the closing brace
        self._text_prefix = (
            self._head + ',"choices":[{"index":0,"delta":{"content":'
            if chat
            else self._head + ',"choices":[{"index":0,"text":'
        ).encode()
        self._text_suffix = (
            b'},"logprobs":null,"finish_reason":null}]}\n\n'
            if chat
            else b',"logprobs":null,"finish_reason":null}]}\n\n'
        )

    def _event(self, payload: str) -> bytes:
        return b"data: " + payload.encode() + b"\n\n"

    def role(self) -> bytes:
        """The first chat chunk, announcing the assistant role (as vLLM and OpenAI send it)."""
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._event(self._head + ',"choices":[' + _dumps(choice) + "]}")

    def text(self, text: str) -> bytes:
        return b"data: " + self._text_prefix + _dumps(text).encode() + self._text_suffix

    def finish(self, reason: str) -> bytes:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": reason}
        if self.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        return self._event(self._head + ',"choices":[' + _dumps(choice) + "]}")

    def usage(self, usage: Usage) -> bytes:
        return self._event(self._head + ',"choices":[],"usage":' + _dumps(usage.to_dict()) + "}")

    def whole(self, text: str, finish_reason: str, usage: Usage) -> bytes:
        """The body of a non-streaming response."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        body = {
            "id": self.response_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage.to_dict(),
        }
        return _dumps(body).encode()
