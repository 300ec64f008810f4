"""Fixtures of the API's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.api.test_limits_redis import RedisServer


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A throwaway redis-server on 127.0.0.1, for one test."""
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()
