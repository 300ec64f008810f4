"""What a request asks of the scheduler in its headers and body, sans-IO: its band (priority)
and its client's timeouts."""

from __future__ import annotations

import math


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
    more urgent than its key's. What is not an integer asks for nothing."""
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
