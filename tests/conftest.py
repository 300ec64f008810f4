"""Fixtures live in ``tests/support.py`` and ``tests/model_fixtures.py`` (importable by test
modules); this makes them visible to every test, and keeps each test's logging its own. The
session also fails when the tests leave a process running (see ``tests/processes.py``)."""

import logging
import sys
from collections.abc import Iterator
from multiprocessing import resource_tracker

import pytest

from proxy.ops.logs import ACCESS_LOGGER
from tests import processes
from tests.model_fixtures import long_context_loaded_model, smol_tokenizer, tiny_loaded_model
from tests.support import (
    client,
    close_raw_clients,
    each_server_path,
    fake,
    proxy,
    quiet_collector,
)

_SUBREAPER = pytest.StashKey[bool]()

__all__ = [
    "client",
    "close_raw_clients",
    "each_server_path",
    "fake",
    "long_context_loaded_model",
    "proxy",
    "quiet_collector",
    "smol_tokenizer",
    "tiny_loaded_model",
]


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """A test that runs the CLI in-process (``main(["serve", ...])``) configures logging as a
    server does: the access logger gets its own handler and stops propagating, and pytest's
    capture then attaches to it too. Put every logger it touches back, so that no later test
    sees another's handlers (the test order follows the folders, not the contracts). The root
    logger is pytest's own (its capture handlers come and go with each phase of a test)."""
    touched = [logging.getLogger(ACCESS_LOGGER), logging.getLogger("httpx")]
    saved = [(log, list(log.handlers), log.level, log.propagate) for log in touched]
    yield
    for log, handlers, level, propagate in saved:
        log.handlers[:] = handlers
        log.setLevel(level)
        log.propagate = propagate


def pytest_sessionstart(session: pytest.Session) -> None:
    # An orphan's parent would be PID 1, out of the session's sight; as a subreaper, the
    # session becomes its parent instead.
    session.config.stash[_SUBREAPER] = processes.become_subreaper()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Every fixture has been torn down: nothing the tests started may still run. Whatever
    does is named, killed, and fails the run. (The real-upstream runner's server is not the
    tests': its plugin ends it in a ``tryfirst`` sessionfinish, before this one.)"""
    if not session.config.stash.get(_SUBREAPER, False):
        return
    # The session's own resource tracker (multiprocessing starts one for this process when
    # something here uses its semaphores or shared memory) ends when the session does.
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    left = processes.kill_left_behind(keep=frozenset({tracker} if tracker else ()))
    if not left:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = ["processes left running by the tests (killed now):", *left]
    if reporter is not None:
        reporter.ensure_newline()
        reporter.section("processes left behind", sep="=", red=True, bold=True)
        for line in lines:
            reporter.write_line(line)
    else:
        print("\n".join(lines), file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
