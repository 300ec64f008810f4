"""Fixtures live in ``tests/support.py`` (importable by test modules); this re-exports them."""

from tests.support import client, fake, proxy

__all__ = ["client", "fake", "proxy"]
