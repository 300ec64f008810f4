"""``sluice bench``: a reproducible load generator that measures what the proxy promises.

It starts the fake upstream and the proxy as subprocesses (so that their CPU time and memory are
measured apart from the load generator's), opens N concurrent streaming chat requests ramped
over R seconds, makes a seeded fraction of the clients leave mid-stream (and another read
slowly), and reports:

* time to first token and the gaps between tokens, as the clients saw them;
* cancel propagation: from a client's ``close()`` to the moment the fake upstream saw its own
  connection go (both ``time.monotonic()``, which is one clock for every process on the
  machine), and how many tokens the upstream generated for nobody;
* the proxy's CPU time per relayed event and its peak RSS, read from ``/proc``, and its RSS
  (and the fake's) sampled every 50 ms over the run;
* for slow readers: whether they finished, and how far backpressure held the upstream back.

With ``--direct`` the identical load also runs straight at the fake upstream, and every figure
is printed for proxy, direct and proxy/direct. With ``--baseline`` the same load also runs
through the same proxy with the slow readers reading at full speed (proxy/baseline): the
proxy's memory with and without clients that stop reading. With ``--peer NAME`` (once per
system: ``trio-floor``, a bare trio relay with no contracts, the floor of the stack,
``fastapi``, the project's FastAPI + httpx gateway, ``envoy``, ``nginx``, ``vllm-router``,
``sglang-router``, ``portkey``, ``litellm``; ``proxy.bench.peers`` installs each under
``.peers/NAME`` and starts it in front of the same fake upstream), ``--peer sluice@REF``
(another Sluice, from a git revision's tree or a checkout, with the proxy's own config: an
A/B), or ``--peer URL --peer-pid PID`` for one already running, the same load also runs
through each, alternating with Sluice, and every figure is printed for each and proxy/NAME:
above all CPU per relayed event, the figure that survives a noisy machine, and CPU per
request; with ``--repeat`` the CPU ratios also run by run, with their median.
``--plots DIR`` (on by default
next to ``--markdown``) draws with matplotlib the latency CDFs, p50 and p99 marked, and each
relay's RSS as growth over its run's start (and per stream), in files named by the load's
settings that differ from the defaults (``bench-100-streams-vs-direct-latency.png``), so
that a rerun replaces its own.

Sluice reaches its upstream through one of two transports, ``--transport auto|lean|httpx``
(written as ``[upstream] transport`` into the config the bench gives the proxy; auto is lean
here, since the config also says ``proxy = "none"``: the bench's upstream is never reached
through the environment's proxy). With ``--versus-transport lean|httpx`` a second Sluice
process, identical but for its transport, runs the same load alternating with the first,
exactly as the peer does (A, B; then B, A; ``--repeat`` rounds); every figure is printed for
both, in columns labelled by transport (``proxy (lean)``, ``proxy (httpx)``) with the ratio
``lean/httpx`` (``--transport`` over ``--versus-transport``; an ``auto`` ``--transport`` is
then the other of the two). It combines with ``--peer``, ``--direct`` and ``--baseline``,
whose ratios stay those of the first proxy.

``--upstream-habit close-after-response|keepalive-timeout|late-close`` (with
``--upstream-habit-seconds S``, 0.05 by default, for the two timed ones) gives the fake
upstream a real server's way of ending kept-alive connections: close after every answer, close
one idle S seconds, or close S seconds after an answer without reading a request written
meanwhile (the keep-alive race). The proxy's pool must survive each with 0 errors; any
error is counted by kind, for each proxy, below the table.

The client must stay cheap at 1000 streams on a 2-core machine, or it would measure itself: it
is a tiny HTTP/1.1 client on raw trio sockets (one request per connection, ``Connection:
close``) that reads responses with ``protocol/http1.py``, the proxy's own codec, and counts
SSE events with ``bytes.find``; no JSON is decoded per token. Each request carries a unique
``"user": "bench-..."`` that the fake records with the request, which is how a client's close
is matched with what the upstream saw.

The modules, by role (this package re-exports what the other tools and the tests use):

* ``settings``: a load's settings, its key and file name; ``BenchError``;
* ``client``: the load-generating HTTP/1.1 and SSE client (one stream, one GET);
* ``procfs``: ``/proc`` readers (CPU time, run-queue wait, RSS) and the RSS sampler;
* ``summary``: one run's raw material and its figures;
* ``report``: the table, the JSON, the markdown section in docs/benchmarks.md;
* ``plots``: the matplotlib figures;
* ``children``: the processes the bench starts and stops, and a stoppable ``trio.run``;
* ``run``: the systems under test started, and the load run against each;
* ``cli``: the command line;
* ``digest``: one table across several loads' ``--json`` reports (each system beside the
  floor; this Sluice over another, run by run).
"""

from __future__ import annotations

from proxy.bench.children import (
    PEER_READY_TIMEOUT,
    ChildExited,
    pinned_argv,
    run_stoppable,
)
from proxy.bench.cli import (
    add_arguments,
    main,
    plots_dir,
    run_from_args,
    settings_from_args,
)
from proxy.bench.client import (
    EventCounter,
    ProtocolError,
    ResponseParser,
    StreamResult,
    build_request,
    chat_body,
    classify,
    http_get,
    run_stream,
)
from proxy.bench.plots import (
    LOG_FLOOR_MS,
    RssGrowth,
    cdf_label,
    cdf_points,
    latency_figure,
    latency_series,
    load_pyplot,
    log_axis_left,
    minor_tick_label,
    ms_text,
    per_stream_kib,
    plot_labels,
    rss_figure,
    rss_growth,
    rss_series,
    write_plots,
)
from proxy.bench.procfs import (
    RssTrace,
    machine_info,
    parse_cpu_seconds,
    parse_meminfo_total,
    parse_schedstat_wait,
    parse_vm_hwm,
    parse_vm_rss,
    process_cpu_seconds,
    process_cpu_wait,
    process_peak_rss,
    process_rss,
    sample_rss,
)
from proxy.bench.report import (
    BenchReport,
    all_ratios,
    column_labels,
    format_table,
    markdown_section,
    ratios,
    relative_link,
    table_rows,
    upsert_section,
)
from proxy.bench.run import (
    run_bench,
)
from proxy.bench.settings import (
    DEFAULT_HABIT_SECONDS,
    FIXED_MODES,
    HABITS,
    TIMED_HABITS,
    TRANSPORTS,
    BenchError,
    BenchSettings,
    CpuLayout,
    Mode,
    Role,
    assign_roles,
    cpu_layout,
    load_name,
)
from proxy.bench.summary import (
    RssStats,
    RunData,
    RunSummary,
    Samples,
    collect_samples,
    merge_runs,
    percentile,
    pooled_rss,
    round_figures,
    rss_stats,
    summarize,
    upstream_held,
)

# isort: split
# Private helpers that the sibling tools (balance, matrix, scorecard) share: importable from
# here, not part of the API.

__all__ = [
    "DEFAULT_HABIT_SECONDS",
    "FIXED_MODES",
    "HABITS",
    "LOG_FLOOR_MS",
    "PEER_READY_TIMEOUT",
    "TIMED_HABITS",
    "TRANSPORTS",
    "BenchError",
    "BenchReport",
    "BenchSettings",
    "ChildExited",
    "CpuLayout",
    "EventCounter",
    "Mode",
    "ProtocolError",
    "ResponseParser",
    "Role",
    "RssGrowth",
    "RssStats",
    "RssTrace",
    "RunData",
    "RunSummary",
    "Samples",
    "StreamResult",
    "add_arguments",
    "all_ratios",
    "assign_roles",
    "build_request",
    "cdf_label",
    "cdf_points",
    "chat_body",
    "classify",
    "collect_samples",
    "column_labels",
    "cpu_layout",
    "format_table",
    "http_get",
    "latency_figure",
    "latency_series",
    "load_name",
    "load_pyplot",
    "log_axis_left",
    "machine_info",
    "main",
    "markdown_section",
    "merge_runs",
    "minor_tick_label",
    "ms_text",
    "parse_cpu_seconds",
    "parse_meminfo_total",
    "parse_schedstat_wait",
    "parse_vm_hwm",
    "parse_vm_rss",
    "per_stream_kib",
    "percentile",
    "pinned_argv",
    "plot_labels",
    "plots_dir",
    "pooled_rss",
    "process_cpu_seconds",
    "process_cpu_wait",
    "process_peak_rss",
    "process_rss",
    "ratios",
    "relative_link",
    "round_figures",
    "rss_figure",
    "rss_growth",
    "rss_series",
    "rss_stats",
    "run_bench",
    "run_from_args",
    "run_stoppable",
    "run_stream",
    "sample_rss",
    "settings_from_args",
    "summarize",
    "table_rows",
    "upsert_section",
    "upstream_held",
    "write_plots",
]
