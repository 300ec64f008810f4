"""The one JSON parser for what clients send (HTTP request bodies and WebSocket messages), with
one set of errors: every way a client's bytes can fail to be a JSON object is a 400.

CPython's own limits become client errors here, not server errors: a number of more than 4,300
digits raises ``ValueError`` (the int-string limit), deep nesting raises ``RecursionError``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from proxy.protocol.errors import bad_request, request_too_large


def _reject_constant(name: str) -> None:
    # Python's json accepts NaN and Infinity; JSON does not, and upstreams would choke on them.
    raise json.JSONDecodeError(f"{name} is not a JSON value", name, 0)


def parse_json_object(raw: bytes, max_bytes: int, what: str = "Request body") -> dict[str, Any]:
    """``raw`` as a JSON object; a 400 (413 past ``max_bytes``) :class:`ApiError` otherwise."""
    if len(raw) > max_bytes:
        raise request_too_large(max_bytes)
    if not raw:
        raise bad_request(f"{what} is empty; expected a JSON object.")
    try:
        text = raw.decode("utf-8-sig")  # a BOM is allowed (RFC 8259 lets parsers ignore it)
    except UnicodeDecodeError as error:
        raise bad_request(f"{what} is not valid UTF-8: {error}.", code="invalid_json") from None
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as error:
        raise bad_request(f"{what} is not valid JSON: {error}.", code="invalid_json") from None
    except ValueError:
        # The int-string limit (sys.get_int_max_str_digits): the client's input, not our bug,
        # and Python's own message (set_int_max_str_digits) is advice for the server's code.
        raise bad_request(
            f"{what} has an integer with more than {sys.get_int_max_str_digits()} digits; "
            "no field of this API takes one.",
            code="invalid_json",
        ) from None
    except RecursionError:
        # Deep nesting exhausts the parser's stack.
        raise bad_request(f"{what} is nested too deeply.", code="invalid_json") from None
    if not isinstance(value, dict):
        raise bad_request(f"{what} must be a JSON object.")
    return value
