"""What the Containerfile says, read from the file itself: the user the image runs as, its
environment and cache directory, its entry point. The Kubernetes manifests (tests/test_deploy.py)
and the built image (tests/image/) are each held to it."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

CONTAINERFILE = Path(__file__).resolve().parents[1] / "Containerfile"


def instructions(path: Path = CONTAINERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined and comments left out."""
    found: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, arguments = (pending + stripped).partition(" ")
        found.append((keyword.upper(), arguments.strip()))
        pending = ""
    return found


def stage(name: str) -> list[tuple[str, str]]:
    """The instructions that make the stage ``name``, its FROM first, and those of the stages it
    is built FROM (a stage inherits their user, environment and entry point)."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for keyword, arguments in instructions():
        if keyword == "FROM":
            words = arguments.split()
            current = [(keyword, arguments)]
            stages[words[-1] if "AS" in (word.upper() for word in words) else words[0]] = current
        elif current:
            current.append((keyword, arguments))
    chain: list[tuple[str, str]] = []
    while name in stages:
        chain = stages[name] + chain
        name = stages[name][0][1].split()[0]
    return chain


def last(keyword: str, target: str) -> str:
    """The arguments of the last ``keyword`` instruction that applies to ``target``."""
    values = [arguments for word, arguments in stage(target) if word == keyword]
    assert values, f"the Containerfile's {target} stage has no {keyword}"
    return values[-1]


def env(target: str) -> dict[str, str]:
    """The environment the ENV instructions of ``target`` (and its parents) set."""
    found: dict[str, str] = {}
    for keyword, arguments in stage(target):
        if keyword == "ENV":
            for word in shlex.split(arguments):
                key, _, value = word.partition("=")
                found[key] = value
    return found


def exec_form(keyword: str, target: str) -> list[str]:
    value = json.loads(last(keyword, target))
    assert isinstance(value, list), f"{keyword} in exec form (JSON), as a runtime gets it"
    return [str(word) for word in value]


USER = last("USER", "proxy")
UID, _, GID = USER.partition(":")
CACHE_DIR = env("proxy")["XDG_CACHE_HOME"]
