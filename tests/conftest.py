"""Fixtures live in ``tests/support.py`` and ``tests/model_fixtures.py`` (importable by test
modules); this makes them visible to every test."""

from tests.model_fixtures import smol_tokenizer, tiny_loaded_model
from tests.support import client, close_raw_clients, fake, proxy

__all__ = [
    "client",
    "close_raw_clients",
    "fake",
    "proxy",
    "smol_tokenizer",
    "tiny_loaded_model",
]
