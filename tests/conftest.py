"""Fixtures live in ``tests/support.py`` and ``tests/model_fixtures.py`` (importable by test
modules); this makes them visible to every test, and keeps each test's logging its own."""

import logging
from collections.abc import Iterator

import pytest

from proxy.ops.logs import ACCESS_LOGGER
from tests.model_fixtures import smol_tokenizer, tiny_loaded_model
from tests.support import client, close_raw_clients, fake, proxy, quiet_collector

__all__ = [
    "client",
    "close_raw_clients",
    "fake",
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
