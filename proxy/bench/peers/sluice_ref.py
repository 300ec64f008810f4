"""Another Sluice as a peer, ``--peer sluice@REF``: an A/B of this tree against REF, which the
load bench runs exactly as it runs this tree's Sluice (the same config, the same Python, in
front of the same fake upstream, alternating run by run), only from REF's files.

REF is a git revision of this repository, whose tree is extracted with ``git archive`` under
``.peers/sluice-REF`` (nothing is written to the repository: no worktree is registered, no ref
moves) and extracted again when REF comes to name another commit; or the path of a checkout,
run as it is. Either way its process starts in that tree with ``PYTHONPATH`` set to it, so
``python -m proxy.cli`` imports that tree's ``proxy`` and not this one."""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Final

from proxy.bench.settings import SLUICE_REF, BenchError, sluice_ref_mode

REPO: Final = Path(__file__).resolve().parents[3]
# Written last by an extraction that finished: the commit it holds.
MARK: Final = "installed.txt"
GIT_TIMEOUT: Final = 300.0


def _ref(name: str) -> str:
    return name[len(SLUICE_REF) :]


def checkout(name: str) -> Path | None:
    """The checkout ``sluice@PATH`` names, or None where REF is not a directory."""
    path = Path(_ref(name)).expanduser()
    return path.resolve() if path.is_dir() else None


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    try:
        return subprocess.run(
            ["git", "-C", str(repo), *args],
            capture_output=True,
            timeout=GIT_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BenchError(f"git {args[0]} in {repo} failed: {exc}") from None


def resolve(name: str, repo: Path = REPO) -> str:
    """The full commit REF names in ``repo``; BenchError if it names none."""
    done = _git(repo, "rev-parse", "--verify", "--quiet", f"{_ref(name)}^{{commit}}")
    if done.returncode != 0:
        raise BenchError(
            f"--peer {name}: {_ref(name)!r} is neither a directory nor a commit of {repo}"
        )
    return done.stdout.decode().strip()


def tree(name: str, root: Path) -> Path:
    """Where that Sluice runs from: the checkout itself, or its tree under ``root``."""
    return checkout(name) or root / sluice_ref_mode(name)


def installed(name: str, root: Path, repo: Path = REPO) -> bool:
    """A checkout of Sluice, or a finished extraction of the commit REF names now."""
    path = checkout(name)
    if path is not None:
        return (path / "proxy" / "cli.py").is_file()
    try:
        return (tree(name, root) / MARK).read_text().strip() == resolve(name, repo)
    except (OSError, BenchError):
        return False


def install(name: str, root: Path, repo: Path = REPO) -> Path:
    """The tree of ``sluice@REF``, extracted first when it is missing or stale."""
    path = checkout(name)
    if path is not None:
        if not (path / "proxy" / "cli.py").is_file():
            raise BenchError(f"--peer {name}: {path} holds no proxy/cli.py (not a Sluice tree)")
        return path
    commit = resolve(name, repo)
    folder = tree(name, root)
    if (folder / MARK).is_file() and (folder / MARK).read_text().strip() == commit:
        return folder
    shutil.rmtree(folder, ignore_errors=True)  # another commit's tree, or an unfinished one
    folder.mkdir(parents=True)
    archive = _git(repo, "archive", "--format=tar", commit)
    if archive.returncode != 0:
        why = archive.stderr.decode(errors="replace").strip()
        raise BenchError(f"--peer {name}: git archive {commit[:12]} failed: {why}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(folder, filter="data")
    (folder / MARK).write_text(commit + "\n")
    return folder


def version(name: str, root: Path, repo: Path = REPO) -> str:
    """The commit that Sluice is (a checkout's HEAD, "+ changes" where its files differ)."""
    path = checkout(name)
    if path is None:
        try:
            return (tree(name, root) / MARK).read_text().strip()[:12]
        except OSError:
            return "not installed"
    head = _git(path, "rev-parse", "--short=12", "HEAD")
    if head.returncode != 0:
        return "unknown (no git)"
    changed = _git(path, "status", "--porcelain", "--untracked-files=no").stdout.strip()
    return head.stdout.decode().strip() + (" + changes" if changed else "")
