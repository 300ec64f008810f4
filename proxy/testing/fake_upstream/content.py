"""What the fake says, and what it reads of a prompt: deterministic, so a test can predict
every answer (the text of token ``i``, an input's embedding, a pair's relevance score, a word's
token id) and every count (the texts of chat-style messages)."""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, Final

# ASCII only, so a token is one byte sequence however a client splits or decodes it.
WORDS: Final[tuple[str, ...]] = (
    "The",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "while",
    "seven",
    "wise",
    "owls",
    "watch",
    "from",
    "afar",
)
# Each word as a JSON string, as a token goes into a stream.
TOKEN_JSON: Final = tuple(json.dumps(word + " ").encode() for word in WORDS)
# What /tokenize reports as the context length.
MAX_MODEL_LEN: Final = 8192
# Token ids of words outside WORDS: a CRC-32 of the word, folded into a Llama-sized vocabulary.
VOCAB_SIZE: Final = 32_000
EMBEDDING_DIMENSIONS: Final = 8


def token_text(i: int) -> str:
    """The text of token ``i`` of every response."""
    return WORDS[i % len(WORDS)] + " "


def token_id(word: str) -> int:
    try:
        return WORDS.index(word)
    except ValueError:
        return len(WORDS) + zlib.crc32(word.encode()) % (VOCAB_SIZE - len(WORDS))


def embedding_vector(
    item: str | Sequence[int], dimensions: int = EMBEDDING_DIMENSIONS
) -> list[float]:
    """The vector of one embedding (or pooling) input: a text or a list of token ids.

    Each value is ``(b - 128) / 128`` for a byte ``b`` of the input's SHA-256, so it survives a
    float32 round trip exactly (base64 answers are float32).
    """
    if isinstance(item, str):
        raw = b"text:" + item.encode()
    else:
        raw = b"tokens:" + json.dumps(list(item)).encode()
    digest = hashlib.sha256(raw).digest()
    return [(digest[k] - 128) / 128 for k in range(dimensions)]


def relevance_score(query: str, document: str) -> float:
    """The /rerank and /score answer for a pair: a number in [0, 1) from its SHA-256."""
    digest = hashlib.sha256(query.encode() + b"\0" + document.encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32


def message_texts(messages: object) -> list[str]:
    """The text of chat-style messages: string contents and the ``text`` of content parts
    (OpenAI's ``text``/``input_text`` parts, Anthropic's text blocks alike)."""
    texts: list[str] = []
    if isinstance(messages, list):
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts.extend(
                    p["text"]
                    for p in content
                    if isinstance(p, dict) and isinstance(p.get("text"), str)
                )
    return texts


def prompt_tokens(body: Mapping[str, Any]) -> list[int] | None:
    """The token ids of a request's prompt, as ``/tokenize`` gives them: each word of the
    ``prompt`` (a string), or of the ``messages``' texts, is a token (:func:`token_id`); a
    ``prompt`` of token ids as it is. None for a body with neither."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
    ):
        return list(prompt)
    if isinstance(prompt, str):
        texts = [prompt]
    elif isinstance(body.get("messages"), list):
        texts = message_texts(body["messages"])
    else:
        return None
    return [token_id(word) for text in texts for word in text.split()]
