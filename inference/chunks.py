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

    def __init__(
        self,
        *,
        chat: bool,
        model: str,
        response_id: str,
        created: int | None = None,
        index: int = 0,
    ):
        self.chat = chat
        self.model = model
        self.response_id = response_id
        self.created = int(time.time()) if created is None else created
        # Which choice these chunks carry (a request for n choices has n of them).
        self.index = index
        head = {
            "id": response_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": self.created,
            "model": model,
        }
        self._head = _dumps(head)[:-1]  # without the closing brace
        self._text_prefix = (
            self._head + f',"choices":[{{"index":{index},"delta":{{"content":'
            if chat
            else self._head + f',"choices":[{{"index":{index},"text":'
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
            "index": self.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._event(self._head + ',"choices":[' + _dumps(choice) + "]}")

    def text(self, text: str, logprobs: list[dict[str, Any]] | None = None) -> bytes:
        if logprobs is None:
            return b"data: " + self._text_prefix + _dumps(text).encode() + self._text_suffix
        # With logprobs (chat only): the general path, built whole.
        choice = {
            "index": self.index,
            "delta": {"content": text},
            "logprobs": {"content": logprobs},
            "finish_reason": None,
        }
        return self._event(self._head + ',"choices":[' + _dumps(choice) + "]}")

    def for_choice(self, index: int) -> ChunkFormatter:
        """The chunks of choice ``index`` of the same response (same id and time)."""
        return ChunkFormatter(
            chat=self.chat,
            model=self.model,
            response_id=self.response_id,
            created=self.created,
            index=index,
        )

    def finish(self, reason: str) -> bytes:
        choice: dict[str, Any] = {"index": self.index, "logprobs": None, "finish_reason": reason}
        if self.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        return self._event(self._head + ',"choices":[' + _dumps(choice) + "]}")

    def usage(self, usage: Usage) -> bytes:
        return self._event(self._head + ',"choices":[],"usage":' + _dumps(usage.to_dict()) + "}")

    def whole(
        self,
        text: str,
        finish_reason: str,
        usage: Usage,
        logprobs: list[dict[str, Any]] | None = None,
    ) -> bytes:
        """The body of a non-streaming response."""
        return self.whole_choices([(text, finish_reason, logprobs)], usage)

    def whole_choices(
        self, choices: list[tuple[str, str, list[dict[str, Any]] | None]], usage: Usage
    ) -> bytes:
        """The body of a non-streaming response with several choices (``n``)."""
        built: list[dict[str, Any]] = []
        for index, (text, finish_reason, logprobs) in enumerate(choices):
            choice: dict[str, Any] = {
                "index": index,
                "logprobs": None if logprobs is None else {"content": logprobs},
                "finish_reason": finish_reason,
            }
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            built.append(choice)
        body = {
            "id": self.response_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": built,
            "usage": usage.to_dict(),
        }
        return _dumps(body).encode()
