"""The prompt guard's TTFT bench (proxy/bench/guard_ttft.py): its guard, its config, and a tiny
run through a real proxy. The wiring only, with no bound on the figures (those are
docs/benchmarks.md's, and a loaded machine moves them)."""

from __future__ import annotations

from pathlib import Path

import trio

from proxy.bench import guard_ttft
from proxy.bench.report import upsert_section
from proxy.config import load_config
from proxy.guards import Prompt


async def test_the_guard_takes_the_time_its_prompt_asks(autojump_clock: trio.abc.Clock) -> None:
    def prompt(text: str) -> Prompt:
        return Prompt("waits", "prompt", "r", "chat", "guarded", None, {}, text)

    started = trio.current_time()
    assert await guard_ttft.waits_as_asked(prompt("foxes (guard-wait=0.3)")) is None
    assert trio.current_time() - started == 0.3
    await guard_ttft.waits_as_asked(prompt("foxes"))
    assert trio.current_time() - started == 0.3


def test_the_config_guards_one_model_at_the_prompt_stage(tmp_path: Path) -> None:
    path = tmp_path / "proxy.toml"
    path.write_text(guard_ttft.proxy_config(1, "http://127.0.0.1:2"))
    config = load_config(path)
    (guard,) = config.guards
    assert (guard.stage, guard.models) == ("prompt", (guard_ttft.GUARDED,))
    assert guard.use == "proxy.bench.guard_ttft:waits_as_asked"
    assert {model.name for model in config.models} == {guard_ttft.GUARDED, guard_ttft.UNGUARDED}


async def test_a_tiny_run_measures_each_cell_and_writes_its_section(tmp_path: Path) -> None:
    with trio.fail_after(60):
        cells = await guard_ttft.measure(tmp_path, (0.05,), (0.0, 0.1), requests=1)
    assert [(cell.first_token, cell.guard) for cell in cells] == [(0.05, 0.0), (0.05, 0.1)]
    # Each TTFT is at least the upstream's first token; the guarded one at least L too.
    for cell in cells:
        assert cell.unguarded >= cell.first_token
        assert cell.guarded >= max(cell.first_token, cell.guard)
    text = upsert_section("", guard_ttft.SECTION_KEY, guard_ttft.section(cells, "cmd", None))
    assert "| 50 | 100 |" in text
    assert "max(0, L - T)" in text
