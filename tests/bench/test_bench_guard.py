"""The bench's guard A/B (``--versus-guard``): one regex output guard on every request of one
proxy, none on the other, alternating. The wiring only, in seconds; the figure is
docs/benchmarks.md's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from proxy import bench
from proxy.bench import run as bench_run
from proxy.bench.settings import BenchError, BenchSettings
from proxy.config import load_config
from tests.bench.test_bench import tiny_load


def test_versus_guard_settings_and_configs(tmp_path: Path) -> None:
    settings = BenchSettings(versus_guard=True)
    assert settings.key() == BenchSettings().key() + " guard=1"
    assert settings.slug() == "100-streams-guarded-vs-unguarded"
    assert "one regex output guard on every request" in settings.describe()
    with pytest.raises(BenchError, match="one at a time"):
        BenchSettings(versus_guard=True, versus_budget=True)
    with pytest.raises(BenchError, match="not --target"):
        BenchSettings(versus_guard=True, target="http://127.0.0.1:8000")
    guarded = bench_run._proxy_config(1, "http://127.0.0.1:2", settings, guarded=True)
    unguarded = bench_run._proxy_config(1, "http://127.0.0.1:2", settings, guarded=False)
    assert unguarded == bench_run._proxy_config(1, "http://127.0.0.1:2", BenchSettings())
    # The guarded one is the same config and one [[guards]] table, which serving accepts.
    assert guarded.startswith(unguarded) and "[[guards]]" not in unguarded
    path = tmp_path / "guarded.toml"
    path.write_text(guarded)
    (guard,) = load_config(path).guards
    assert (guard.use, guard.stage, guard.models, guard.keys) == ("regex", "output", (), ())
    assert bench.column_labels(settings)["proxy/versus"] == "guarded/unguarded"


async def test_tiny_bench_guarded_versus_unguarded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both proxies relay the same load whole and without an error, the first through its
    guard (40 tokens: a window of 32 checked mid-stream, and the rest at the end). The drop
    comes at token 20, which the first window releases while the stream runs on: past it, the
    last window's tokens come with the end of the stream, and a client reading them has the
    whole answer before it can leave."""
    configs: list[bool] = []
    make = bench_run._proxy_config

    def recording(*args: Any, guarded: bool = False, **kw: Any) -> str:
        configs.append(guarded)
        return make(*args, guarded=guarded, **kw)

    monkeypatch.setattr(bench_run, "_proxy_config", recording)
    settings = tiny_load(streams=4, tokens=40, drop=0.5, drop_at=20, versus_guard=True, grace=2.0)
    with trio.fail_after(60):
        report = await bench.run_bench(settings, command="test")
    assert configs == [True, False]
    assert list(report.summaries) == ["proxy", "versus"]
    for mode in ("proxy", "versus"):
        s = report.summaries[mode]
        assert s.errors == 0, (mode, s.error_kinds)
        assert (s.streams, s.completed, s.dropped) == (4, 2, 2)
    assert bench.all_ratios(report.summaries)["proxy/versus"]["proxy_cpu_us_per_event"]
