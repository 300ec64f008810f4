"""The command line: start-up failures end with one clear line and exit status 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.cli import main


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


def test_missing_model_file_fails_before_serving(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(
        tmp_path, '[server]\nport = 0\n[models.m]\nbackend = "local"\npath = "/nope/m.gguf"\n'
    )
    assert main(["serve", "--config", config]) == 2
    err = capsys.readouterr().err
    assert "model error" in err and "/nope/m.gguf" in err
