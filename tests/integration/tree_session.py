"""The tests that ``tests/integration/test_server_tree.py`` runs through the real-upstream
runner (``run_with_server``), in a pytest session of their own, in front of a stand-in server:
not collected by a plain ``pytest`` (the name has no ``test_`` prefix)."""

from __future__ import annotations

import os
import subprocess
import urllib.request

URL = os.environ.get("SLUICE_TREE_URL", "")
# Held here, so that the child outlives its test (as a leak does) without a warning from the GC.
_left_running: list[subprocess.Popen[bytes]] = []


def test_the_server_answers() -> None:
    with urllib.request.urlopen(URL + "/health", timeout=5) as response:
        assert response.status == 200


def test_leaves_a_child_running() -> None:
    _left_running.append(subprocess.Popen(["sleep", "600"]))
    assert _left_running[-1].poll() is None
