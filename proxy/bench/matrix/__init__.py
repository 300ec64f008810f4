"""``sluice bench --matrix``: the cancellation scorecard, for Sluice or any OpenAI-compatible
proxy on loopback.

The proxy under test sits in front of the fake upstream (``proxy.testing.fake_upstream``), which
runs in this process and records when it saw each client go. Each cell is one way for a client
to leave, tried ``--repeat`` times, one trial at a time (so the fake's records match trials by
order, whatever a proxy does to a request body). The axes:

* phase: ``queued`` (for an admission slot: the Sluice this bench starts has one upstream
  connection, held by a long stream; against another system not applicable), ``connecting``
  (the fake holds the accepted connection without reading: ``FakeSettings.accept_delay``; the
  fake is told to close after every answer, so a proxy's request always takes a fresh
  connection), ``head`` (the fake never sends its response head), ``first_token`` (a long
  TTFT), ``mid_stream``, ``after_last`` (the whole answer read, then the client leaves);
* transport: ``sse``, ``json`` (non-streamed; its head and first token are one moment, so
  ``first_token`` and ``mid_stream`` are not applicable), ``ws`` (Sluice's ``/v1/ws``, chat only;
  its request comes after the handshake, so ``head`` is not applicable);
* endpoint: ``chat``, ``completions``, ``responses``, ``messages``;
* leave: ``fin`` (``shutdown(SHUT_WR)``), ``rst`` (``SO_LINGER`` 0, then close), ``abort`` (an
  SDK's early exit: the response closed before its end through httpcore, the connection layer
  of httpx and so of the OpenAI SDK; over WebSocket, a close frame).

The fake is steered through its server-wide settings between trials (never through the body,
which a proxy may rewrite). Per cell: cancelled (the fake saw the client's connection go) out
of N; cancel latency p50/p99/max, from the moment the client's socket closed (or was shut down)
to the fake's record of the proxy's close (both ``time.monotonic()``); tokens generated for
nobody (what the in-process fake sent after the client left); whether the proxy served the next
request. For ``queued``, cancelled means the request never reached the upstream once the slot
freed (no latency: the upstream cannot see it). For ``after_last``, nothing is left to cancel:
cancelled counts answers the fake completed. Of the system it starts, the bench also reads the
process's open file descriptors after every trial and cell, and of Sluice
``sluice_active_streams`` and the outcomes its access lines give. Sluice exports its spans (by
the standard OTEL variables only) to an OTLP receiver in this process; each trial's request
names a trace of its own (a ``traceparent``, over the WebSocket its handshake's), and once the
cells are done each trial's trace is judged (``proxy.testing.trace_check``) against its own
access line's outcome: per cell, trace k of N trials whose trace says what happened.

The systems: without options, ``sluice serve`` (a subprocess, so that its fds are its own) in
front of the fake; ``--local MODEL``, Sluice serving a local model, whose chat cells are the
engine letting the sequence go, counted in forward passes after Sluice saw the client go
(``sluice_local_steps_after_cancel``); ``--peer NAME``, another gateway
(``proxy.bench.peers``: the project's FastAPI peer, LiteLLM, Envoy, nginx, vllm-router,
sglang-router, Portkey), installed under ``.peers/NAME`` when missing and started here in
front of the fake (``--peer URL`` is ``--target URL``); and
``--target URL``, a proxy already running, which must send model ``--model`` to the fake on
``--fake-port`` (the bench prints the line to configure and starts the fake there).
"""

# The entry (this docstring is --help's), over modules by role: cells (the axes, the settings,
# what a trial and a cell measured), client (the clients that leave), systems (the system under
# test, started or found), trials (one trial of a cell), view (what the bench reads inside the
# system), traces (each trial's trace judged), run (every cell, and the report), report (the
# text and the markdown tables) and cli (the command line).

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from proxy.bench.children import run_stoppable
from proxy.bench.cli import command_line
from proxy.bench.matrix.cells import (
    ENDPOINTS,
    LEAVES,
    LOCAL_MODEL_NAME,
    PATHS,
    PHASES,
    TRANSPORTS,
    Cell,
    MatrixSettings,
    Trial,
    applicability,
)
from proxy.bench.matrix.cli import DESCRIPTION, add_arguments, settings_from_args
from proxy.bench.matrix.client import Client, local_body, request_body
from proxy.bench.matrix.report import markdown_report
from proxy.bench.matrix.run import run_matrix
from proxy.bench.matrix.trials import NOT_SERVED, run_local_trial, run_trial
from proxy.bench.matrix.view import local_counters
from proxy.bench.report import write_text
from proxy.bench.settings import BenchError

__all__ = [
    "ENDPOINTS",
    "LEAVES",
    "LOCAL_MODEL_NAME",
    "NOT_SERVED",
    "PATHS",
    "PHASES",
    "TRANSPORTS",
    "Cell",
    "Client",
    "MatrixSettings",
    "Trial",
    "add_arguments",
    "applicability",
    "local_body",
    "local_counters",
    "main",
    "markdown_report",
    "request_body",
    "run_local_trial",
    "run_matrix",
    "run_trial",
    "settings_from_args",
    "wants_matrix",
]


def wants_matrix(argv: Sequence[str]) -> bool:
    """Whether a ``python -m proxy.bench`` command line asks for this bench."""
    return "--matrix" in argv


def main(argv: Sequence[str] | None = None, prog: str = "python -m proxy.bench") -> None:
    parser = argparse.ArgumentParser(
        prog=f"{prog} --matrix",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    command = command_line(argv, prog)
    try:
        settings = settings_from_args(args, command)
        report = run_stoppable(run_matrix, settings)
    except BenchError as exc:
        sys.exit(f"{prog} --matrix: {exc}")
    except KeyboardInterrupt:
        sys.exit(130)
    text = markdown_report(report)
    print(text)
    if args.json:
        write_text(args.json, json.dumps(report, indent=2) + "\n")
    if args.markdown:
        write_text(args.markdown, text + "\n")
