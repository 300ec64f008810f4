"""One bench: the systems under test started in a nursery, a warm-up stream each, then the load
run against each mode in an alternating schedule, measured from the client and from ``/proc``,
and matched with the fake upstream's records."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import trio

from proxy.bench.children import (
    READY_TIMEOUT,
    _first_leaf,
    _record_cpus,
    free_port,
    git_commit,
    pinned_argv,
    set_own_cpus,
    supervise,
    wait_ready,
)
from proxy.bench.client import (
    StreamResult,
    _Progress,
    build_request,
    chat_body,
    classify,
    http_get,
    run_stream,
)
from proxy.bench.peers import (
    PeerSpec,
    ensure_installed,
    peer_dir,
    peer_version,
    spec,
    start_peer,
)
from proxy.bench.procfs import (
    RssTrace,
    _raise_fd_limit,
    machine_info,
    own_cpu_seconds,
    process_cpu_seconds,
    process_cpu_wait,
    process_peak_rss,
    reset_peak_rss,
    sample_rss,
)
from proxy.bench.report import BenchReport, PeerFacts, column_labels, show_progress, write_text
from proxy.bench.settings import (
    BENCH_BUDGET,
    BENCH_GUARD_PATTERN,
    BenchError,
    BenchSettings,
    CpuLayout,
    Mode,
    _address,
    assign_roles,
    cpu_layout,
    is_sluice_ref,
)
from proxy.bench.summary import RunData, RunSummary, merge_runs, round_figures, summarize
from proxy.bench.tracing_ab import (
    TracingTally,
    collector,
    read_dropped,
    side_threads_cpu_seconds,
    traced_env,
    untraced_env,
)

if TYPE_CHECKING:
    from proxy.testing.otlp_receiver import Receiver

RECORDS_POLL: Final = 0.2
_MESSAGE_TAG: Final = re.compile(r"\(([^()]+)\)$")
# The key a peer the bench starts is given and every request to it carries (the fake upstream
# checks none; a gateway that requires one gets it).
BENCH_API_KEY: Final = "sk-bench"


def _proxy_config(
    port: int,
    upstream: str,
    settings: BenchSettings,
    transport: str | None = None,
    *,
    budgeted: bool = False,
    guarded: bool = False,
) -> str:
    """The config of a proxy the bench starts; ``transport``: its ``[upstream] transport``
    (None: ``settings.transport``; the versus proxy's is ``settings.versus_transport``). With
    ``--versus-budget`` both have the key every request carries, the ``budgeted`` one with a
    token budget too large to refuse anything: what metering costs, and nothing else. With
    ``--versus-guard`` the ``guarded`` one has one regex output guard on every request."""
    keys = ""
    if settings.versus_budget:
        keys = (
            "[[keys]]\n"
            'name = "bench"\n'
            f"sha256 = {json.dumps(hashlib.sha256(BENCH_API_KEY.encode()).hexdigest())}\n"
            + (f"tokens_per_minute = {BENCH_BUDGET}\n" if budgeted else "")
            + "\n"
        )
    return keys + (
        "# Written by proxy.bench for one run.\n"
        "[server]\n"
        'host = "127.0.0.1"\n'
        f"port = {port}\n"
        "graceful_timeout = 1.0\n\n"
        "[upstream]\n"
        # Nothing of the bench's own load may queue in front of the pool.
        f"max_connections = {max(256, settings.streams + 16)}\n"
        f"transport = {json.dumps(transport or settings.transport)}\n"
        # The bench's upstream is on this machine: never through the environment's proxy
        # (which would also make auto mean httpx).
        'proxy = "none"\n'
        + (f"socket_rcvbuf = {settings.proxy_rcvbuf}\n" if settings.proxy_rcvbuf else "")
        + "\n"
        f"[models.{json.dumps(settings.model_name)}]\n"
        f"upstreams = [{json.dumps(upstream)}]\n" + (_GUARD if guarded else "")
    )


# --versus-guard: the guarded proxy's one guard, at every model and key (windows of 32 tokens
# with 8 of overlap, each held until it passed: the defaults, what a user writes first).
_GUARD = (
    "\n[[guards]]\n"
    'name = "bench-regex"\n'
    'use = "regex"\n'
    'stage = "output"\n'
    "[guards.options]\n"
    f"deny = [{json.dumps(BENCH_GUARD_PATTERN)}]\n"
)


async def _fetch_records(address: tuple[str, int], since: int) -> list[dict[str, Any]]:
    status, body = await http_get(address, f"/_fake/requests?since={since}")
    if status != 200:
        raise BenchError(f"fake upstream answered {status} to /_fake/requests")
    records = json.loads(body)
    if not isinstance(records, list):
        raise BenchError("fake upstream's /_fake/requests is not a list")
    return records


def _by_tag(records: list[dict[str, Any]], tags: set[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for record in records:
        tag = _tag_of(record.get("body"))
        if tag is not None and tag in tags:
            out[tag] = record
    return out


def _tag_of(body: object) -> str | None:
    """The bench's tag in a request the fake received: its ``user``, else the end of its
    last message (client.chat_body writes both)."""
    if not isinstance(body, dict):
        return None
    tag = body.get("user")
    if isinstance(tag, str):
        return tag
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        found = _MESSAGE_TAG.search(str(messages[-1].get("content", "")))
        return found.group(1) if found else None
    return None


async def _collect_records(
    address: tuple[str, int], since: int, results: list[StreamResult], grace: float
) -> tuple[dict[str, dict[str, Any]], int]:
    """The fake's records of this run, once every request it got is settled or ``grace``
    seconds have passed (what is still pending then is what the figures must show)."""
    expected = {result.tag for result in results if result.sent is not None}
    deadline = trio.current_time() + grace
    while True:
        fetched = await _fetch_records(address, since)
        records = _by_tag(fetched, expected)
        settled = len(records) == len(expected) and all(
            r.get("outcome") != "pending" for r in records.values()
        )
        if settled or trio.current_time() >= deadline:
            break
        await trio.sleep(RECORDS_POLL)
    cursor = max((int(r["id"]) + 1 for r in fetched), default=since)
    return records, cursor


def _progress_counts(progress: _Progress, total: int) -> Callable[[], str]:
    return lambda: (
        f"started {progress.started}/{total}  finished {progress.finished}  "
        f"failed {progress.failed}"
    )


@dataclass
class _Peer:
    address: tuple[str, int]
    pid: int | None
    headers: tuple[tuple[str, str], ...] = ()
    spec: PeerSpec | None = None  # None: a peer given by URL


@dataclass
class _Endpoints:
    proxy: tuple[str, int] | None
    upstream: tuple[str, int] | None
    proxy_pid: int | None
    upstream_pid: int | None
    # Each peer's mode: where it listens, its PID (None: a URL's, not given), and what every
    # request to it carries.
    peers: dict[Mode, _Peer] = field(default_factory=dict)
    versus: tuple[str, int] | None = None  # the second Sluice, with --versus-transport
    versus_pid: int | None = None
    # With --versus-tracing: the OTLP receiver of the traced proxy ("proxy"), and its count.
    receiver: Receiver | None = None
    tally: TracingTally | None = None


async def _run_once(
    mode: Mode,
    label: str,
    settings: BenchSettings,
    endpoints: _Endpoints,
    cursor: int,
) -> tuple[RunData, int]:
    peer = endpoints.peers.get(mode)
    address = (
        peer.address
        if peer is not None
        else {"direct": endpoints.upstream, "versus": endpoints.versus}.get(mode, endpoints.proxy)
    )
    assert address is not None
    headers = peer.headers if peer is not None else _sluice_headers(settings)
    results, requests = _streams(mode, label, settings, address, headers)
    # The relay measured: the proxy, or a peer or the versus proxy in its place (their
    # figures fill the same rows).
    proxy_pid = (
        peer.pid
        if peer is not None
        else {"direct": None, "versus": endpoints.versus_pid}.get(mode, endpoints.proxy_pid)
    )
    if proxy_pid is not None:
        reset_peak_rss(proxy_pid)
    proxy_cpu0 = process_cpu_seconds(proxy_pid) if proxy_pid is not None else None
    proxy_wait0 = process_cpu_wait(proxy_pid) if proxy_pid is not None else None
    upstream_pid = endpoints.upstream_pid
    upstream_cpu0 = process_cpu_seconds(upstream_pid) if upstream_pid is not None else None
    client_cpu0 = own_cpu_seconds()
    tally = endpoints.tally if mode == "proxy" else None
    threads_cpu0 = side_threads_cpu_seconds(proxy_pid) if tally is not None and proxy_pid else None
    # A short lead so that creating the tasks is not counted against the first streams.
    t0 = trio.current_time() + 0.05
    wall0 = time.monotonic() + 0.05
    watched = {"proxy": proxy_pid} if proxy_pid is not None else {}
    if upstream_pid is not None:
        watched["fake_upstream"] = upstream_pid
    trace: RssTrace = {}
    await _drive(mode, settings, address, results, requests, watched, trace, t0=t0, wall0=wall0)
    wall = time.monotonic() - wall0
    client_cpu = own_cpu_seconds() - client_cpu0
    if tally is not None:
        # Until its spans are out: exporting them is part of what the traced run cost.
        assert endpoints.receiver is not None
        sent = sum(1 for result in results if result.sent is not None)
        await tally.settle(endpoints.receiver, sent)
        threads_cpu = side_threads_cpu_seconds(proxy_pid) if proxy_pid else None
        if threads_cpu is not None and threads_cpu0 is not None:
            tally.add_threads(threads_cpu - threads_cpu0, sum(r.events for r in results))

    def delta(
        pid: int | None, before: float | None, read: Callable[[int], float | None]
    ) -> float | None:
        after = read(pid) if pid is not None else None
        return None if after is None or before is None else after - before

    run = RunData(
        mode=mode,
        results=results,
        records={},
        wall_s=wall,
        client_cpu_s=client_cpu,
        proxy_cpu_s=delta(proxy_pid, proxy_cpu0, process_cpu_seconds),
        proxy_cpu_wait_s=delta(proxy_pid, proxy_wait0, process_cpu_wait),
        proxy_peak_rss=process_peak_rss(proxy_pid) if proxy_pid is not None else None,
        upstream_cpu_s=delta(upstream_pid, upstream_cpu0, process_cpu_seconds),
        records_known=endpoints.upstream is not None,
        rss=[trace] if trace else [],
        # Only a fake we started is known to keep the bench's schedule.
        interval=settings.interval if upstream_pid is not None else None,
    )
    if endpoints.upstream is not None:
        run.records, cursor = await _collect_records(
            endpoints.upstream, cursor, results, settings.grace
        )
    return run, cursor


def _streams(
    mode: Mode,
    label: str,
    settings: BenchSettings,
    address: tuple[str, int],
    headers: tuple[tuple[str, str], ...] = (),
) -> tuple[list[StreamResult], list[bytes]]:
    """Each client's empty result and its request, tagged ``label-i``."""
    # The baseline's slow readers read at full speed: the same draw with slow = 0 gives the
    # same leavers, and everyone else normal.
    slow = 0.0 if mode == "baseline" else settings.slow
    roles = assign_roles(settings.streams, settings.drop, slow, settings.seed)
    host, port = address
    results, requests = [], []
    model = settings.model_name
    for i, role in enumerate(roles):
        tag = f"{label}-{i}"
        results.append(StreamResult(index=i, tag=tag, role=role))
        body = chat_body(model, tag, settings.ttft, settings.interval, settings.tokens)
        requests.append(build_request(host, port, "/v1/chat/completions", body, headers))
    return results, requests


async def _drive(
    mode: Mode,
    settings: BenchSettings,
    address: tuple[str, int],
    results: list[StreamResult],
    requests: list[bytes],
    watched: dict[str, int],
    trace: RssTrace,
    *,
    t0: float,
    wall0: float,
) -> None:
    """The load: stream ``i`` starts at ``t0 + i * step`` (trio clock), all of them cut at
    the run's deadline; beside them the progress line and the RSS of ``watched``, sampled
    into ``trace`` (stamped from ``wall0``, ``time.monotonic()``)."""
    progress = _Progress()
    step = settings.ramp / settings.streams
    async with trio.open_nursery() as nursery:
        if settings.progress:
            shown = column_labels(settings).get(mode, mode)
            counts = _progress_counts(progress, settings.streams)
            nursery.start_soon(show_progress, shown, counts, sys.stderr)
        if watched:
            nursery.start_soon(partial(sample_rss, watched, trace, since=wall0))
        with trio.move_on_after(settings.ramp + settings.timeout):
            async with trio.open_nursery() as streams:
                for i, result in enumerate(results):
                    streams.start_soon(
                        partial(
                            run_stream,
                            address,
                            requests[i],
                            result,
                            start_at=t0 + i * step,
                            drop_at=settings.drop_at,
                            slow_delay=settings.slow_delay,
                            slow_rcvbuf=settings.slow_rcvbuf,
                            slow_mss=settings.slow_mss,
                            progress=progress,
                        )
                    )
        nursery.cancel_scope.cancel()


async def _warm_up(
    address: tuple[str, int],
    settings: BenchSettings,
    tag: str,
    headers: tuple[tuple[str, str], ...] = (),
) -> None:
    """One unmeasured stream, so that first-request costs (imports, pool set-up) are not
    counted as TTFT."""
    host, port = address
    body = chat_body(
        settings.model_name, tag, settings.ttft, settings.interval, min(settings.tokens, 3)
    )
    result = StreamResult(index=-1, tag=tag, role="normal")
    request = build_request(host, port, "/v1/chat/completions", body, headers)
    with trio.move_on_after(READY_TIMEOUT):
        await run_stream(
            address, request, result, start_at=trio.current_time(), drop_at=0, slow_delay=0
        )
    kind = classify(result)
    if kind is not None:
        raise BenchError(f"warm-up request to {host}:{port} failed: {kind}")


def _schedule(settings: BenchSettings) -> list[Mode]:
    """Alternate direct, proxy, versus and the peers across repeats (direct, proxy, versus,
    peers; then the peers reversed, versus, proxy, direct), so that none always runs first on a
    cold machine or last on a warm one. The
    baseline runs right before each proxy run: the proxy's memory is then at its lowest for
    the baseline, and whatever the slow readers add shows in the proxy run (the other way
    round, the baseline would inherit the slow run's heap)."""
    proxy: list[Mode] = ["baseline", "proxy"] if settings.baseline else ["proxy"]
    one: list[Mode] = ["direct"] if settings.direct else []
    one += proxy
    if (
        settings.versus_transport is not None
        or settings.versus_tracing
        or settings.versus_budget
        or settings.versus_fast_path
        or settings.versus_guard
    ):
        one.append("versus")
    one += [mode for mode, _ in settings.peer_modes()]
    order: list[Mode] = []
    for rep in range(settings.repeat):
        if rep % 2 == 0:
            order += one
        else:
            # Reversed, keeping the baseline right before its proxy run.
            back = [m for m in reversed(one) if m != "baseline"]
            order += [x for m in back for x in (proxy if m == "proxy" else [m])]
    return order


async def run_bench(settings: BenchSettings, *, command: str = "") -> BenchReport:
    """Start what is needed, run the load in every mode, stop the children, return figures."""
    machine = machine_info()  # first: its load average is the machine before our load
    _raise_fd_limit(settings.streams * 4 + 256)
    workdir = Path(tempfile.mkdtemp(prefix="sluice-bench-"))
    nonce = os.urandom(4).hex()  # tags unique even against an upstream reused across benches
    runs: dict[Mode, list[RunData]] = {}
    pids: dict[str, int] = {}
    # Before anything starts: a peer that is not installed and cannot be is a plain error,
    # not a half-run bench (installing one takes minutes, once).
    versions: dict[Mode, str] = {}
    for mode, name in settings.peer_modes():
        if "://" not in name:
            await trio.to_thread.run_sync(ensure_installed, name)
            versions[mode] = await trio.to_thread.run_sync(peer_version, name)
    layout = cpu_layout(os.sched_getaffinity(0), settings.workers) if settings.pin else None
    placed: dict[str, list[int]] = {}
    own_cpus = os.sched_getaffinity(0) if layout is not None else None
    tally = TracingTally() if settings.versus_tracing else None
    endpoints_peers: dict[Mode, _Peer] = {}
    try:
        if layout is not None:
            set_own_cpus(layout.load)
            _record_cpus(placed, "load_generator", 0)
        # The receiver's thread starts after the pinning: it runs where the load generator does.
        with contextlib.ExitStack() as stack:
            receiver = stack.enter_context(collector()) if tally is not None else None
            async with trio.open_nursery() as nursery:
                systems = _Systems(nursery, settings, workdir, layout, pids, receiver)
                endpoints = await systems.start()
                endpoints.receiver, endpoints.tally = receiver, tally
                endpoints_peers = endpoints.peers
                if layout is not None:
                    # Read back once each is ready: its mask was set as it started (pinned_argv).
                    for name, pid in pids.items():
                        _record_cpus(placed, name, pid)
                await _warm_up_each(endpoints, settings, nonce)
                cursor = 0
                for n, mode in enumerate(_schedule(settings)):
                    label = f"bench-{nonce}-{mode}{n}"
                    run, cursor = await _run_once(mode, label, settings, endpoints, cursor)
                    runs.setdefault(mode, []).append(run)
                if tally is not None and endpoints.proxy is not None:
                    tally.dropped = await read_dropped(endpoints.proxy)
                    tally.pair_ratios(runs.get("proxy", []), runs.get("versus", []))
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # A child that died or never came up, or Ctrl-C: raise that one error plainly, so
        # callers (and ``sluice``'s own ``except KeyboardInterrupt``) see it as it is. A mix,
        # or anything else (cancellation included), goes on as it came.
        for kind in (BenchError, KeyboardInterrupt):
            matched, rest = group.split(kind)
            if matched is not None and rest is None:
                raise _first_leaf(matched) from None
        raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if own_cpus is not None:
            set_own_cpus(own_cpus)
    modes = settings.modes()
    pooled: dict[str, RunData] = {mode: merge_runs(runs[mode]) for mode in modes if mode in runs}
    summaries: dict[str, RunSummary] = {mode: summarize(run) for mode, run in pooled.items()}
    rounds = {mode: [round_figures(run) for run in runs[mode]] for mode in pooled}
    return BenchReport(
        settings=settings,
        summaries=summaries,
        machine=machine,
        command=command,
        commit=await git_commit(),
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        env={k: v for k, v in os.environ.items() if k.startswith("SLUICE_")},
        pids=pids,
        runs=pooled,
        cpus=placed,
        tracing=tally,
        peers={
            mode: None
            if p.spec is None
            else PeerFacts(p.spec.title, p.spec.package, p.spec.how, versions.get(mode, ""))
            for mode, p in endpoints_peers.items()
        },
        rounds=rounds,
    )


def _sluice_headers(settings: BenchSettings) -> tuple[tuple[str, str], ...]:
    """What a request to a Sluice the bench started carries: with --versus-budget, the key."""
    return (("Authorization", f"Bearer {BENCH_API_KEY}"),) if settings.versus_budget else ()


async def _warm_up_each(endpoints: _Endpoints, settings: BenchSettings, nonce: str) -> None:
    """One unmeasured stream through each system the schedule runs the load at."""
    assert endpoints.proxy is not None
    sluice = _sluice_headers(settings)
    await _warm_up(endpoints.proxy, settings, f"bench-{nonce}-warmup-proxy", sluice)
    if endpoints.tally is not None:
        assert endpoints.receiver is not None
        await endpoints.tally.settle(endpoints.receiver, 1)  # its export is no run's cost
    if endpoints.versus is not None:
        await _warm_up(endpoints.versus, settings, f"bench-{nonce}-warmup-versus", sluice)
    for mode, peer in endpoints.peers.items():
        await _warm_up(peer.address, settings, f"bench-{nonce}-warmup-{mode}", peer.headers)
    if settings.direct:
        assert endpoints.upstream is not None
        await _warm_up(endpoints.upstream, settings, f"bench-{nonce}-warmup-direct")


class _Systems:
    """Starts the systems under test as children of ``nursery`` (which owns them: they stop
    when it ends), each ready when its start returns; ``pids`` gets the PID of each."""

    def __init__(
        self,
        nursery: trio.Nursery,
        settings: BenchSettings,
        workdir: Path,
        layout: CpuLayout | None,
        pids: dict[str, int],
        receiver: Receiver | None = None,
    ) -> None:
        self._nursery = nursery
        self._receiver = receiver
        self._settings = settings
        self._workdir = workdir
        self._load_cpus = layout.load if layout is not None else None
        self._proxy_cpus = layout.proxy if layout is not None else None
        self._pids = pids

    async def start(self) -> _Endpoints:
        """The fake upstream (unless one is given), the proxy (unless ``--target``), the
        versus proxy and the peers, as the settings ask."""
        settings, pids = self._settings, self._pids
        upstream_pid: int | None = None
        if settings.upstream is not None:
            upstream: tuple[str, int] | None = _address(settings.upstream)
            upstream_url: str | None = settings.upstream.rstrip("/")
        elif settings.target is not None:
            upstream = upstream_url = None  # an outside proxy, upstream unknown
        else:
            upstream, upstream_pid = await self._start_fake()
            upstream_url = f"http://127.0.0.1:{upstream[1]}"
        if settings.target is not None:
            proxy = _address(settings.target)
            proxy_pid = settings.proxy_pid
            await wait_ready("proxy", proxy, "", None)
        else:
            assert upstream_url is not None
            env = traced_env(self._receiver.url) if self._receiver is not None else None
            proxy, proxy_pid = await self._start_proxy(
                "proxy", settings.transport, upstream_url, env
            )
            pids["proxy"] = proxy_pid
        endpoints = _Endpoints(proxy, upstream, proxy_pid, upstream_pid)
        if settings.versus_transport is not None:
            # The same proxy but for its transport, alternating with the first (settings
            # refuse --versus-transport with --target, so upstream_url is ours).
            assert upstream_url is not None
            endpoints.versus, endpoints.versus_pid = await self._start_proxy(
                "versus", settings.versus_transport, upstream_url
            )
            pids["versus_proxy"] = endpoints.versus_pid
        elif settings.versus_tracing:
            # The same proxy untraced, alternating with the traced one (settings refuse
            # --versus-tracing with --target).
            assert upstream_url is not None
            endpoints.versus, endpoints.versus_pid = await self._start_proxy(
                "versus", settings.transport, upstream_url, untraced_env()
            )
            pids["versus_proxy"] = endpoints.versus_pid
        elif settings.versus_fast_path:
            # The same proxy with every request through the HTTP server and framework of
            # record (settings refuse --versus-fast-path with --target).
            assert upstream_url is not None
            endpoints.versus, endpoints.versus_pid = await self._start_proxy(
                "versus", settings.transport, upstream_url, {"SLUICE_SERVER_FAST_PATH": "false"}
            )
            pids["versus_proxy"] = endpoints.versus_pid
        elif settings.versus_budget:
            # The same proxy, its key without a token budget, alternating with the budgeted
            # one (settings refuse --versus-budget with --target).
            assert upstream_url is not None
            endpoints.versus, endpoints.versus_pid = await self._start_proxy(
                "versus", settings.transport, upstream_url, budgeted=False
            )
            pids["versus_proxy"] = endpoints.versus_pid
        elif settings.versus_guard:
            # The same proxy without the guard, alternating with the guarded one (settings
            # refuse --versus-guard with --target).
            assert upstream_url is not None
            endpoints.versus, endpoints.versus_pid = await self._start_proxy(
                "versus", settings.transport, upstream_url, guarded=False
            )
            pids["versus_proxy"] = endpoints.versus_pid
        pids_given = iter(settings.peer_pids)
        for mode, value in settings.peer_modes():
            if "://" in value:
                address = _address(value)
                await wait_ready(mode, address, "", None)
                endpoints.peers[mode] = _Peer(address, next(pids_given, None))
                continue
            assert upstream_url is not None  # settings refuse a named peer without one
            if is_sluice_ref(value):
                # Another Sluice: started as the proxy is, from its own tree.
                address, pid = await self._start_proxy(
                    mode, settings.transport, upstream_url, tree=peer_dir(value)
                )
                pids[mode] = pid
                facts = spec(value)
                endpoints.peers[mode] = _Peer(address, pid, _sluice_headers(settings), facts)
                continue
            started = await start_peer(
                self._nursery,
                value,
                upstream_url,
                self._workdir,
                api_key=BENCH_API_KEY,
                model=settings.model_name,
                cpus=self._proxy_cpus,
            )
            pids[mode] = started.pid
            headers = started.request_headers
            if not any(name.lower() == "authorization" for name, _ in headers):
                headers = (("Authorization", f"Bearer {BENCH_API_KEY}"), *headers)
            endpoints.peers[mode] = _Peer(started.address, started.pid, headers, started.spec)
        return endpoints

    async def _start_fake(self) -> tuple[tuple[str, int], int]:
        settings = self._settings
        upstream = ("127.0.0.1", free_port("127.0.0.1"))
        log = self._workdir / "fake-upstream.log"
        argv = [sys.executable, "-m", "proxy.cli", "fake-upstream"]
        argv += ["--host", "127.0.0.1", "--port", str(upstream[1])]
        argv += ["--ttft", str(settings.ttft), "--interval", str(settings.interval)]
        argv += ["--tokens", str(settings.tokens)]
        if settings.upstream_sndbuf:
            argv += ["--sndbuf", str(settings.upstream_sndbuf)]
        argv += settings.habit_argv()
        argv = pinned_argv(argv, self._load_cpus)
        process = await self._nursery.start(supervise, "fake upstream", argv, log)
        self._pids["fake_upstream"] = process.pid
        await wait_ready("fake upstream", upstream, "/health", log)
        return upstream, process.pid

    async def _start_proxy(
        self,
        mode: Mode,
        transport: str,
        upstream_url: str,
        env: dict[str, str] | None = None,
        *,
        budgeted: bool = True,
        guarded: bool = True,
        tree: Path | None = None,
    ) -> tuple[tuple[str, int], int]:
        """A Sluice proxy with ``transport`` in front of ``upstream_url`` (``env`` added to
        its environment): its address and PID. ``mode`` names its files and, for "versus",
        its transport (or its being untraced) the errors. ``tree``: another Sluice's files
        (``--peer sluice@REF``), which it starts in and imports ``proxy`` from."""
        settings = self._settings
        if tree is not None:
            env = {**(env or {}), "PYTHONPATH": str(tree)}
        other = (
            mode
            if tree is not None
            else "untraced"
            if settings.versus_tracing
            else "unbudgeted"
            if settings.versus_budget
            else "framework"
            if settings.versus_fast_path
            else "unguarded"
            if settings.versus_guard
            else transport
        )
        name = "proxy" if mode == "proxy" else f"proxy ({other})"
        stem = "proxy" if mode == "proxy" else f"proxy-{mode}"
        address = ("127.0.0.1", free_port("127.0.0.1"))
        config = self._workdir / f"{stem}.toml"
        write_text(
            config,
            _proxy_config(
                address[1],
                upstream_url,
                settings,
                transport,
                budgeted=budgeted,
                guarded=guarded and settings.versus_guard and tree is None,
            ),
        )
        log = self._workdir / f"{stem}.log"
        argv = [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config)]
        if settings.workers > 1:
            argv += ["--workers", str(settings.workers)]
        argv = pinned_argv(argv, self._proxy_cpus)
        process = await self._nursery.start(partial(supervise, env=env, cwd=tree), name, argv, log)
        await wait_ready(name, address, "/healthz", log)
        return address, process.pid
