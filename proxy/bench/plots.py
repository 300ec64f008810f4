"""The bench's figures, drawn with matplotlib (imported only when plots are asked for): the
latency CDFs with p50 and p99 marked, and each relay's RSS as growth over its run's start."""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Final

from proxy.bench.procfs import RSS_PERIOD
from proxy.bench.report import BenchReport, PeerFacts, _title
from proxy.bench.settings import BenchError, BenchSettings
from proxy.bench.summary import RunData, collect_samples, percentile

# Points per CDF line in a plot: enough to be smooth, few enough for a small PNG.
CDF_POINTS: Final = 2000


def cdf_points(
    values: Iterable[float], max_points: int = CDF_POINTS
) -> tuple[list[float], list[float]]:
    """An empirical CDF as a step line's points: sorted values, and the fraction of values at
    or below each. More than ``max_points`` values are thinned to evenly spaced ranks (the
    first and the last always kept), so a line of 50,000 gaps costs what one of 2,000 does."""
    data = sorted(values)
    n = len(data)
    if not n:
        return [], []
    if n <= max_points:
        ranks = list(range(n))
    else:
        step = (n - 1) / (max(max_points, 2) - 1)
        ranks = sorted({round(i * step) for i in range(max(max_points, 2))})
    return [data[r] for r in ranks], [(r + 1) / n for r in ranks]


def latency_series(run: RunData) -> dict[str, list[float]]:
    """What the latency CDF plot draws for one mode, in milliseconds."""
    samples = collect_samples(run)
    return {
        "ttft": [v * 1000 for v in samples.ttfts],
        "gap": [v * 1000 for v in samples.gaps],
        "cancel": [v * 1000 for v in samples.cancels],
    }


@dataclass(frozen=True)
class RssGrowth:
    """One process's RSS over one run as growth over the run's own start: what the run cost,
    whatever the process held before it began."""

    seconds: list[float]  # since the run began
    mib: list[float]  # MiB above the first sample
    start_mib: float  # the first sample, in MiB

    @property
    def peak_mib(self) -> float:
        return max(self.mib)


def rss_growth(samples: Sequence[tuple[float, int]]) -> RssGrowth | None:
    """(seconds, bytes) samples in time order as MiB above the first; None for none."""
    if not samples:
        return None
    start = samples[0][1]
    return RssGrowth(
        seconds=[t for t, _ in samples],
        mib=[(size - start) / 2**20 for _, size in samples],
        start_mib=start / 2**20,
    )


def per_stream_kib(mib: Any, streams: int) -> Any:
    """MiB of growth as KiB per concurrent stream (numbers or numpy arrays alike)."""
    return mib * 1024 / streams


def rss_series(run: RunData, process: str = "proxy") -> list[RssGrowth]:
    """The RSS growth of ``process`` in each pooled run in which it was sampled."""
    lines = [rss_growth(trace.get(process, [])) for trace in run.rss]
    return [line for line in lines if line is not None]


def load_pyplot(without: str = "pass --no-plots") -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display), imported here and only
    here: the bench runs without matplotlib unless plots are asked for. ``without`` says how
    to do without them."""
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        raise BenchError(
            f"plots need matplotlib: pip install -e '.[bench]' (or {without})"
        ) from None
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


LOG_FLOOR_MS: Final = 0.01
_PANELS: Final = (
    ("ttft", "time to first token (ms)"),
    ("gap", "inter-token gap (ms)"),
    ("cancel", "cancel propagation (ms)"),
)


def log_axis_left(lines: Sequence[Sequence[float]]) -> float | None:
    """Where a log axis for these lines should begin: half the lowest 0.5th percentile of
    their positive values (so one outlier near 0 does not squash the rest); None for none."""
    lows = [
        low
        for values in lines
        if (low := percentile((v for v in values if v > 0), 0.5)) is not None
    ]
    return max(min(lows) / 2, LOG_FLOOR_MS) if lows else None


def cdf_label(name: str, values: Sequence[float]) -> str:
    zeros = sum(1 for v in values if v <= 0)
    return f"{name}, n={len(values)}" + (f", {zeros} of them 0" if zeros else "")


_STYLE: Final[dict[str, dict[str, Any]]] = {
    "proxy": {"color": "tab:blue"},
    "direct": {"color": "tab:gray", "linestyle": "--"},
    "baseline": {"color": "tab:green", "linestyle": "--"},
    "versus": {"color": "tab:purple"},
}
# The peers' colours, in the order they were named.
_PEER_COLOURS: Final = ("tab:orange", "tab:red", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


def _style(mode: str, settings: BenchSettings) -> dict[str, Any]:
    if mode in _STYLE:
        return _STYLE[mode]
    peers = [name for name, _ in settings.peer_modes()]
    index = peers.index(mode) if mode in peers else len(peers)
    return {"color": _PEER_COLOURS[index % len(_PEER_COLOURS)]}


def _log_axis(ax: Any, ticker: Any, left: float | None) -> None:
    """A log x axis from ``left``, labelled in plain numbers (50, not 5x10^1); within a decade
    and a half, the minor ticks get labels too, or a narrow axis would have none."""
    ax.set_xscale("log")
    plain = ticker.FuncFormatter(lambda value, _: f"{value:g}")
    ax.xaxis.set_major_formatter(plain)
    if left is None:
        return
    ax.set_xlim(left=left)
    low, high = ax.get_xlim()
    if high / low < 10**1.5:
        ax.xaxis.set_minor_formatter(ticker.FuncFormatter(minor_tick_label))
    else:
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())


def minor_tick_label(value: float, _: object = None) -> str:
    """2, 3 and 5 times a power of ten get a label; the others would crowd the axis."""
    if value <= 0:
        return ""
    mantissa = value / 10 ** math.floor(math.log10(value))
    return f"{value:g}" if round(mantissa, 6) in (2, 3, 5) else ""


def plot_labels(
    settings: BenchSettings, peers: Mapping[str, PeerFacts | None] | None = None
) -> dict[str, str]:
    """What each mode is called in the plots' legends: Sluice by name (and by transport where
    two run, or one was named), a peer by what it is."""
    a, b = settings.transport, settings.versus_transport
    if settings.versus_tracing:
        a, b = "traced", "untraced"
    if settings.versus_budget:
        a, b = "budgeted", "unbudgeted"
    if settings.versus_fast_path:
        a, b = "fast path", "framework"
    if settings.versus_guard:
        a, b = "guarded", "unguarded"
    sluice = "Sluice" if a == "auto" and b is None else f"Sluice ({a})"
    labels = {
        "proxy": sluice,
        "peer": "peer (--peer URL)",
        "direct": "direct to the fake upstream",
        "baseline": f"{sluice}, slow readers reading fast",
    }
    if b is not None:
        labels["versus"] = f"Sluice ({b})"
    for mode, facts in (peers or {}).items():
        if facts is not None:
            labels[mode] = facts.title
    return labels


def ms_text(value: float) -> str:
    """A latency in ms for a label: three significant digits, never an exponent."""
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


# The percentiles marked on every CDF line, with the fraction of samples at each.
_MARKS: Final = ((50, 0.5), (99, 0.99))


def _mark_percentiles(ax: Any, lines: Sequence[tuple[str, Sequence[float]]]) -> None:
    """A dot on each line at its p50 and p99 and a short label beside it in the line's colour;
    the labels of different lines are staggered, so that close ones stay legible. Room for
    them is made on the right of the (log) axis."""
    low, high = ax.get_xlim()
    high = high * (high / low) ** 0.2
    ax.set_xlim(low, high)
    for _, y in _MARKS:
        ax.axhline(y, color="0.6", linewidth=0.6, linestyle=":", zorder=1)
    for slot, (color, values) in enumerate(lines):
        for q, y in _MARKS:
            value = percentile(values, q)
            if value is None:
                continue
            # A value left of the axis (a gap of 0) is drawn at its edge, labelled as it is.
            at = min(max(value, low), high)
            ax.plot([at], [y], marker="o", markersize=4.5, color=color, linestyle="none", zorder=4)
            ax.annotate(
                f"p{q} {ms_text(value)} ms",
                (at, y),
                xytext=(5, -9 - 10 * slot),
                textcoords="offset points",
                color=color,
                fontsize=7.5,
                va="center",
                bbox={"boxstyle": "round,pad=0.1", "facecolor": "white", "edgecolor": "none"},
                zorder=5,
            )


def _latency_panels(series: dict[str, dict[str, list[float]]]) -> list[tuple[str, str]]:
    """A panel per latency that was measured (no drops: no cancel propagation)."""
    return [(k, label) for k, label in _PANELS if any(v[k] for v in series.values())]


def latency_figure(
    report: BenchReport, series: dict[str, dict[str, list[float]]] | None = None
) -> Any | None:
    """The latency CDFs, a panel per latency measured, p50 and p99 marked on every line; None
    when nothing was measured. ``series``: ``latency_series`` of each run, if at hand."""
    plt = load_pyplot()
    ticker = importlib.import_module("matplotlib.ticker")
    labels = plot_labels(report.settings, report.peers)
    if series is None:
        series = {mode: latency_series(run) for mode, run in report.runs.items()}
    panels = _latency_panels(series)
    if not panels:
        return None
    fig, axes = plt.subplots(
        1, len(panels), figsize=(5 * len(panels), 4.4), layout="constrained", squeeze=False
    )
    for ax, (key, label) in zip(axes[0], panels, strict=True):
        marked: list[tuple[str, Sequence[float]]] = []
        for mode, values in series.items():
            # Latencies span orders of magnitude: a log axis, left of which lie the gaps
            # of 0 (tokens that arrived in one read): the line starts at their share.
            xs, ys = cdf_points(max(v, LOG_FLOOR_MS) for v in values[key])
            if xs:
                name = cdf_label(labels.get(mode, mode), values[key])
                (line,) = ax.step(xs, ys, where="post", label=name, **_style(mode, report.settings))
                marked.append((line.get_color(), values[key]))
        _log_axis(ax, ticker, log_axis_left([values[key] for values in series.values()]))
        _mark_percentiles(ax, marked)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of samples ≤ x")
        ax.set_ylim(0, 1.02)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{_title(report, 'Sluice')}: latency CDFs, p50 and p99 marked")
    return fig


_REPEAT_DASHES: Final = ("-.", ":")


def rss_figure(report: BenchReport) -> Any | None:
    """Each relay's RSS as growth over its run's start (MiB, left) and per concurrent stream
    (KiB, right), one line per run; None when no relay's RSS was sampled."""
    plt = load_pyplot()
    labels = plot_labels(report.settings, report.peers)
    streams = report.settings.streams
    lines = {mode: rss_series(run) for mode, run in report.runs.items()}
    if not any(lines.values()):
        return None
    fig, ax = plt.subplots(figsize=(9, 4.8), layout="constrained")
    for mode, runs in lines.items():
        for i, line in enumerate(runs):
            shown = labels.get(mode, mode)
            name = shown if len(runs) == 1 else f"{shown} #{i + 1}"
            peak = line.peak_mib
            # A repeat in its mode's colour, told apart by its dashes.
            style = _style(mode, report.settings) | (
                {"linestyle": _REPEAT_DASHES[(i - 1) % 2]} if i else {}
            )
            ax.plot(
                line.seconds,
                line.mib,
                label=f"{name}: {line.start_mib:.1f} MiB at start, peak +{peak:.1f} MiB "
                f"({per_stream_kib(peak, streams):.0f} KiB per stream)",
                **style,
            )
    values = [v for runs in lines.values() for line in runs for v in line.mib]
    # At least 1 MiB of height: a flat line must look flat, not like noise blown up.
    top = max(max(values) * 1.2, 1.0)
    ax.set_ylim(min(min(values) * 1.2, 0) - 0.04 * top, top)
    ax.axhline(0, color="0.4", linewidth=0.8)
    ax.set_xlabel("seconds since the run began")
    ax.set_ylabel("RSS growth over the run's start (MiB)")
    right = ax.secondary_yaxis(
        "right",
        functions=(partial(per_stream_kib, streams=streams), lambda kib: kib * streams / 1024),
    )
    right.set_ylabel(f"KiB per concurrent stream ({streams} streams)")
    ax.grid(True, alpha=0.3)
    entries = sum(len(runs) for runs in lines.values())
    fig.legend(loc="outside lower center", ncols=2 if entries > 3 else 1, fontsize=8)
    fig.suptitle(f"{_title(report, 'Sluice')}: RSS growth, sampled every {RSS_PERIOD * 1000:g} ms")
    return fig


def write_plots(report: BenchReport, directory: Path) -> list[tuple[str, Path]]:
    """Draw the latency CDFs and the relays' RSS growth as PNGs in ``directory``, named by
    the load (``BenchSettings.slug``: a rerun of a load replaces its own files); return
    (description, path) of each file written."""
    plt = load_pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"bench-{report.settings.slug()}"
    written: list[tuple[str, Path]] = []
    series = {mode: latency_series(run) for mode, run in report.runs.items()}
    fig = latency_figure(report, series)
    if fig is not None:
        path = directory / f"{stem}-latency.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        names = ", ".join(label.split(" (")[0] for _, label in _latency_panels(series))
        written.append((f"Latency CDFs with p50 and p99: {names}", path))
    fig = rss_figure(report)
    if fig is not None:
        path = directory / f"{stem}-rss.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(("RSS growth over each run's start, and per stream", path))
    return written
