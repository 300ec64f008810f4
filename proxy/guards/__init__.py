"""Guards: the public hook API. Import from here, and only from here; these names are stable.

A guard is an async (trio) function that a ``[[guards]]`` table names with ``use =
"package.module:function"``. It runs at one of four stages of a request, each with its own
context object and its own verdict:

========== ======================= ===================================================
stage      the guard is called     its verdict
========== ======================= ===================================================
request    before the queue, once  ``None`` (pass), a :class:`Refusal`, or a mapping:
           with a :class:`Prompt`  the request's body as edited (a system message
                                   added, a prompt redacted)
prompt     beside the upstream,    ``None`` or a :class:`Refusal`; the answer is held
           from its dispatch,      (at most ``hold_back_tokens``) until it passes
           with a :class:`Prompt`
output     per window of the       ``None``, a :class:`Refusal`, or a ``str``: the
           answer, with a          window's new text as the client is to get it
           :class:`Window`         (``release = "after"`` only)
after      once the answer ended,  nothing: its result and failures are counted, never
           with an :class:`Outcome` raised into a request
========== ======================= ===================================================

A guard refuses by returning a :class:`Refusal` or by raising one. Any other exception, and a
call that outlives the table's ``timeout``, is an error: the table's ``on_error`` decides
(``deny`` refuses, ``allow`` passes); it is counted, and logged once a call.

``use`` may also name a *factory*: a plain (not async) function taking the table's
``options`` and returning the guard. It is called once per config (at start-up and at each
reload), so a guard can compile its patterns or check its options there: an exception it
raises is a start-up error naming the guard.

What is guaranteed, on every stage but ``after``: a guard runs in the request's own nursery.
When the client leaves, a deadline passes, or the server's drain ends, it is cancelled with
the rest of the request (``trio.Cancelled`` raised at its next checkpoint: let it propagate,
and put any cleanup of your own in ``finally`` under a bounded shield). A refusal at the
``prompt`` or ``output`` stage closes the upstream within one event. ``after`` hooks run in
a bounded nursery owned by the server, never delay the client, and are given the drain's grace
to finish.

This module imports nothing but the standard library: a guard package depends on it alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeAlias

__all__ = [
    "STAGES",
    "AfterHook",
    "Outcome",
    "OutputGuard",
    "OutputVerdict",
    "Prompt",
    "PromptGuard",
    "Refusal",
    "RequestGuard",
    "RequestVerdict",
    "Stage",
    "Window",
]

Stage: TypeAlias = Literal["request", "prompt", "output", "after"]
# The stages, in the order a request passes them.
STAGES: tuple[Stage, ...] = ("request", "prompt", "output", "after")


class Refusal(Exception):
    """A guard's no. Returned or raised; the client gets ``message`` with ``status`` and
    ``code`` in the endpoint's own error shape (OpenAI's ``{"error": {...}}``, Anthropic's
    ``{"type": "error", ...}``): as the HTTP answer when nothing was sent yet, else as an
    in-band error event that ends the stream. ``reason`` goes to the access line
    (``guard_reason``), the metrics never: say why without quoting what was refused."""

    def __init__(
        self,
        message: str = "the request was refused by a policy",
        *,
        status: int = 400,
        code: str = "guard_refused",
        reason: str = "",
    ) -> None:
        super().__init__(message)
        if not 400 <= status <= 599:
            raise ValueError(f"a refusal's status is 4xx or 5xx, not {status}")
        self.message = message
        self.status = status
        self.code = code
        self.reason = reason or message

    def __repr__(self) -> str:
        return f"Refusal({self.message!r}, status={self.status}, code={self.code!r})"


@dataclass(frozen=True, slots=True)
class Prompt:
    """What a ``request`` or ``prompt`` guard sees: the request as the upstream will get it."""

    # The [[guards]] table's name, and its options as the table gave them.
    guard: str
    stage: Stage
    # The request's id (X-Request-ID), for a guard's own logs.
    request_id: str
    # "chat", "completions", "responses", "messages", "embeddings".
    endpoint: str
    # The model the client asked for (a configured model's name).
    model: str
    # The client's key's name ([[keys]] name); None when no keys are configured.
    key: str | None
    # The JSON body. Read-only to the guard: a request guard returns an edited copy.
    body: Mapping[str, Any]
    # The prompt as text: every message's text (system included), one per line.
    text: str
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Window:
    """What an ``output`` guard sees: one window of the answer's text.

    ``text`` is the window whole: the end of the previous window (``overlap_tokens`` of it)
    and then this window's own text, ``new_text``. A value split across events, or across two
    windows shorter than the overlap, is whole in ``text``."""

    guard: str
    request_id: str
    endpoint: str
    model: str
    key: str | None
    text: str
    new_text: str
    # Its number in the answer (0, 1, ...), and whether it is the answer's last.
    index: int
    final: bool
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def overlap(self) -> str:
        """The part of ``text`` that the previous window already saw."""
        return self.text[: len(self.text) - len(self.new_text)]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What an ``after`` hook sees: how a request ended and what it used."""

    guard: str
    request_id: str
    endpoint: str
    model: str
    key: str | None
    # The HTTP status the client got (499: it left before the head), and the access line's
    # outcome ("completed", "cancelled(mid_stream)", "guard_refused", an error's code...).
    status: int
    outcome: str
    # Tokens: in, out, out for nobody (the client gone, or made after a refusal); whether
    # the input is an estimate (no count from the model). None: not counted (a pass-through).
    input_tokens: int | None
    output_tokens: int | None
    for_nobody_tokens: int | None
    input_estimated: bool | None
    # The guard that refused the request, and why; None when none did.
    refused_by: str | None
    refused_reason: str | None
    # Seconds from its arrival to its end, and its time to first token (None: no token).
    duration: float
    ttft: float | None
    options: Mapping[str, Any] = field(default_factory=dict)


# A request guard's verdict: pass, refuse, or the body as edited.
RequestVerdict: TypeAlias = "Refusal | Mapping[str, Any] | None"
# An output guard's verdict: pass, refuse, or the window's new text as the client is to get it.
OutputVerdict: TypeAlias = "Refusal | str | None"


class RequestGuard(Protocol):
    """``stage = "request"``: before the queue, in the request's task; nothing of the request
    has started. Return None to pass, a :class:`Refusal` to refuse (the client gets it as the
    HTTP answer), or a mapping: the body the request goes on with (the next guard sees it)."""

    async def __call__(self, prompt: Prompt, /) -> RequestVerdict: ...


class PromptGuard(Protocol):
    """``stage = "prompt"``: beside the upstream, in the request's nursery, from the moment
    the request leaves the queue. The answer's bytes are held until every prompt guard
    passed (at most ``hold_back_tokens`` of them; then the upstream is not read), so it adds
    max(0, its time - the upstream's first token) to the time to first token. A refusal closes
    the upstream at once, before any of the answer is released."""

    async def __call__(self, prompt: Prompt, /) -> Refusal | None: ...


class OutputGuard(Protocol):
    """``stage = "output"``: per window of ``window_tokens`` of the answer's text (the last
    one shorter), in the request's nursery, beside the upstream. With ``release = "after"``
    a window reaches the client only once every output guard passed it (and a guard may
    return its new text rewritten); with ``"before"`` it goes at once and a refusal cuts what
    follows. A refusal closes the upstream within one event and ends the answer with an error
    (the HTTP answer if nothing was sent yet)."""

    async def __call__(self, window: Window, /) -> OutputVerdict: ...


class AfterHook(Protocol):
    """``stage = "after"``: once the answer has ended, however it ended, in a bounded nursery
    owned by the server: for audit and export. It never delays the client; at shutdown the
    drain waits for it up to the grace, then cancels it. What it returns is ignored; what it
    raises is counted (``verdict="error"``) and logged."""

    async def __call__(self, outcome: Outcome, /) -> None: ...
