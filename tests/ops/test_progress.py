"""Model loading's progress: one updating line on a terminal, one log line per stage
otherwise."""

from __future__ import annotations

import io
import logging

import pytest

from proxy.ops.progress import stage_reporter


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_one_updating_line() -> None:
    out = Terminal()
    report = stage_reporter(out)
    for stage in ("reading the tokenizer", "reading and dequantizing the weights", "ready"):
        report("smollm2", stage)
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")  # one line, ended when ready
    assert text.count("\r\x1b[K") == 3  # each stage redraws it
    assert "loading smollm2: ready (" in text


def test_a_log_gets_one_line_per_stage(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sluice.loading")
    out = io.StringIO()
    report = stage_reporter(out)
    for stage in ("reading the tokenizer", "warming up", "ready"):
        report("smollm2", stage)
    assert out.getvalue() == ""  # no carriage returns in a log file
    lines = [record.getMessage() for record in caplog.records]
    assert [line.split(" (")[0] for line in lines] == [
        "model smollm2: reading the tokenizer",
        "model smollm2: warming up",
        "model smollm2: ready",
    ]
