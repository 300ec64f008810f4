"""Model loading's progress, said once per stage: one updating line on a terminal, one log line
per stage otherwise (a log file or journal gets no carriage returns)."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import TextIO

log = logging.getLogger("sluice.loading")

Reporter = Callable[[str, str], None]


def stage_reporter(stream: TextIO | None = None) -> Reporter:
    """``report(model, stage)``; the stage "ready" ends the model's line."""
    out = sys.stderr if stream is None else stream
    started: dict[str, float] = {}
    terminal = out.isatty()

    def report(model: str, stage: str) -> None:
        now = time.monotonic()
        since = now - started.setdefault(model, now)
        if not terminal:
            log.info("model %s: %s (%.1fs)", model, stage, since)
            return
        end = "\n" if stage in ("ready", "failed") else ""
        out.write(f"\r\x1b[Kloading {model}: {stage} ({since:.1f}s){end}")
        out.flush()

    return report
