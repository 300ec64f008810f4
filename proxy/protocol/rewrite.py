"""Edits to what crosses the proxy, sans-IO: a request body's fields set on its way upstream,
and a model's upstream name given back as its public one in the answers.

Requests are forwarded as the client's bytes; a body is rewritten only when a model needs it
(its ``upstream_model``, or a field the proxy must add), so a request with no edits costs
nothing. Edits are a mapping of field paths to values, dotted for nested objects
(``{"model": "served-name", "stream_options.include_usage": True}``): a JSON body is parsed
already (``CompletionRequest.body``) and is serialized again with them; a multipart form has
its top-level text fields replaced (or added), every other byte kept.

Answers are renamed at the bytes level: ``"model": "<upstream>"`` becomes ``"model":
"<public>"`` wherever it is an object's member, in each event of a stream and in a whole body.
That is exact for any valid JSON (a quote inside a JSON string is always escaped, so the
pattern cannot match inside one), in both encodings a server may use for a non-ASCII name.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from werkzeug.http import parse_options_header

from proxy.protocol.api_request import parse_api_request
from proxy.protocol.openai import CompletionRequest, Endpoint
from proxy.protocol.sse import SSESplitter

# A field path (dotted for nested objects) and the value it is set to, or REMOVE.
Edits = Mapping[str, Any]
# An edit's value that takes the field out (of a JSON body; a form's field stays).
REMOVE: Any = object()
# Endpoints whose parsed request holds nothing beyond the body (no ``detail`` form).
_BODY_ONLY = (Endpoint.CHAT, Endpoint.COMPLETIONS)


def with_edits(request: CompletionRequest, edits: Edits) -> CompletionRequest:
    """``request`` as it goes upstream with ``edits``: its bytes rewritten, and every parsed
    view of them (the body, the endpoint's own form a local model reads) what parsing the new
    bytes would give; what the proxy added to it (its session, its schedule) kept."""
    if not edits:
        return request
    raw = rewrite_body(request, edits)
    if request.endpoint in _BODY_ONLY:
        # Their parsed form is the body itself (model and stream, which no edit touches): the
        # edited copy is what parsing the new bytes again would give.
        return dataclasses.replace(request, body=edited_body(request.body, edits), raw=raw)
    edited = parse_api_request(
        raw, request.endpoint, path=request.path, content_type=request.content_type
    )
    return dataclasses.replace(
        edited,
        include_usage=request.include_usage,
        session=request.session,
        schedule=request.schedule,
    )


def rewrite_body(request: CompletionRequest, edits: Edits) -> bytes:
    """The body to send upstream: ``request.raw`` with ``edits`` applied; the client's bytes
    themselves when there are none, or when the body is neither JSON nor a multipart form (a
    pass-through of another type: nothing in it is the proxy's to edit)."""
    if not edits:
        return request.raw
    if request.endpoint is not Endpoint.PASSTHROUGH:
        return edit_json(request.body, edits)
    media_type, options = parse_options_header(request.content_type)
    if media_type == "application/json" or media_type.endswith("+json"):
        return edit_json(request.body, edits)
    if media_type == "multipart/form-data":
        return edit_form(request.raw, options.get("boundary", ""), edits)
    return request.raw


def edit_json(body: Mapping[str, Any], edits: Edits) -> bytes:
    """``body`` serialized with each path of ``edits`` set (intermediate objects created, or
    replaced where they are not objects); ``body`` itself is left as it was."""
    edited = edited_body(body, edits)
    try:
        return json.dumps(edited, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        # A lone surrogate ("\ud800"), which JSON may carry escaped but UTF-8 cannot encode.
        return json.dumps(edited, separators=(",", ":")).encode()


def edited_body(body: Mapping[str, Any], edits: Edits) -> dict[str, Any]:
    """A copy of ``body`` with each path of ``edits`` set; ``body`` is left as it was."""
    edited = dict(body)
    for path, value in edits.items():
        *parents, leaf = path.split(".")
        target = edited
        for name in parents:
            inner = target.get(name)
            # Copied on the way down: the parsed body is the request's, shared by its attempts.
            inner = dict(inner) if isinstance(inner, dict) else {}
            target[name] = inner
            target = inner
        if value is REMOVE:
            target.pop(leaf, None)
        else:
            target[leaf] = value
    return edited


def edit_form(raw: bytes, boundary: str, edits: Edits) -> bytes:
    """A multipart/form-data body with each text field named in ``edits`` replaced (every
    field of that name), or added before the closing delimiter when the form has none. File
    parts, headers and every other byte are kept as they came."""
    if not boundary:
        raise ValueError("a multipart/form-data body needs a boundary")
    for path, value in edits.items():
        if "." in path or '"' in path or not isinstance(value, str):
            raise ValueError(f"a form field is a top-level text field, not {path}={value!r}")
    # The delimiter is CRLF, "--" and the boundary, which no part contains (that is what
    # makes it one): the body splits exactly into the preamble, each part's
    # "\r\n<headers>\r\n\r\n<data>", and "--" with the epilogue. The first delimiter's CRLF
    # is the preamble's, absent when there is none.
    delimiter = b"\r\n--" + boundary.encode("latin-1")
    bare_start = raw.startswith(delimiter[2:])
    segments = (b"\r\n" + raw if bare_start else raw).split(delimiter)
    missing = dict(edits)
    closing = None
    for index in range(1, len(segments)):
        segment = segments[index]
        if segment.startswith(b"--"):
            closing = index
            break
        head_end = segment.find(b"\r\n\r\n")
        if head_end < 0:
            continue
        name = _field_name(segment[:head_end])
        if name is not None and name in edits:
            segments[index] = segment[: head_end + 4] + edits[name].encode()
            missing.pop(name, None)
    if missing:
        if closing is None:
            raise ValueError("the multipart/form-data body has no closing delimiter")
        segments[closing:closing] = [
            b'\r\nContent-Disposition: form-data; name="%s"\r\n\r\n%s'
            % (name.encode(), value.encode())
            for name, value in missing.items()
        ]
    joined = delimiter.join(segments)
    return joined[2:] if bare_start else joined


def _field_name(head: bytes) -> str | None:
    """The name of a text field's part, from its headers; None for a file part or none."""
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-disposition":
            kind, options = parse_options_header(value.decode("utf-8", "replace"))
            if kind == "form-data" and "filename" not in options:
                return options.get("name")
            return None
    return None


def model_renamer(upstream: str, public: str) -> Callable[[bytes], bytes] | None:
    """A function giving ``public`` back for ``upstream`` in every ``"model"`` member of a JSON
    text (an SSE event, or a whole body); None when the names are the same, so that a model
    without an alias pays nothing."""
    if upstream == public:
        return None
    # Both ways a server may write the name: as UTF-8, or with \\u escapes (Python's default).
    forms = {
        json.dumps(upstream, ensure_ascii=ascii_only).encode(): json.dumps(
            public, ensure_ascii=ascii_only
        ).encode()
        for ascii_only in (False, True)
    }
    pattern = re.compile(
        rb'("model"[ \t\r\n]*:[ \t\r\n]*)(' + b"|".join(re.escape(form) for form in forms) + rb")"
    )

    def substitute(match: re.Match[bytes]) -> bytes:
        return match[1] + forms[match[2]]

    def rename(data: bytes) -> bytes:
        return pattern.sub(substitute, data)

    return rename


class RenamingSplitter(SSESplitter):
    """An :class:`SSESplitter` whose events come out renamed: for an aliased model's streams
    only, so that the plain splitter's path stays as it is."""

    __slots__ = ("_rename",)

    def __init__(
        self, max_event_bytes: int, rename: Callable[[bytes], bytes], *, checked: bool = False
    ) -> None:
        super().__init__(max_event_bytes, checked=checked)
        self._rename = rename

    def feed(self, chunk: bytes) -> list[bytes]:
        rename = self._rename
        return [rename(event) for event in super().feed(chunk)]

    @property
    def renamed_pending(self) -> bytes:
        """The unfinished event, renamed: what is left when a stream ends without its
        delimiter."""
        return self._rename(self.pending) if self.pending else b""
