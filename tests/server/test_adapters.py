"""The adapters: each library's internals checked at start-up, against the ranges that
pyproject.toml declares; a missing required internal stops start-up with one clear line, a
missing optional one falls back to the library's public path, and says so once."""

from __future__ import annotations

import logging
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from proxy.cli import main
from proxy.server import adapters
from proxy.server.adapters import ADAPTERS, StartupError
from proxy.server.adapters.base import release
from tests.support import DEADLINE, chat_body, sse_payloads, start_fake, start_proxy, stream_text

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fresh_checks() -> Iterator[None]:
    adapters.reset()
    yield
    adapters.reset()


def declared_ranges() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ranges = {}
    for requirement in project["dependencies"]:
        name, _, spec = requirement.partition(">=")
        ranges[name.strip().lower()] = ">=" + spec.strip()
    return ranges


def test_each_adapter_supports_exactly_the_range_pyproject_declares() -> None:
    ranges = declared_ranges()
    for adapter in ADAPTERS:
        assert ranges[adapter.distribution] == adapter.specifier, adapter.distribution


def test_the_installed_libraries_pass_every_check() -> None:
    reports = adapters.check_all()
    assert [report.distribution for report in reports] == [
        "hypercorn",
        "quart",
        "quart-trio",
        "trio",
        "httpcore",
    ]
    for report in reports:
        assert report.in_range, report
        assert report.missing == [], report


def test_version_ranges_compare_numerically() -> None:
    assert release("0.18.0") == (0, 18, 0)
    assert release("1.0rc1") == (1, 0)
    assert release("0.9") < release("0.17") < release("0.18.0") < release("0.19")


@pytest.mark.parametrize(
    "internal",
    [
        "hypercorn.protocol.h11.H11Protocol._create_stream",
        "quart.asgi.ASGIHTTPConnection._send_response",
        "quart_trio.asgi.TrioASGIHTTPConnection.handle_messages",
    ],
)
def test_a_missing_required_internal_stops_start_up_with_one_line(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    internal: str,
) -> None:
    monkeypatch.delattr(internal)
    with pytest.raises(StartupError, match=internal.replace(".", r"\.")):
        adapters.check_all()
    adapters.reset()
    config = tmp_path / "sluice.toml"
    config.write_text('[server]\nport = 0\n[models.m]\nupstreams = ["http://127.0.0.1:9"]\n')
    assert main(["serve", "--config", str(config)]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1
    assert error[0].startswith("sluice: cannot start: ")
    assert internal in error[0]


def test_an_out_of_range_version_is_one_line_and_the_internals_decide(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    hypercorn = ADAPTERS[0]
    monkeypatch.setattr(hypercorn, "below", "0.1")
    with caplog.at_level(logging.WARNING, logger="sluice.adapters"):
        reports = adapters.check_all()
    assert not reports[0].in_range
    (line,) = [record.getMessage() for record in caplog.records]
    assert "outside the range Sluice is tested with" in line


async def test_a_missing_optional_internal_falls_back_and_still_streams(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # hypercorn's own modules imported it by name already: only Sluice's use goes missing.
    monkeypatch.delattr("hypercorn.utils.suppress_body")
    with caplog.at_level(logging.WARNING, logger="sluice.adapters"), trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=5)
        # Through hypercorn: the fast path writes with its own wire.
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]}, server={"fast_path": False})
        assert not adapters.usable("h11_wire")
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            response = await client.post(proxy.url + "/v1/chat/completions", json=chat_body())
        assert response.status_code == 200
        assert stream_text(sse_payloads(response.text)) == "The quick brown fox jumps "
    lines = [record.getMessage() for record in caplog.records]
    assert len([line for line in lines if "suppress_body" in line]) == 1
    assert "every answer goes through hypercorn's ASGI send" in lines[0]
