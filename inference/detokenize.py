"""UTF-8-safe incremental detokenization, sans-IO over any tokenizer's ``decode``.

Byte-level BPE tokens split characters (Chinese, emoji): one token may end with the first bytes
of a character whose last byte comes in the next token. Decoding such a prefix yields U+FFFD
for the incomplete bytes. This emits every complete character as soon as the tokens that make it
exist, never a split character, never U+FFFD for one, and never an empty string. Unlike
transformers' ``TextStreamer`` it does not wait for a space.

It decodes a small window of tokens (the last emitted token plus the new ones) rather than
single tokens, so tokenizers whose decoding depends on context (SentencePiece's leading space)
come out right, and each step costs a few tokens' decode, not the whole text's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"
# A UTF-8 character is at most 4 bytes; a byte-level tokenizer renders each incomplete byte as
# one U+FFFD. More trailing U+FFFD than could be one incomplete character are real (invalid
# bytes from the model) and are emitted rather than held forever.
_MAX_INCOMPLETE = 3

Decode = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    __slots__ = ("_decode", "_emitted", "_ids", "_start")

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self._ids: list[int] = []
        # The window decoded each step starts at _start; _emitted counts the characters of
        # the window's text already handed out.
        self._start = 0
        self._emitted = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now complete (possibly "")."""
        self._ids.append(token_id)
        text = self._decode(self._ids[self._start :])
        end = len(text)
        while end > 0 and text[end - 1] == REPLACEMENT and len(text) - end < _MAX_INCOMPLETE:
            end -= 1
        if end <= self._emitted:
            return ""
        delta = text[self._emitted : end]
        if end == len(text):
            # Nothing pending: restart the window at the last token, which stays as context.
            self._start = len(self._ids) - 1
            self._emitted = len(self._decode(self._ids[self._start :]))
        else:
            self._emitted = end
        return delta

    def flush(self) -> str:
        """The rest, at the end of generation. The bytes of a character that never finished
        (``max_tokens`` cut it, or the model stopped inside it) are dropped: the client gets
        the complete text, never U+FFFD for what was held back."""
        text = self._decode(self._ids[self._start :])
        end = len(text)
        while (
            end > self._emitted
            and text[end - 1] == REPLACEMENT
            and len(text) - end < _MAX_INCOMPLETE
        ):
            end -= 1
        delta = text[self._emitted : end]
        self._emitted = len(text)
        return delta

    @property
    def token_count(self) -> int:
        return len(self._ids)
