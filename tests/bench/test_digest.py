"""Figures across runs and loads: each run's CPU figures paired run by run with Sluice's and
their median (the report, its table and JSON), the digest's tables across loads (beside the
floor; this Sluice over another), and the Makefile's bench targets that feed them."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from proxy import bench
from proxy.bench import BenchSettings, RunData, StreamResult, digest, summarize
from proxy.bench.report import PeerFacts, round_lines, round_ratios

ROOT = Path(__file__).resolve().parents[2]


def results(n: int, events: int = 10) -> list[StreamResult]:
    return [
        StreamResult(
            index=i,
            tag=f"t{i}",
            role="normal",
            started=1.0,
            connected=1.001,
            sent=1.002,
            first_token=1.05,
            status=200,
            events=events,
            content=events - 3,
            done=True,
            complete=True,
            ended=True,
        )
        for i in range(n)
    ]


def report(
    settings: BenchSettings,
    cpu: dict[str, list[float]],
    *,
    streams: int = 10,
    events: int = 10,
    peers: dict[str, PeerFacts | None] | None = None,
    errors: dict[str, int] | None = None,
) -> bench.BenchReport:
    """A report whose modes spent ``cpu[mode]`` seconds in each of their runs."""
    runs: dict[str, list[RunData]] = {}
    for mode, seconds in cpu.items():
        for s in seconds:
            done = results(streams, events)
            for result in done[: (errors or {}).get(mode, 0)]:
                result.status = 502
            runs.setdefault(mode, []).append(RunData(mode, done, {}, 1.0, 0.1, proxy_cpu_s=s))
    pooled = {mode: bench.merge_runs(rs) for mode, rs in runs.items()}
    return bench.BenchReport(
        settings=settings,
        summaries={mode: summarize(run) for mode, run in pooled.items()},
        machine={},
        command="python -m proxy.bench ...",
        commit="abc1234",
        date="today",
        env={},
        pids={},
        peers=peers or {},
        rounds={mode: [bench.round_figures(r) for r in rs] for mode, rs in runs.items()},
    )


FLOOR = PeerFacts("trio floor (bare relay)", "trio", "raw sockets")
OTHER = PeerFacts("Sluice at c2f1a75", "Sluice at c2f1a75", "same config", "c2f1a75d81e9")


def test_runs_are_paired_run_by_run_and_their_median_printed() -> None:
    settings = BenchSettings(peers=("trio-floor",), repeat=3)
    made = report(settings, {"proxy": [0.3, 0.2, 0.33], "trio-floor": [0.1, 0.1, 0.1]})
    rates = round_ratios(made.rounds)
    assert [round(r, 2) for r in rates["proxy/trio-floor"]["proxy_cpu_us_per_event"]] == [
        3.0,
        2.0,
        3.3,
    ]
    lines = round_lines(made, {"proxy/trio-floor": "Sluice/floor"})
    # Per request says what per event says when every system relayed the same events.
    assert lines == [
        "Sluice/floor, proxy CPU per event (µs), run by run: 3.00x, 2.00x, 3.30x (median 3.00x)"
    ]
    (unlabelled,) = round_lines(made)
    assert unlabelled.startswith("proxy/trio-floor, proxy CPU per event (µs), run by run: 3.00x")
    assert f"\n- {unlabelled}\n" in bench.markdown_section(made)
    out = made.to_json()
    assert out["rounds"]["trio-floor"][0]["proxy_cpu_us_per_request"] == pytest.approx(1e4)
    assert out["round_ratios"]["proxy/trio-floor"]["proxy_cpu_us_per_request"][1] == 2.0
    # One run each: nothing run by run to say.
    assert round_lines(report(settings, {"proxy": [0.3], "trio-floor": [0.1]})) == []


def write_loads(tmp_path: Path, with_other: bool = False) -> list[str]:
    """Three loads' reports as make bench writes them: short requests, 100 streams, long."""
    other = {"sluice-c2f1a75": [0.3, 0.3, 0.3]} if with_other else {}
    peer = ("sluice@c2f1a75",) if with_other else ()
    short = BenchSettings(streams=1500, tokens=3, drop=0, repeat=3, peers=("trio-floor", *peer))
    hundred = BenchSettings(streams=100, repeat=3, peers=("trio-floor", "fastapi", *peer))
    long = BenchSettings(streams=200, tokens=1000, drop=0, repeat=3, peers=("trio-floor", "nginx"))
    made = [
        report(
            short,
            {"proxy": [0.3, 0.33, 0.36], "trio-floor": [0.1] * 3} | other,
            peers={"trio-floor": FLOOR} | ({"sluice-c2f1a75": OTHER} if with_other else {}),
        ),
        report(
            hundred,
            {"proxy": [0.3] * 3, "trio-floor": [0.1] * 3, "fastapi": [0.6] * 3} | other,
            peers={"trio-floor": FLOOR, "fastapi": None},
            errors={"fastapi": 2},
        ),
        report(long, {"proxy": [0.2] * 3, "trio-floor": [0.1] * 3, "nginx": [0.05] * 3}),
    ]
    paths = []
    for name, r in zip(("short", "hundred", "long"), made, strict=True):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(r.to_json()))
        paths.append(str(path))
    return paths


def test_the_floor_table_puts_each_system_over_the_floor_per_load(tmp_path: Path) -> None:
    loads = digest.read_loads(write_loads(tmp_path))
    assert [load.figure for load in loads] == [
        "proxy_cpu_us_per_request",
        "proxy_cpu_us_per_event",
        "proxy_cpu_us_per_event",
    ]
    header, rows = digest.floor_table(loads)
    assert header == [
        "system",
        "CPU per short request (1500 x 3 tokens)",
        "CPU per event, 100 streams x 50 tokens",
        "CPU per event, 200 streams x 1000 tokens",
    ]
    by_system = {row[0]: row[1:] for row in rows}
    assert list(by_system) == ["Sluice", "trio floor (bare relay)", "fastapi", "nginx"]
    # 0.99 s over 3 x 10 requests: 33 ms a request, 3.3x the floor's 10 ms.
    assert by_system["Sluice"] == [
        "33.00 ms (3.30x floor)",
        "3.00 ms (3.00x floor)",
        "2.00 ms (2.00x floor)",
    ]
    assert by_system["trio floor (bare relay)"] == ["10.00 ms", "1.00 ms", "1.00 ms"]
    assert by_system["fastapi"] == ["—", "6.00 ms (6.00x floor), 6 errors", "—"]
    assert by_system["nginx"] == ["—", "—", "500.0 µs (0.50x floor)"]


def test_the_floor_section_says_what_it_is_and_replaces_itself(tmp_path: Path) -> None:
    paths = write_loads(tmp_path)
    markdown = tmp_path / "benchmarks.md"
    markdown.write_text("# Benchmarks\n\nkept\n")
    for _ in range(2):
        digest.main([*paths, "--markdown", str(markdown)])
    text = markdown.read_text()
    assert text.count("<!-- bench:begin bench=cpu-beside-the-floor -->") == 1
    assert "kept" in text
    heading = re.search(r"^## (.*)$", text, re.M)
    assert heading is not None
    assert heading[1] == "CPU per request and per event, beside the floor"
    assert not re.search(r"issue|#\d", heading[1], re.I)
    assert "| Sluice | 33.00 ms (3.30x floor) | 3.00 ms (3.00x floor) |" in text
    assert "`python -m proxy.bench ...`; today, commit abc1234" in text


def test_versus_another_sluice_takes_the_median_of_the_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = write_loads(tmp_path, with_other=True)
    versus = digest.versus_sluice(digest.read_loads(paths))
    assert [(v.load.figure, v.mode) for v in versus] == [
        ("proxy_cpu_us_per_request", "sluice-c2f1a75"),
        ("proxy_cpu_us_per_event", "sluice-c2f1a75"),
    ]
    assert [round(r, 2) for r in versus[0].rounds] == [1.0, 1.1, 1.2]
    assert versus[0].median == pytest.approx(1.1)
    _, rows, over = digest.versus_table(versus, 1.05)
    assert [row[-2:] for row in rows] == [["1.10x", "no"], ["1.00x", "yes"]]
    assert over == [versus[0]]
    with pytest.raises(SystemExit) as failed:
        digest.main([*paths, "--limit", "1.05", "--check"])
    assert failed.value.code == 1
    assert "over 1.05x (or unknown): CPU per short request" in capsys.readouterr().out
    digest.main([*paths, "--limit", "1.10", "--check"])  # the median 1.10 is within
    out = capsys.readouterr().out
    assert "This Sluice over the other" in out and "1.00x, 1.10x, 1.20x" in out


def test_check_without_another_sluice_and_a_file_that_is_no_report(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as failed:
        digest.main([*write_loads(tmp_path), "--check"])
    assert failed.value.code == 1
    stray = tmp_path / "stray.json"
    stray.write_text('{"streams": 3}')
    with pytest.raises(bench.BenchError, match="not a load bench report"):
        digest.read_loads([str(stray)])
    with pytest.raises(bench.BenchError, match="no such report"):
        digest.read_loads([str(tmp_path / "missing.json")])


def recipe(target: str) -> list[str]:
    """The lines of a Makefile target's recipe, continuations joined and variables expanded."""
    makefile = (ROOT / "Makefile").read_text()
    variables = dict(re.findall(r"^([A-Z_]+) \??= ?(.*)$", makefile, re.MULTILINE))
    body = makefile.split(f"\n{target}:", 1)[1].split("\n", 1)[1]
    for _ in range(3):  # variables made of variables
        body = re.sub(r"\$\(([A-Z_]+)\)", lambda m: variables.get(m[1], m[0]), body)
    lines = []
    for line in body.replace("\\\n", " ").splitlines():
        if line and not line[0].isspace():
            break
        if line.strip() and not line.strip().startswith("#"):
            lines.append(line.strip())
    return lines


def arguments(line: str, module: str) -> list[str]:
    words = shlex.split(line)
    return words[words.index(module) + 1 :]


def test_make_bench_feeds_the_digest_the_three_loads_it_ran() -> None:
    lines = recipe("bench")
    loads = [arguments(line, "proxy.bench") for line in lines if " -m proxy.bench " in line]
    (summary,) = [arguments(line, "proxy.bench.digest") for line in lines if "bench.digest" in line]
    written = {argv[argv.index("--json") + 1]: argv for argv in loads if "--json" in argv}
    read = [word for word in summary if word.endswith(".json")]
    assert read and set(read) == set(written)
    short, hundred, long = (written[path] for path in read)
    assert "close-after-response" in short and short[short.index("--tokens") + 1] == "3"
    assert hundred[hundred.index("--streams") + 1] == "100"
    assert long[long.index("--tokens") + 1] == "1000" and long[long.index("--streams") + 1] == "200"
    for argv in (short, hundred, long):
        assert {"trio-floor"} <= set(argv)
    for argv in (short, hundred):
        assert {"fastapi", "litellm"} <= set(argv)
    assert "nginx" in long
    assert "--markdown" in summary


def test_make_bench_ab_runs_the_three_loads_with_ref_in_rounds_of_their_own() -> None:
    lines = recipe("bench-ab")
    text = " ".join(lines)
    loads = [shlex.split(argv) for argv in re.findall(r"-m proxy\.bench ([^;&|]*)", text)]
    assert len(loads) == 3
    for argv in loads:
        assert argv[argv.index("--peer") + 1] == "sluice@main"  # REF ?= main
        # Each bench run balanced: A, B, B, A.
        assert argv[argv.index("--repeat") + 1] == "2"
        assert argv[argv.index("--json") + 1].endswith("-$$round.json")
    tokens = sorted(
        int(argv[argv.index("--tokens") + 1]) if "--tokens" in argv else 50 for argv in loads
    )
    assert tokens == [3, 50, 1000]
    assert "for round in $$(seq 3)" in text
    (summary,) = [arguments(line, "proxy.bench.digest") for line in lines if "bench.digest" in line]
    assert "--check" in summary and summary[0] == "/tmp/sluice-bench-ab/*.json"
    assert summary[summary.index("--limit") + 1] == "1.10"
    assert lines[0] == "rm -rf /tmp/sluice-bench-ab"  # no report of another REF


def test_several_reports_of_one_load_give_one_ratio_each(tmp_path: Path) -> None:
    """make bench-ab's rounds: each bench run's pooled ratio, the median of those."""
    settings = BenchSettings(streams=100, repeat=2, peers=("sluice@c2f1a75",))
    paths = []
    for i, mine in enumerate((0.24, 0.2, 0.21)):
        made = report(settings, {"proxy": [mine] * 2, "sluice-c2f1a75": [0.2] * 2})
        paths.append(tmp_path / f"100-streams-{i}.json")
        paths[-1].write_text(json.dumps(made.to_json()))
    (versus,) = digest.versus_sluice(digest.read_loads([str(p) for p in paths]))
    assert [round(r, 2) for r in versus.rounds] == [1.2, 1.0, 1.05]
    assert versus.median == pytest.approx(1.05)
    _, rows, over = digest.versus_table([versus], 1.10)
    assert rows[0][3] == "1.20x, 1.00x, 1.05x (one per bench run, 3 runs)"
    assert rows[0][1] == "2.10 ms" and over == []
    # The floor table: one column for the load, the median of its reports.
    header, table = digest.floor_table(digest.read_loads([str(p) for p in paths]))
    assert header == ["system", "CPU per event, 100 streams x 50 tokens"]
    assert table == [["Sluice", "2.10 ms"], ["sluice-c2f1a75", "2.00 ms"]]


def test_digest_tolerates_a_report_without_rounds(tmp_path: Path) -> None:
    made: dict[str, Any] = report(BenchSettings(), {"proxy": [0.3]}).to_json()
    del made["rounds"], made["round_ratios"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(made))
    header, rows = digest.floor_table(digest.read_loads([str(path)]))
    assert rows == [["Sluice", "3.00 ms"]] and len(header) == 2
