"""What a request asks of the scheduler in its headers and body, sans-IO: its band (priority)
and its client's timeouts."""

from __future__ import annotations

import math
import re

from proxy.protocol.errors import ApiError, bad_request

# The header a client asks for a less urgent band with (beside the body's ``priority``).
PRIORITY_HEADER = "x-sluice-priority"
# An integer as a header writes it: ASCII digits, perhaps signed (int() would also take "1_0"
# and non-ASCII digits, which no client means as a band).
_INTEGER = re.compile(r"[+-]?[0-9]+")


def positive_seconds(value: str | None) -> float | None:
    """A header's number of seconds, when it is a positive finite number; None otherwise (the
    Anthropic SDK may send the literal ``NOT_GIVEN``)."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds > 0 else None


# The least urgent band a request may ask for: bands label metrics, and a client must not be
# able to make up new ones without end.
LEAST_URGENT_BAND = 99


def request_band(key_band: int, *asked: object) -> int:
    """A request's band: its key's, or a less urgent one it asks for (a larger integer, in the
    body's ``priority`` or the ``x-sluice-priority`` header), at most LEAST_URGENT_BAND; never
    more urgent than its key's. What is not an integer asks for nothing here (a request's values
    are checked first, by :func:`asked_priority`)."""
    band = key_band
    for value in asked:
        if isinstance(value, str):
            try:
                value = int(value.strip())
            except ValueError:
                continue
        if isinstance(value, int) and not isinstance(value, bool):
            band = max(band, min(value, max(LEAST_URGENT_BAND, key_band)))
    return band


def asked_priority(header: str | None, body_value: object) -> int | None:
    """The band a request asks for (the less urgent of the ``x-sluice-priority`` header and the
    body's ``priority``), or None when it asks for none (neither given; a JSON null is not
    given). A value that is not an integer from 0 to LEAST_URGENT_BAND is a 400 naming it: a
    client that asked for a band it would not get must hear so, not be served in another.
    Whether the band is granted is :func:`request_band`'s: one more urgent than the key's is
    not an error, the key's band is used (and the answer's header says so)."""
    asked: list[int] = []
    if body_value is not None:
        # JSON's true is a bool, and 5.0 or "5" are not integers as JSON writes them.
        if not isinstance(body_value, int) or isinstance(body_value, bool):
            raise _malformed("'priority'", "priority", _json_kind(body_value))
        asked.append(_in_range(body_value, "'priority'", "priority"))
    if header is not None:
        text = header.strip()
        where = f"The {PRIORITY_HEADER} header"
        if not _INTEGER.fullmatch(text):
            raise _malformed(where, PRIORITY_HEADER, repr(text[:40]))
        try:
            value = int(text)
        except ValueError:  # more digits than Python converts: out of range all the same
            value = LEAST_URGENT_BAND + 1
        asked.append(_in_range(value, where, PRIORITY_HEADER))
    return max(asked, default=None)


def _in_range(value: int, where: str, param: str) -> int:
    if not 0 <= value <= LEAST_URGENT_BAND:
        # JSON may carry thousands of digits: the message says a short one back, not those.
        given = str(value) if abs(value) < 10**6 else f"a number of {len(str(abs(value)))} digits"
        raise _malformed(where, param, given)
    return value


def _malformed(where: str, param: str, given: str) -> ApiError:
    return bad_request(
        f"{where} must be an integer from 0 (most urgent) to {LEAST_URGENT_BAND}; got {given}.",
        param=param,
        code="invalid_priority",
    )


def _json_kind(value: object) -> str:
    """How JSON wrote ``value``, for the message (never the value itself, which may be long)."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, float):
        return "a number with a fraction or exponent"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"
