"""The UTF-8 boundary contract: byte-level BPE tokens split characters (Chinese, emoji), and a
client never sees half a character, nor U+FFFD for one. Proved on IncrementalDetokenizer over
the real SmolLM2 tokenizer (byte-level BPE).

Properties over Chinese, emoji (ZWJ sequences, flags, skin tones), accented Latin and ASCII:
the pieces join up to the text, no piece carries U+FFFD, and every character comes out as soon
as the token holding its last byte arrives, whether the tokens are the tokenizer's own or the
bytes split at random points.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from inference.detokenize import REPLACEMENT, IncrementalDetokenizer
from tests.model_fixtures import bytes_to_unicode, smol_tokenizer

__all__ = ["smol_tokenizer"]

BYTE_CHARS = bytes_to_unicode()

_ascii = st.characters(min_codepoint=0x20, max_codepoint=0x7E) | st.sampled_from(["\n", "\t"])
_chinese = st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF)
_accented = st.characters(min_codepoint=0xC0, max_codepoint=0x17F)
_emoji = st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF) | st.sampled_from(
    [
        "😀",
        "👨\u200d👩\u200d👧\u200d👦",  # ZWJ family
        "🏳\ufe0f\u200d🌈",  # rainbow flag: variation selector + ZWJ
        "👩🏽\u200d💻",  # skin tone + ZWJ
        "🇫🇷",  # regional indicator pairs
        "🇯🇵",
        "1\ufe0f\u20e3",  # keycap
        "❤\ufe0f",
    ]
)
_other = st.sampled_from(["€", "—", "…", "ß", "Ω", "한", "日本", "\U0001d518"])
texts = st.lists(st.one_of(_ascii, _chinese, _accented, _emoji, _other), max_size=24).map("".join)

SETTINGS = settings(max_examples=60, deadline=None)


def decoder(tokenizer: Any) -> Any:
    """Decoding exactly as ``inference.generation.Generator.decode`` does it."""

    def decode(ids: Sequence[int]) -> str:
        return str(
            tokenizer.decode(
                list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False
            )
        )

    return decode


def byte_token(tokenizer: Any, byte: int) -> int:
    token_id = tokenizer.convert_tokens_to_ids(BYTE_CHARS[byte])
    assert token_id != tokenizer.unk_token_id, f"byte {byte:#x} has no token"
    return int(token_id)


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    unicode_to_byte = {char: byte for byte, char in BYTE_CHARS.items()}
    return bytes(unicode_to_byte[char] for char in tokenizer.convert_ids_to_tokens(token_id))


def complete_prefix(text: str, fed: int) -> str:
    """The longest prefix of ``text`` whose UTF-8 bytes all lie within the first ``fed``."""
    size = 0
    for index, char in enumerate(text):
        size += len(char.encode())
        if size > fed:
            return text[:index]
    return text


def run(tokenizer: Any, text: str, ids: Sequence[int]) -> None:
    """Feed ``ids`` (which spell ``text``) and check every property after each push."""
    detokenizer = IncrementalDetokenizer(decoder(tokenizer))
    emitted = ""
    fed = 0
    for token_id in ids:
        piece = detokenizer.push(token_id)
        assert isinstance(piece, str)
        assert REPLACEMENT not in piece
        emitted += piece
        fed += len(token_bytes(tokenizer, token_id))
        # Promptness: every character whose last byte has arrived is out; nothing else is.
        assert emitted == complete_prefix(text, fed), (emitted, fed)
    rest = detokenizer.flush()
    assert REPLACEMENT not in rest
    assert emitted + rest == text
    assert rest == ""  # promptness at the last token already emitted everything
    assert detokenizer.flush() == ""
    assert detokenizer.token_count == len(ids)


@SETTINGS
@given(text=texts)
def test_real_tokenization_round_trips_promptly(smol_tokenizer: Any, text: str) -> None:
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    assert decoder(smol_tokenizer)(ids) == text
    run(smol_tokenizer, text, ids)


@SETTINGS
@given(text=texts, data=st.data())
def test_random_byte_splits_round_trip_promptly(
    smol_tokenizer: Any, text: str, data: st.DataObject
) -> None:
    """Cut the UTF-8 bytes anywhere; each piece is one real token when the vocabulary has it
    (and the draw says so), else its single-byte tokens."""
    vocab = smol_tokenizer.get_vocab()
    raw = text.encode()
    cuts = data.draw(st.sets(st.integers(1, max(1, len(raw) - 1)), max_size=len(raw)))
    bounds = sorted({0, len(raw), *(c for c in cuts if c < len(raw))})
    ids: list[int] = []
    for start, end in itertools.pairwise(bounds):
        piece = raw[start:end]
        spelled = "".join(BYTE_CHARS[b] for b in piece)
        if spelled in vocab and data.draw(st.booleans()):
            ids.append(vocab[spelled])
        else:
            ids.extend(byte_token(smol_tokenizer, b) for b in piece)
    assert b"".join(token_bytes(smol_tokenizer, i) for i in ids) == raw
    run(smol_tokenizer, text, ids)


@SETTINGS
@given(text=texts, data=st.data())
def test_real_tokens_mixed_with_exploded_ones(
    smol_tokenizer: Any, text: str, data: st.DataObject
) -> None:
    """The tokenizer's own tokens, some of them replaced by their single bytes."""
    ids: list[int] = []
    for token_id in smol_tokenizer.encode(text, add_special_tokens=False):
        if data.draw(st.booleans()):
            ids.extend(byte_token(smol_tokenizer, b) for b in token_bytes(smol_tokenizer, token_id))
        else:
            ids.append(token_id)
    run(smol_tokenizer, text, ids)


def test_smollm2_splits_an_emoji_across_two_tokens(smol_tokenizer: Any) -> None:
    ids = smol_tokenizer.encode(" 😀", add_special_tokens=False)
    assert smol_tokenizer.convert_ids_to_tokens(ids) == ["ĠðŁĺ", "Ģ"]
    detokenizer = IncrementalDetokenizer(decoder(smol_tokenizer))
    assert detokenizer.push(ids[0]) == " "  # the space is complete; the emoji's 3 bytes are not
    assert detokenizer.push(ids[1]) == "😀"
    assert detokenizer.flush() == ""


def test_chinese_split_byte_by_byte(smol_tokenizer: Any) -> None:
    detokenizer = IncrementalDetokenizer(decoder(smol_tokenizer))
    pieces = [detokenizer.push(byte_token(smol_tokenizer, b)) for b in "中文".encode()]
    assert pieces == ["", "", "中", "", "", "文"]


def test_lone_continuation_byte_comes_out_when_ascii_follows(smol_tokenizer: Any) -> None:
    detokenizer = IncrementalDetokenizer(decoder(smol_tokenizer))
    assert detokenizer.push(byte_token(smol_tokenizer, 0x80)) == ""
    assert detokenizer.push(byte_token(smol_tokenizer, ord("A"))) == REPLACEMENT + "A"
    assert detokenizer.flush() == ""


def test_bytes_held_at_the_end_are_dropped(smol_tokenizer: Any) -> None:
    """What was held back as the start of a character is not one when generation ends: the
    client gets the text without it, never U+FFFD."""
    detokenizer = IncrementalDetokenizer(decoder(smol_tokenizer))
    assert detokenizer.push(byte_token(smol_tokenizer, ord("x"))) == "x"
    assert detokenizer.push(byte_token(smol_tokenizer, 0x80)) == ""
    assert detokenizer.flush() == ""


def test_truncated_character_is_dropped_at_flush(smol_tokenizer: Any) -> None:
    detokenizer = IncrementalDetokenizer(decoder(smol_tokenizer))
    pieces = [detokenizer.push(byte_token(smol_tokenizer, b)) for b in "水😀".encode()[:6]]
    assert "".join(pieces) == "水"
    assert detokenizer.flush() == ""


def test_text_pending_before_a_truncated_character_still_comes_out(smol_tokenizer: Any) -> None:
    """Only the unfinished character's bytes are dropped, not complete text held with them."""
    detokenizer = IncrementalDetokenizer(decoder(smol_tokenizer))
    ids = smol_tokenizer.encode("河流", add_special_tokens=False)
    text = "".join(detokenizer.push(i) for i in ids)
    text += "".join(detokenizer.push(byte_token(smol_tokenizer, b)) for b in "水".encode()[:2])
    assert text + detokenizer.flush() == "河流"


def test_invalid_bytes_are_not_held_forever(smol_tokenizer: Any) -> None:
    """A run of invalid bytes is released once it is longer than any incomplete character."""
    detokenizer = IncrementalDetokenizer(decoder(smol_tokenizer))
    emitted = ""
    for count in range(1, 9):
        emitted += detokenizer.push(byte_token(smol_tokenizer, 0x80))
        assert set(emitted) <= {REPLACEMENT}
        assert count - len(emitted) <= 3  # at most one character's worth is held
    assert len(emitted) >= 5
    # What is still held at the end could have been a character's start: dropped.
    assert emitted + detokenizer.flush() == emitted


def test_special_tokens_emit_nothing_and_do_not_disturb_text(smol_tokenizer: Any) -> None:
    detokenizer = IncrementalDetokenizer(decoder(smol_tokenizer))
    hello = smol_tokenizer.encode("Hello 中", add_special_tokens=False)
    pieces = [detokenizer.push(i) for i in [hello[0], smol_tokenizer.bos_token_id, *hello[1:]]]
    assert pieces[1] == ""
    assert "".join(pieces) + detokenizer.flush() == "Hello 中"
