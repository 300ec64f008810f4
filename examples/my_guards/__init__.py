"""An example guard package for Sluice (docs/guards.md): an output guard that redacts e-mail
addresses, and an after hook that writes each request's usage to a file, one JSON line each.

Serve it with the package on the path::

    PYTHONPATH=examples sluice serve --config conf/guards.toml

and tables such as::

    [[guards]]
    name = "redact-email"
    use = "my_guards:redact_emails"
    stage = "output"
    window_tokens = 16
    overlap_tokens = 4

    [[guards]]
    name = "usage-log"
    use = "my_guards:usage_file"
    stage = "after"
    [guards.options]
    path = "/var/log/sluice/usage.jsonl"
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import trio

from proxy.guards import AfterHook, Outcome, Window

# A plain, conservative address: local part, @, a dotted domain.
EMAIL = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")


async def redact_emails(window: Window) -> str | None:
    """``stage = "output"``: the window's text with every address replaced by ``[email]``;
    None (pass, as it is) when it holds none. Needs ``release = "after"`` (the default): with
    ``"before"`` the text is gone before the guard sees it."""
    if EMAIL.search(window.new_text) is None:
        return None
    return EMAIL.sub("[email]", window.new_text)


def usage_file(options: Mapping[str, Any]) -> AfterHook:
    """``stage = "after"``, a factory: called once per config with ``[guards.options]``
    (``path``, required), it returns the hook. Each request's usage is appended to the file as
    one JSON line; a lock keeps two lines from interleaving."""
    path = options.get("path")
    if not isinstance(path, str) or not path:
        raise ValueError("usage_file needs options.path, the file to append to")
    file = trio.Path(path)
    lock = trio.Lock()

    async def write_usage(outcome: Outcome) -> None:
        line = json.dumps(
            {
                "request_id": outcome.request_id,
                "key": outcome.key,
                "model": outcome.model,
                "status": outcome.status,
                "outcome": outcome.outcome,
                "input_tokens": outcome.input_tokens,
                "output_tokens": outcome.output_tokens,
                "refused_by": outcome.refused_by,
                "duration_s": round(outcome.duration, 6),
            }
        )
        async with lock, await file.open("a") as handle:
            await handle.write(line + "\n")

    return write_usage
