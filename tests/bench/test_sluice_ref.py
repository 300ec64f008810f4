"""``--peer sluice@REF``: another Sluice run by the load bench beside this tree's, from a git
revision's tree (extracted from a throwaway repository here) or a checkout's path; and a tiny
real bench whose other Sluice is a copy of this tree that says where it was imported from."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import trio

from proxy import bench
from proxy.bench import BenchError, BenchSettings
from proxy.bench.peers import installed, peer_dir, sluice_ref, spec
from proxy.bench.peers import start as peers_start
from proxy.bench.settings import sluice_ref_mode

ROOT = Path(__file__).resolve().parents[2]


def git(repo: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    done = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True, env=env
    )
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository whose one commit holds a ``proxy/cli.py``."""
    repo = tmp_path / "repo"
    (repo / "proxy").mkdir(parents=True)
    (repo / "proxy" / "cli.py").write_text("VERSION = 1\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "one")
    return repo


def test_a_sluice_peer_runs_as_sluice_and_its_ref() -> None:
    assert sluice_ref_mode("sluice@c2f1a75") == "sluice-c2f1a75"
    assert sluice_ref_mode("sluice@/work/ab-main/") == "sluice-ab-main"
    assert sluice_ref_mode("sluice@HEAD~3") == "sluice-HEAD-3"
    with pytest.raises(BenchError, match="after sluice@"):
        sluice_ref_mode("sluice@")
    settings = BenchSettings(peers=("sluice@c2f1a75", "trio-floor"))
    assert settings.peer_modes() == [
        ("sluice-c2f1a75", "sluice@c2f1a75"),
        ("trio-floor", "trio-floor"),
    ]
    assert settings.key() == BenchSettings().key() + " peers=sluice-c2f1a75,trio-floor"
    with pytest.raises(BenchError, match="twice"):
        BenchSettings(peers=("sluice@x/c2f1a75", "sluice@c2f1a75"))
    facts = spec("sluice@c2f1a75")
    assert facts.title == "Sluice at c2f1a75"
    assert "same config as the proxy" in facts.how
    with pytest.raises(BenchError, match="sluice@REF"):
        spec("sluice")


def test_a_revision_is_extracted_under_the_peers_folder_and_again_when_it_moves(
    repo: Path, tmp_path: Path
) -> None:
    root = tmp_path / "peers"
    name = "sluice@HEAD"
    assert not sluice_ref.installed(name, root, repo)
    first = git(repo, "rev-parse", "HEAD")
    folder = sluice_ref.install(name, root, repo)
    assert folder == root / "sluice-HEAD"
    assert (folder / "proxy" / "cli.py").read_text() == "VERSION = 1\n"
    assert (folder / sluice_ref.MARK).read_text().strip() == first
    assert sluice_ref.installed(name, root, repo)
    assert sluice_ref.version(name, root, repo) == first[:12]
    # Nothing was written to the repository: no worktree, no new ref.
    assert git(repo, "worktree", "list").count("\n") == 0
    assert git(repo, "status", "--porcelain") == ""
    (repo / "proxy" / "cli.py").write_text("VERSION = 2\n")
    git(repo, "commit", "-q", "-am", "two")
    assert not sluice_ref.installed(name, root, repo)  # HEAD names another commit now
    sluice_ref.install(name, root, repo)
    assert (folder / "proxy" / "cli.py").read_text() == "VERSION = 2\n"
    assert sluice_ref.installed(name, root, repo)


def test_an_unknown_revision_stops_with_one_line(repo: Path, tmp_path: Path) -> None:
    with pytest.raises(BenchError) as raised:
        sluice_ref.install("sluice@no-such-branch", tmp_path / "peers", repo)
    message = str(raised.value)
    assert "\n" not in message and "no-such-branch" in message
    assert not (tmp_path / "peers").exists()


def test_a_checkout_runs_where_it_is(repo: Path, tmp_path: Path) -> None:
    name = f"sluice@{repo}"
    assert sluice_ref.install(name, tmp_path, repo) == repo
    assert peer_dir(name) == repo and installed(name)
    commit = git(repo, "rev-parse", "--short=12", "HEAD")
    assert sluice_ref.version(name, tmp_path) == commit
    (repo / "proxy" / "cli.py").write_text("VERSION = 3\n")
    assert sluice_ref.version(name, tmp_path) == commit + " + changes"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert not installed(f"sluice@{empty}")
    with pytest.raises(BenchError, match="not a Sluice tree"):
        sluice_ref.install(f"sluice@{empty}", tmp_path, repo)


def _marked_copy(tree: Path) -> Path:
    """This project's ``proxy`` and ``inference`` copied to ``tree``, its ``proxy/cli.py``
    writing its own path to $BENCH_TEST_IMPORTED_FROM as it is imported."""
    ignore = shutil.ignore_patterns("__pycache__")
    for package in ("proxy", "inference"):
        shutil.copytree(ROOT / package, tree / package, ignore=ignore)
    cli = tree / "proxy" / "cli.py"
    future = "from __future__ import annotations\n"
    mark = (
        "import os as _os\n"
        'if _os.environ.get("BENCH_TEST_IMPORTED_FROM"):\n'
        '    with open(_os.environ["BENCH_TEST_IMPORTED_FROM"], "a") as _mark:\n'
        '        _mark.write(__file__ + "\\n")\n'
    )
    text = cli.read_text()
    assert future in text
    cli.write_text(text.replace(future, future + mark, 1))
    return tree


def alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


async def test_a_tiny_bench_runs_the_other_sluice_from_its_own_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = _marked_copy(tmp_path / "other")
    mark = tmp_path / "imported-from"
    monkeypatch.setenv("BENCH_TEST_IMPORTED_FROM", str(mark))
    # Enough events that each run's CPU is some clock ticks (10 ms each): a run that read as
    # none left its pair out of the ratios.
    settings = BenchSettings(
        streams=8,
        tokens=50,
        drop=0,
        ramp=0.05,
        ttft=0.02,
        interval=0.004,
        timeout=10.0,
        repeat=2,
        progress=False,
        peers=(f"sluice@{other}",),
    )
    with trio.fail_after(60):
        report = await bench.run_bench(settings, command="test")
    # Only the other Sluice ran the marked copy: this tree's proxy imported its own files.
    assert mark.read_text().splitlines() == [str(other / "proxy" / "cli.py")]
    assert set(report.summaries) == {"proxy", "sluice-other"}
    for summary in report.summaries.values():
        assert summary.errors == 0, summary.error_kinds
        assert summary.completed == 16
    facts = report.peers["sluice-other"]
    assert facts is not None and facts.title == f"Sluice at {other}"
    assert facts.version == "unknown (no git)"
    # Two runs each, paired run by run.
    assert [len(report.rounds[mode]) for mode in ("proxy", "sluice-other")] == [2, 2]
    per_event = report.to_json()["round_ratios"]["proxy/sluice-other"]["proxy_cpu_us_per_event"]
    assert len(per_event) == 2 and all(ratio > 0 for ratio in per_event)
    for pid in report.pids.values():
        assert not alive(pid), "a child outlived the bench"


def test_only_the_load_bench_starts_another_sluice(tmp_path: Path) -> None:
    # Its config is the proxy's own, which the load bench writes; the matrix has none for it.
    with pytest.raises(BenchError, match="load bench"):
        peers_start._launch(
            "sluice@c2f1a75", tmp_path, ("127.0.0.1", 1), "http://127.0.0.1:2", tmp_path, "k", "m"
        )
