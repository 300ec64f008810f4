"""The one module that reaches inside the ``gguf`` package while transformers reads a GGUF file.

transformers reads a GGUF three times to load one model (the tokenizer, the config, the
weights), each time parsing every metadata field again (SmolLM2's vocabulary and merges:
about 295,000 fields), and it builds ``gguf``'s tensor-name map anew for each of the file's
tensors. Together that was about 6 of the 14 seconds until the first request could be
served. :func:`read_once` keeps one parsed reader per file and one name map per
architecture for the length of a load. What it relies on (gguf 0.13 to 0.19): transformers
imports ``GGUFReader`` and ``get_tensor_name_map`` from the ``gguf`` module at call time,
a reader is only read from, and a name map is a pure function of its arguments.

Without either attribute (another ``gguf``), the load goes on unchanged, and slower.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("sluice.inference")

# One load at a time replaces the module's attributes (loads are sequential anyway: a server
# loads its models one after the other).
_lock = threading.Lock()


@contextlib.contextmanager
def read_once() -> Iterator[bool]:
    """Within the block, each GGUF file is parsed once and each name map built once. Yields
    whether that is in effect."""
    try:
        import gguf as imported
    except ImportError:
        yield False
        return
    gguf: Any = imported
    missing = [name for name in ("GGUFReader", "get_tensor_name_map") if not hasattr(gguf, name)]
    if missing:
        log.info("gguf %s has no %s: each read parses the file", _version(), ", ".join(missing))
        yield False
        return
    with _lock:
        original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict[str, Any] = {}

        def reader(path: Any, *args: Any, **kwargs: Any) -> Any:
            if args or kwargs:  # a mode other than reading: not ours to share
                return original_reader(path, *args, **kwargs)
            key = os.path.realpath(os.fspath(path))
            if key not in readers:
                readers[key] = original_reader(path)
            return readers[key]

        gguf.GGUFReader = reader
        gguf.get_tensor_name_map = functools.cache(original_map)
        try:
            yield True
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_map
            readers.clear()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "(unknown)"
