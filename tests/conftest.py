"""Fixtures live in ``tests/support.py`` and ``tests/model_fixtures.py`` (importable by test
modules); this makes them visible to every test, and keeps each test's logging its own. The
session also fails when the tests leave a process running (see ``tests/processes.py``).

It also marks the tests that ``make test`` must not run in parallel (``timing``, below), and
keeps the tests that share a module's fixture on one pytest-xdist worker."""

import logging
import sys
import types
from collections.abc import Iterator
from multiprocessing import resource_tracker
from pathlib import Path

import pytest
from hypothesis import settings

from proxy.ops.logs import ACCESS_LOGGER
from tests import processes, xdist_groups
from tests.model_fixtures import (
    freeze_the_heap,
    long_context_loaded_model,
    smol_tokenizer,
    tiny_loaded_model,
)
from tests.support import (
    client,
    close_raw_clients,
    each_server_path,
    fake,
    proxy,
    quiet_collector,
)

# Hypothesis's per-example deadline (200 ms) is a real-time bound: in the parallel pass, a
# loaded machine fails an example as `DeadlineExceeded` or `Flaky`. No property here is about
# speed, so no example has a deadline.
settings.register_profile("sluice", deadline=None)
settings.load_profile("sluice")

_SUBREAPER = pytest.StashKey[bool]()
_ROOT = Path(__file__).resolve().parent.parent

# Tests that assert a real-time bound: a cancellation seen within 50 ms, a stream cut within a
# model step, a drain or a stall limit kept to within a second, a bench run's TTFT or cancel
# figures. Marked ``timing``: `make test` runs them alone, after the rest has run in parallel
# (``-n 2``), so that no other test's load can push them past their bound. (Bounds in virtual
# time, under ``autojump_clock``, need no mark; nor do lower bounds, or a ``fail_after`` that
# only keeps a hung test from hanging the run.) A file here is marked whole; otherwise the
# tests named (their function names, every parameter of each). A new test with such a bound
# belongs here, or carries ``@pytest.mark.timing`` itself.
TIMING_FILES = frozenset(
    {
        # Tiny bench runs against real subprocesses: a stream must still run at its drop point.
        "tests/bench/test_bench.py",
        "tests/bench/test_matrix.py",  # reduced cancellation scorecards: p99 and steps after
        "tests/bench/test_sluice_ref.py",
        "tests/contracts/test_drain.py",  # each grace and exit timed
        "tests/contracts/test_lifetime.py",
        "tests/contracts/test_lifetime_matrix.py",
        "tests/contracts/test_preemption.py",  # TTFTs against preempt_after
        "tests/contracts/test_scheduling.py",  # deadlines kept to within 0.5 s
        "tests/server/test_hangup.py",
    }
)
TIMING_TESTS: dict[str, frozenset[str]] = {
    path: frozenset(names)
    for path, names in {
        "tests/api/test_chat_page.py": {"test_stream_stop_and_a_second_turn"},
        "tests/api/test_endpoints.py": {
            "test_a_client_that_leaves_closes_the_upstream",
            "test_a_client_that_leaves_stops_the_local_model_within_a_step",
            "test_leaving_an_sdk_stream_early_closes_the_upstream",
        },
        "tests/api/test_identity.py": {
            "test_with_the_issuer_down_cached_keys_admit_and_unknown_kids_are_refused_at_once",
            "test_forward_auth_admits_refuses_caches_and_bounds_its_calls",
            "test_through_the_proxy_a_hung_issuer_costs_an_unknown_kid_half_a_second_at_most",
        },
        "tests/api/test_limits_redis.py": {
            "test_two_workers_share_concurrency_and_a_killed_workers_slot_expires",
            "test_redis_failing_mid_run_gets_on_error_in_bounded_time",
        },
        "tests/api/test_openai_sdk.py": {"test_leaving_a_stream_early_cancels_upstream"},
        "tests/api/test_pipeline.py": {
            "test_a_non_streamed_answer_to_a_client_that_never_reads_is_cut",
            "test_sigterm_exits_in_time_whatever_a_stalled_client_does",
        },
        "tests/api/test_scheduling_redis.py": {
            "test_redis_gone_fails_the_sync_not_the_scheduling_and_it_catches_up_after",
        },
        "tests/api/test_websocket.py": {
            "test_cancel_mid_stream_then_a_second_request",
            "test_closing_the_socket_cancels",
        },
        "tests/backends/test_local_http.py": {
            "test_a_client_leaving_takes_only_its_sequence_out_of_the_batch",
        },
        "tests/backends/test_local_scheduling.py": {
            "test_a_queued_request_that_cannot_start_in_time_is_refused",
            "test_a_running_request_past_its_deadline_stops_within_a_step",
        },
        "tests/backends/upstream/test_health.py": {"test_hedged_first_token_closes_the_loser"},
        "tests/backends/upstream/test_http2.py": {
            "test_a_client_that_leaves_resets_its_stream_and_only_its_stream",
        },
        "tests/backends/upstream/test_pool.py": {
            "test_a_cancelled_request_closes_its_connection",
            "test_abort_shuts_the_connection_down_under_a_parked_reader",
        },
        "tests/backends/upstream/test_transports.py": {
            "test_a_client_that_leaves_closes_the_tunnel_at_once",
            "test_a_client_that_leaves_during_the_upstream_tls_handshake_closes_its_socket",
        },
        "tests/bench/test_fairness.py": {
            "test_a_tiny_fairness_run_against_real_subprocesses",
            "test_a_tiny_long_run_against_real_subprocesses",
        },
        "tests/contracts/test_admission.py": {
            "test_the_upstream_queue_is_bounded_in_size_and_time",
        },
        "tests/contracts/test_backpressure.py": {
            "test_slow_reader_applies_backpressure_then_is_cut_off",
        },
        "tests/inference/test_long_prompts.py": {
            "test_a_client_that_leaves_mid_prefill_is_let_go_within_a_chunk",
            "test_a_short_request_gets_its_first_token_while_a_long_prompt_is_prefilled",
        },
        "tests/integration/test_server_tree.py": {
            "test_stop_ends_the_server_its_engine_and_a_daemon_that_left",
        },
        "tests/ops/test_metrics.py": {"test_local_queue_and_step_metrics"},
        "tests/ops/test_tracing.py": {"test_a_collector_in_trouble_never_delays_a_request"},
        "tests/relay/test_relay_http.py": {
            "test_concurrent_streams_interleave",
            "test_an_idle_keep_alive_connection_is_closed_after_keep_alive_timeout",
        },
        "tests/server/test_fast_path.py": {
            "test_graceful_shutdown_closes_idle_connections_and_finishes_streams",
            "test_a_stalled_reader_is_reset_after_stall_timeout",
        },
        "tests/server/test_seam_faults.py": {
            "test_a_client_that_pipelines_a_byte_and_leaves_is_noticed_at_once",
        },
        "tests/server/test_supervision.py": {
            "test_a_killed_supervisors_workers_are_gone_within_3_s",
            "test_without_the_parent_death_signal_the_pipe_drains_then_ends_a_worker",
        },
        "tests/testing/test_fake_upstream.py": {
            "test_disconnect_noticed_in_every_phase",
            "test_client_reset_mid_stream",
            "test_tls_disconnect_noticed_mid_stream",
            "test_disconnect_from_typed_streams_recorded",
            "test_keepalive_timeout_closes_idle_connections",
            "test_late_close_leaves_a_request_unanswered",
        },
    }.items()
}


_TIMING_MODULES = frozenset(path.removesuffix(".py").replace("/", ".") for path in TIMING_FILES)


def _is_timing(item: pytest.Item, path: str, name: str) -> bool:
    """Listed, or in a file that runs the drivers and checks of a listed one (the lifetime
    matrix's, say: its bounds come with them)."""
    if path in TIMING_FILES or name in TIMING_TESTS.get(path, frozenset()):
        return True
    module = getattr(item, "module", None)
    return module is not None and any(
        _home(value) in _TIMING_MODULES for value in vars(module).values()
    )


def _home(value: object) -> str | None:
    """The module a name imported into a test module comes from (or is)."""
    if isinstance(value, types.ModuleType):
        return value.__name__
    return getattr(value, "__module__", None)


def _shares_a_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(
        definition.scope in ("module", "class")
        for definitions in info.name2fixturedefs.values()
        for definition in definitions
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the ``timing`` tests (before ``-m`` selects), and puts every test that uses a
    module- or class-scoped fixture in its file's ``xdist_group``: ``--dist loadgroup`` then
    runs that file's sharers on one worker, so that an expensive fixture (a wheel built, a
    model loaded) is made once, not once per worker. A name in ``TIMING_TESTS`` that its
    file no longer defines fails the run, so that a renamed test is not silently run in
    parallel."""
    seen: dict[str, set[str]] = {}
    grouping = config.pluginmanager.hasplugin("xdist")
    for item in items:
        path = item.path.resolve().relative_to(_ROOT).as_posix()
        name = getattr(item, "originalname", item.name)
        seen.setdefault(path, set()).add(name)
        if _is_timing(item, path, name):
            item.add_marker(pytest.mark.timing)
        if grouping and _shares_a_fixture(item):
            item.add_marker(pytest.mark.xdist_group(path))
    if any("::" in arg for arg in config.args):
        return  # single tests asked for: the others' names are not collected
    stale = [
        f"{path}::{name}"
        for path, names in TIMING_TESTS.items()
        if path in seen
        for name in sorted(names - seen[path])
    ]
    if stale:
        raise pytest.UsageError(
            "tests/conftest.py's TIMING_TESTS names tests that do not exist: " + ", ".join(stale)
        )


__all__ = [
    "client",
    "close_raw_clients",
    "each_server_path",
    "fake",
    "long_context_loaded_model",
    "proxy",
    "quiet_collector",
    "smol_tokenizer",
    "tiny_loaded_model",
]


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """A test that runs the CLI in-process (``main(["serve", ...])``) configures logging as a
    server does: the access logger gets its own handler and stops propagating, and pytest's
    capture then attaches to it too. Put every logger it touches back, so that no later test
    sees another's handlers (the test order follows the folders, not the contracts). The root
    logger is pytest's own (its capture handlers come and go with each phase of a test)."""
    touched = [logging.getLogger(ACCESS_LOGGER), logging.getLogger("httpx")]
    saved = [(log, list(log.handlers), log.level, log.propagate) for log in touched]
    yield
    for log, handlers, level, propagate in saved:
        log.handlers[:] = handlers
        log.setLevel(level)
        log.propagate = propagate


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(xdist_groups, "sluice-xdist-groups")


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    # The test modules and what they import are the session's long-lived heap.
    freeze_the_heap()


def pytest_sessionstart(session: pytest.Session) -> None:
    # An orphan's parent would be PID 1, out of the session's sight; as a subreaper, the
    # session becomes its parent instead.
    session.config.stash[_SUBREAPER] = processes.become_subreaper()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Every fixture has been torn down: nothing the tests started may still run. Whatever
    does is named, killed, and fails the run. (The real-upstream runner's server is not the
    tests': its plugin ends it in a ``tryfirst`` sessionfinish, before this one.)"""
    if not session.config.stash.get(_SUBREAPER, False):
        return
    # The session's own resource tracker (multiprocessing starts one for this process when
    # something here uses its semaphores or shared memory) ends when the session does.
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    left = processes.kill_left_behind(keep=frozenset({tracker} if tracker else ()))
    if not left:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = ["processes left running by the tests (killed now):", *left]
    if reporter is not None:
        reporter.ensure_newline()
        reporter.section("processes left behind", sep="=", red=True, bold=True)
        for line in lines:
            reporter.write_line(line)
    else:
        print("\n".join(lines), file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
