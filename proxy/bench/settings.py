"""A load's settings: what ``sluice bench`` runs (streams, ramp, leavers, slow readers, the
systems compared), checked once; the key that names a load in docs/benchmarks.md and the file
name of its plots; who leaves and who reads slowly; where ``--pin`` puts each process."""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final, Literal
from urllib.parse import urlsplit

Role = Literal["normal", "drop", "slow"]
# What one run of the load goes through. "proxy": Sluice. "baseline": the proxy again, with
# every slow reader reading at full speed. "versus": a second Sluice process, the same but for
# its upstream transport (--versus-transport), or with --versus-tracing the same untraced,
# "proxy" being the traced one. "direct": straight at the fake upstream. A peer (another relay
# in front of the same fake) runs under its own mode: its name (``envoy``, ``nginx``...), or
# ``peer`` (``peer2``...) for one given by URL.
Mode = str
FIXED_MODES: Final[tuple[Mode, ...]] = ("proxy", "versus", "direct", "baseline")
# A --peer that is a name: the project's FastAPI peer by another name.
PEER_AUTO: Final = "auto"
PEER_AUTO_NAME: Final = "fastapi"
# A --peer that runs another Sluice: ``sluice@REF``, REF a git revision of this repository
# (its tree extracted under .peers/) or the path of a checkout. Its mode: ``sluice-REF``.
SLUICE_REF: Final = "sluice@"
# Sluice's upstream transports (``[upstream] transport``), as proxy.config knows them.
TRANSPORTS: Final = ("auto", "lean", "httpx")
# The fake upstream's connection habits (its flag of the same name, "none": no flag).
HABITS: Final = ("none", "close-after-response", "keepalive-timeout", "late-close")
TIMED_HABITS: Final = ("keepalive-timeout", "late-close")
DEFAULT_HABIT_SECONDS: Final = 0.05
# --versus-budget: tokens per minute that no load of the bench comes near (nothing refused).
BENCH_BUDGET: Final = 10**12
# --versus-guard: the deny pattern of the one regex output guard (the fake's tokens never
# match it: every window is checked, and passes, as most answers do).
BENCH_GUARD_PATTERN: Final = r"SECRET-\d{6}"


class BenchError(Exception):
    """The bench could not run (bad settings, a child that failed to start or died)."""


def is_sluice_ref(value: str) -> bool:
    """Whether a --peer value is another Sluice (``sluice@REF``)."""
    return value.startswith(SLUICE_REF)


def sluice_ref_mode(value: str) -> Mode:
    """The mode of ``sluice@REF``: ``sluice-`` and REF's last path part, in the characters a
    load's key and a file name keep (``sluice@c2f1a75`` runs as ``sluice-c2f1a75``,
    ``sluice@/work/ab-main`` as ``sluice-ab-main``)."""
    ref = value[len(SLUICE_REF) :].rstrip("/")
    last = ref.rsplit("/", 1)[-1]
    if not last:
        raise BenchError(f"--peer {value}: name a git revision or a checkout after sluice@")
    return "sluice-" + "".join(c if c.isalnum() or c in "._-" else "-" for c in last)


def assign_roles(streams: int, drop: float, slow: float, seed: int) -> list[Role]:
    """Which clients leave early and which read slowly: a seeded draw, identical for every run
    of one invocation (proxy and direct get the same load)."""
    if not (0 <= drop <= 1 and 0 <= slow <= 1 and drop + slow <= 1):
        raise BenchError("--drop and --slow must be fractions in [0, 1] with a sum <= 1")
    order = list(range(streams))
    random.Random(seed).shuffle(order)
    dropped = round(streams * drop)
    slowed = min(round(streams * slow), streams - dropped)
    roles: list[Role] = ["normal"] * streams
    for i in order[:dropped]:
        roles[i] = "drop"
    for i in order[dropped : dropped + slowed]:
        roles[i] = "slow"
    return roles


@dataclass(frozen=True)
class BenchSettings:
    streams: int = 100
    ramp: float = 1.0
    ttft: float = 0.05
    interval: float = 0.02
    tokens: int = 50
    drop: float = 0.3
    drop_at: int = 15
    slow: float = 0.0
    slow_delay: float = 0.2
    slow_rcvbuf: int = 0  # SO_RCVBUF of slow readers' sockets; 0: the OS default
    slow_mss: int = 0  # TCP_MAXSEG of slow readers' sockets; 0: the OS default
    upstream_sndbuf: int = 0  # the fake's SO_SNDBUF; 0: the OS default
    proxy_rcvbuf: int = 0  # the proxy's SO_RCVBUF towards the upstream; 0: the OS default
    event_pad: int = 0  # bytes added to every event (through the model name, which each repeats)
    seed: int = 1
    direct: bool = False
    baseline: bool = False
    repeat: int = 1
    grace: float = 2.0
    timeout: float = 120.0
    target: str | None = None
    upstream: str | None = None
    proxy_pid: int | None = None
    # Peers run side by side with the proxy, alternating: each a name (a system the bench
    # installs under .peers/ and starts; "auto" is "fastapi") or the URL of one already running
    # (``peer_pids``: their PIDs, in the order of the URLs).
    peers: tuple[str, ...] = ()
    peer_pids: tuple[int, ...] = ()
    model: str = "fake-model"
    progress: bool = True
    workers: int = 1  # worker processes of the proxy the bench starts
    # The proxy (and the peer) on CPUs of their own, the load generator and the fake on the
    # others: latency figures then show the relay's cost, not a wait for a core it shares.
    pin: bool = False
    # The proxy's ``[upstream] transport``; with ``versus_transport``, a second proxy with
    # that one runs the same load, alternating (an "auto" ``transport`` becomes the other).
    transport: str = "auto"
    versus_transport: str | None = None
    # How the fake upstream ends kept-alive connections (HABITS); the seconds of a timed one
    # (None: DEFAULT_HABIT_SECONDS for those, and nothing for the others).
    upstream_habit: str = "none"
    upstream_habit_seconds: float | None = None
    # The proxy traced (every request, exported to a receiver in the bench) and a second one,
    # "versus", the same untraced, alternating: what tracing costs.
    versus_tracing: bool = False
    # The proxy with a token budget on the key every request carries (each request metered:
    # reserved, counted, settled) and a second one, "versus", whose key has none, alternating:
    # what token budgets cost.
    versus_budget: bool = False
    # The proxy as it serves (plain requests to the completion endpoints on its fast path) and
    # a second one, "versus", with ``[server] fast_path = false`` (every request through
    # the HTTP server and framework of record), alternating: what the fast path saves.
    versus_fast_path: bool = False
    # The proxy with one regex output guard on every request (``[[guards]]``, the answer held
    # per window until it passed) and a second one, "versus", without: what a guard costs.
    versus_guard: bool = False

    def __post_init__(self) -> None:
        if self.streams < 1:
            raise BenchError("--streams must be >= 1")
        if self.tokens < 1:
            raise BenchError("--tokens must be >= 1")
        if self.repeat < 1:
            raise BenchError("--repeat must be >= 1")
        if self.workers < 1:
            raise BenchError("--workers must be >= 1")
        if self.workers > 1 and self.target is not None:
            raise BenchError("--workers applies to the proxy the bench starts, not --target")
        for name in ("ramp", "ttft", "interval", "slow_delay", "grace"):
            value = getattr(self, name)
            if not (0 <= value < math.inf):
                raise BenchError(f"--{name.replace('_', '-')} must be a finite number >= 0")
        if not (0 < self.timeout < math.inf):
            raise BenchError("--timeout must be a finite number > 0")
        for name in ("slow_rcvbuf", "slow_mss", "upstream_sndbuf", "proxy_rcvbuf", "event_pad"):
            if getattr(self, name) < 0:
                raise BenchError(f"--{name.replace('_', '-')} must be >= 0")
        if self.slow_mss and not 88 <= self.slow_mss <= 65535:
            raise BenchError("--slow-mss must be in [88, 65535] (or 0 for the OS default)")
        if self.baseline and self.slow == 0:
            raise BenchError("--baseline compares with the slow readers reading fast: needs --slow")
        if self.upstream_sndbuf and (self.upstream is not None or self.target is not None):
            raise BenchError("--upstream-sndbuf applies to the fake upstream the bench starts")
        if (self.proxy_rcvbuf or self.event_pad) and self.target is not None:
            raise BenchError("--proxy-rcvbuf and --event-pad need the proxy the bench starts")
        if self.drop > 0 and not 1 <= self.drop_at < self.tokens:
            raise BenchError("--drop-at must be in [1, --tokens) when --drop > 0")
        assign_roles(self.streams, self.drop, self.slow, self.seed)  # validates the fractions
        if self.direct and self.target is not None and self.upstream is None:
            raise BenchError("--direct with --target needs --upstream (the proxy's upstream)")
        peer_urls = self._check_peers()
        if self.pin:
            if not hasattr(os, "sched_setaffinity"):
                raise BenchError("--pin needs sched_setaffinity (Linux)")
            if self.target is not None or self.upstream is not None or peer_urls:
                raise BenchError(
                    "--pin places the processes the bench starts: not with --target, "
                    "--upstream or --peer URL"
                )
            cpu_layout(os.sched_getaffinity(0), self.workers)  # enough CPUs, or an error now
        for url in (self.target, self.upstream, *peer_urls):
            if url is not None:
                _address(url)
        self._check_transports()
        self._check_habit()

    def _check_peers(self) -> list[str]:
        """The peers' values checked; returns those that are URLs (peers already running)."""
        names = [value for value in self.peers if "://" not in value]
        urls = [value for value in self.peers if "://" in value]
        if self.peer_pids and len(self.peer_pids) != len(urls):
            raise BenchError(
                "--peer-pid goes with --peer URL (a peer already running): one PID per URL, "
                f"in order ({len(urls)} URL(s), {len(self.peer_pids)} PID(s))"
            )
        modes = [mode for mode, _ in self.peer_modes()]
        if len(set(modes)) != len(modes):
            raise BenchError("--peer names the same system twice")
        if urls and self.upstream is None:
            raise BenchError(
                "--peer URL needs --upstream: the fake upstream that peer relays to, so that "
                "both relays stream the same answers"
            )
        if names and self.target is not None and self.upstream is None:
            raise BenchError(
                f"--peer {names[0]} with --target needs --upstream (the proxy's upstream)"
            )
        return urls

    def peer_modes(self) -> list[tuple[Mode, str]]:
        """Each peer's mode and its value (a name, or a URL): ``auto`` runs as ``fastapi``, a
        URL as ``peer``, ``peer2``..., ``sluice@REF`` as ``sluice-REF``."""
        out: list[tuple[Mode, str]] = []
        urls = 0
        for value in self.peers:
            if "://" in value:
                urls += 1
                out.append(("peer" if urls == 1 else f"peer{urls}", value))
            elif is_sluice_ref(value):
                out.append((sluice_ref_mode(value), value))
            else:
                name = PEER_AUTO_NAME if value == PEER_AUTO else value
                out.append((name, name))
        return out

    def modes(self) -> list[Mode]:
        """Every mode a run of these settings can have, in the order of the table's columns."""
        return ["proxy", "versus", *(mode for mode, _ in self.peer_modes()), "direct", "baseline"]

    def _check_transports(self) -> None:
        if self.transport not in TRANSPORTS:
            raise BenchError(f"--transport must be one of {', '.join(TRANSPORTS)}")
        versus = self.versus_transport
        if versus is not None:
            if versus not in ("lean", "httpx"):
                raise BenchError("--versus-transport must be lean or httpx")
            if self.transport == "auto":
                # auto is lean here (plain http://, proxy = "none"): compare with the other.
                other = "httpx" if versus == "lean" else "lean"
                object.__setattr__(self, "transport", other)
            if self.transport == versus:
                raise BenchError(
                    f"--versus-transport {versus} is --transport already: name the other one"
                )
        seconds = [
            flag
            for flag, on in (
                ("--versus-transport", versus is not None),
                ("--versus-tracing", self.versus_tracing),
                ("--versus-budget", self.versus_budget),
                ("--versus-fast-path", self.versus_fast_path),
                ("--versus-guard", self.versus_guard),
            )
            if on
        ]
        if len(seconds) > 1:
            raise BenchError(f"{' and '.join(seconds)} each make the second proxy: one at a time")
        if self.versus_budget and self.target is not None:
            raise BenchError(
                "--versus-budget configures the proxies the bench starts, not --target"
            )
        if self.versus_guard and self.target is not None:
            raise BenchError("--versus-guard configures the proxies the bench starts, not --target")
        if self.versus_fast_path and self.target is not None:
            raise BenchError(
                "--versus-fast-path configures the proxies the bench starts, not --target"
            )
        if self.versus_tracing and self.target is not None:
            raise BenchError(
                "--versus-tracing configures the proxies the bench starts, not --target"
            )
        if self.target is not None and (self.transport != "auto" or versus is not None):
            raise BenchError(
                "--transport and --versus-transport configure the proxy the bench starts, "
                "not --target"
            )

    def _check_habit(self) -> None:
        habit, seconds = self.upstream_habit, self.upstream_habit_seconds
        if habit not in HABITS:
            raise BenchError(f"--upstream-habit must be one of {', '.join(HABITS)}")
        if habit in TIMED_HABITS:
            if seconds is None:
                object.__setattr__(self, "upstream_habit_seconds", DEFAULT_HABIT_SECONDS)
            elif not (0 <= seconds < math.inf):
                raise BenchError("--upstream-habit-seconds must be a finite number >= 0")
        elif seconds is not None:
            raise BenchError(
                "--upstream-habit-seconds goes with --upstream-habit " + " or ".join(TIMED_HABITS)
            )
        if habit != "none" and (self.upstream is not None or self.target is not None):
            raise BenchError("--upstream-habit applies to the fake upstream the bench starts")

    def habit_text(self) -> str:
        """The fake upstream's habit in words ("" for none)."""
        seconds = (self.upstream_habit_seconds or 0) * 1000
        return {
            "none": "",
            "close-after-response": "closes each connection after its answer",
            "keepalive-timeout": f"closes a connection idle for {seconds:g} ms",
            "late-close": f"closes {seconds:g} ms after each answer, leaving what came unread",
        }[self.upstream_habit]

    def habit_argv(self) -> list[str]:
        """The fake upstream's command-line flags for the habit."""
        if self.upstream_habit == "none":
            return []
        flag = "--" + self.upstream_habit
        if self.upstream_habit in TIMED_HABITS:
            return [flag, str(self.upstream_habit_seconds)]
        return [flag]

    def describe(self) -> str:
        parts = [
            f"{self.streams} streams over a {self.ramp:g} s ramp",
            f"upstream TTFT {self.ttft * 1000:g} ms, {self.tokens} tokens "
            f"every {self.interval * 1000:g} ms",
            f"{self.drop:.0%} leave after token {self.drop_at}",
            f"{self.slow:.0%} read slowly ({self.slow_delay * 1000:g} ms between reads"
            + "".join(
                f", {label} {value} B"
                for label, value in (("SO_RCVBUF", self.slow_rcvbuf), ("MSS", self.slow_mss))
                if value
            )
            + ")",
            f"seed {self.seed}",
        ]
        buffers = [
            f"{label} {value} B"
            for label, value in (
                ("fake's SO_SNDBUF", self.upstream_sndbuf),
                ("proxy's upstream SO_RCVBUF", self.proxy_rcvbuf),
            )
            if value
        ]
        if buffers:
            parts.append(", ".join(buffers))
        if self.event_pad:
            parts.append(f"events padded by {self.event_pad} B")
        if self.versus_transport is not None:
            parts.append(
                f"Sluice's upstream transport {self.transport} vs {self.versus_transport} "
                "(two proxies, alternating)"
            )
        elif self.transport != "auto":
            parts.append(f"Sluice's upstream transport {self.transport}")
        if self.versus_budget:
            parts.append(
                "Sluice with a token budget on the key every request carries (each request "
                "reserved, counted and settled) vs the same key without one (two proxies, "
                "alternating)"
            )
        if self.versus_guard:
            parts.append(
                "Sluice with one regex output guard on every request (its answer held per "
                "window of 32 tokens until the window passed) vs none (two proxies, alternating)"
            )
        if self.versus_fast_path:
            parts.append(
                "Sluice serving plain requests on its fast path vs the same with "
                "`[server] fast_path = false` (two proxies, alternating)"
            )
        if self.versus_tracing:
            parts.append(
                "Sluice traced (OTLP/HTTP to a receiver in the bench, every request sampled) "
                "vs untraced (two proxies, alternating)"
            )
        if self.upstream_habit != "none":
            parts.append(f"the fake upstream {self.habit_text()}")
        if self.workers > 1:
            parts.append(f"proxy with {self.workers} workers")
        if self.pin:
            parts.append("proxy (and peers) pinned to CPUs of their own")
        if self.repeat > 1:
            parts.append(f"{self.repeat} repeats pooled")
        return "; ".join(parts)

    @property
    def model_name(self) -> str:
        """The model requested: ``model``, ``event_pad`` bytes longer. Every event repeats the
        model name, so this is how events get the size of real ones with logprobs."""
        if not self.event_pad:
            return self.model
        return self.model + "-" + "p" * (self.event_pad - 1)

    def key(self) -> str:
        """What identifies a load in the markdown file: the settings that shape it."""
        return (
            f"streams={self.streams} ramp={self.ramp:g} ttft={self.ttft:g} "
            f"interval={self.interval:g} tokens={self.tokens} drop={self.drop:g}@{self.drop_at} "
            f"slow={self.slow:g} seed={self.seed} direct={int(self.direct)} repeat={self.repeat}"
            + self._key_extra()
        )

    def _key_extra(self) -> str:
        # Only what is not at its default, so that the keys of older sections stay valid.
        extra = [f"delay={self.slow_delay:g}"] if self.slow else []
        for name, short in (
            ("slow_rcvbuf", "rcvbuf"),
            ("slow_mss", "mss"),
            ("upstream_sndbuf", "usndbuf"),
            ("proxy_rcvbuf", "prcvbuf"),
            ("event_pad", "pad"),
        ):
            if getattr(self, name):
                extra.append(f"{short}={getattr(self, name)}")
        if self.baseline:
            extra.append("baseline=1")
        if self.workers > 1:
            extra.append(f"workers={self.workers}")
        peers = [mode for mode, _ in self.peer_modes()]
        if peers == [PEER_AUTO_NAME] or peers == ["peer"]:
            extra.append("peer=1")  # the key sections had before there could be several
        elif peers:
            extra.append("peers=" + ",".join(peers))
        if self.pin:
            extra.append("pin=1")
        if self.transport != "auto":
            extra.append(f"transport={self.transport}")
        if self.versus_transport is not None:
            extra.append(f"versus={self.versus_transport}")
        if self.versus_tracing:
            extra.append("tracing=1")
        if self.versus_budget:
            extra.append("budget=1")
        if self.versus_fast_path:
            extra.append("fast_path=1")
        if self.versus_guard:
            extra.append("guard=1")
        if self.upstream_habit in TIMED_HABITS:
            extra.append(f"habit={self.upstream_habit}@{self.upstream_habit_seconds:g}")
        elif self.upstream_habit != "none":
            extra.append(f"habit={self.upstream_habit}")
        return "".join(" " + part for part in extra)

    def slug(self) -> str:
        """A file-name part for this load, the same on every rerun of it: readable, and
        unique per key (``load_name``)."""
        return load_name(self.key())


def _key_parts(key: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in key.split() if "=" in part)


def _percent(fraction: str) -> str:
    """A fraction as the key writes it ("0.3", six digits at most) in percent ("30"): the
    same digits, so two fractions never give one percent."""
    return f"{float(fraction) * 100:g}"


def _drop_words(value: str, default: str) -> str:
    fraction, _, at = value.partition("@")
    word = f"drop{_percent(fraction)}"
    return word + (f"-at{at}" if at != default.partition("@")[2] else "")


def _habit_words(value: str, default: str) -> str:
    habit, _, seconds = value.partition("@")
    return habit + (f"-{seconds}s" if seconds else "")


# How each part of a load's key reads in its file name (from its value and the default's),
# in the order the name gives them: what the load compares first, then the knobs that shape
# it. A part the key gains later and this table lacks still makes the name, as name+value.
_NAME_WORDS: Final[tuple[tuple[str, Callable[[str, str], str]], ...]] = (
    ("workers", lambda v, d: f"{v}-workers"),
    ("pin", lambda v, d: "pinned"),
    ("slow", lambda v, d: f"slow{_percent(v)}"),
    ("transport", lambda v, d: f"{v}-transport"),
    ("versus", lambda v, d: f"vs-{v}"),
    ("tracing", lambda v, d: "traced-vs-untraced"),
    ("budget", lambda v, d: "budgeted-vs-unbudgeted"),
    ("fast_path", lambda v, d: "fast-path-vs-framework"),
    ("guard", lambda v, d: "guarded-vs-unguarded"),
    ("direct", lambda v, d: "vs-direct"),
    ("peer", lambda v, d: "vs-peer"),
    ("peers", lambda v, d: "vs-" + v.replace(",", "-")),
    ("baseline", lambda v, d: "vs-baseline"),
    ("habit", _habit_words),
    ("repeat", lambda v, d: f"{v}-repeats"),
    ("ramp", lambda v, d: f"ramp{v}s"),
    ("ttft", lambda v, d: f"ttft{v}s"),
    ("interval", lambda v, d: f"interval{v}s"),
    ("tokens", lambda v, d: f"{v}-tokens"),
    ("drop", _drop_words),
    ("seed", lambda v, d: f"seed{v}"),
    ("delay", lambda v, d: f"delay{v}s"),
    ("rcvbuf", lambda v, d: f"rcvbuf{v}"),
    ("mss", lambda v, d: f"mss{v}"),
    ("usndbuf", lambda v, d: f"usndbuf{v}"),
    ("prcvbuf", lambda v, d: f"prcvbuf{v}"),
    ("pad", lambda v, d: f"pad{v}"),
)


def load_name(key: str) -> str:
    """A load's file-name part from its key (``BenchSettings.key``, as in the markdown's
    markers): the streams, then every part of the key that differs from the default load's,
    in words, with no digest: ``100-streams-vs-direct``, ``1000-streams-2-workers-vs-peer``,
    ``100-streams-lean-vs-httpx-3-repeats``. Each part reads as its own word and keeps its
    value, so two keys that differ get two names, and a rerun of a load gets its old one."""
    default = BenchSettings()
    # The slow readers' delay is in the key whenever there are slow readers: at its default
    # it says nothing the name needs.
    defaults = _key_parts(default.key()) | {"delay": f"{default.slow_delay:g}"}
    parts = _key_parts(key)
    differ = {name: value for name, value in parts.items() if defaults.get(name) != value}
    words = [f"{parts.pop('streams', '?')}-streams"]
    differ.pop("streams", None)
    if "versus" in differ and "transport" in differ:
        # Two transports side by side read as one word: "lean-vs-httpx".
        differ["versus"] = f"{differ.pop('transport')}-vs-{differ['versus']}"
        words_for = dict(_NAME_WORDS) | {"versus": lambda v, d: v}
    else:
        words_for = dict(_NAME_WORDS)
    for name, word in words_for.items():
        if name in differ:
            words.append(word(differ.pop(name), defaults.get(name, "")))
    words += [f"{name}{value}" for name, value in differ.items()]
    # Whatever a value holds, the name stays a plain file name.
    return "".join(c if c.isalnum() or c in ".+-" else "_" for c in "-".join(words))


def key_words(key: str, other: str | None) -> list[str]:
    """What tells the load of ``key`` from that of ``other`` (another key, or None: the default
    load), in the words of its file name: ``["3 repeats"]``. Any ``name=value`` key works;
    a part this module has no words for reads as its name and value."""
    parts = _key_parts(key)
    base = _key_parts(other) if other is not None else _key_parts(BenchSettings().key())
    words = dict(_NAME_WORDS)
    return [
        words[name](value, base.get(name, "")).replace("-", " ")
        if name in words
        else f"{name} {value}"
        for name, value in parts.items()
        if base.get(name) != value
    ]


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise BenchError(f"{url!r}: the bench speaks plain http://host:port only")
    return parts.hostname, parts.port or 80


@dataclass(frozen=True, slots=True)
class CpuLayout:
    """Where --pin puts each process: CPU numbers as os.sched_setaffinity takes them."""

    proxy: frozenset[int]  # the proxy's workers (and the peer, which runs alternately)
    load: frozenset[int]  # the load generator (this process) and the fake upstream


def cpu_layout(available: Iterable[int], workers: int) -> CpuLayout:
    """The last ``workers`` of ``available`` CPUs for the proxy, the rest for the load."""
    cpus = sorted(available)
    if len(cpus) < workers + 1:
        raise BenchError(
            f"--pin needs {workers + 1} CPUs (one per proxy worker, one or more for the load "
            f"generator and the fake upstream); this process may use {len(cpus)}"
        )
    return CpuLayout(frozenset(cpus[-workers:]), frozenset(cpus[:-workers]))
