"""``python -m proxy.bench.sweep``: cancellation tried at every checkpoint of a request's life.

Each scenario (``proxy.bench.sweep.scenarios``) is one request through a real Sluice in this
process, on real sockets on 127.0.0.1, in front of the fake upstream (in this process too). A
trio instrument (``checkpoints.CheckpointCounter``) counts the task steps of the tasks working
for the request: every task spawned under Sluice's serving task once the client starts to
connect. Each step ends at an await, where a cancellation can land. The scenario runs once to
count them (N), then N times more, the client leaving right after step k (k = 1 .. N): its
socket closed (``--leave close``), or shut down for writing while it reads on (``--leave
fin``: the proxy hears the same FIN, and the client then holds everything that was sent, so
the accounting can be checked exactly). On both server paths: the fast path, and the HTTP
server and framework of record (``[server] fast_path = false``). And a third ending, where the
client stays (``--leave deadline``): the request carries ``X-Sluice-Deadline``, and at step k
trio's clock (a ``MockClock`` running at the real rate) jumps past it, every other timer set
longer than the jump: the request's own deadline, and only it, passes at that step. The client
must then be told (the whole answer, or the deadline's error as its status or in-band).

Every scenario that reaches an upstream runs on both of its transports: Sluice's own HTTP/1.1
client, and httpx (the scenario's name ending ``@httpx``).

After every run (``run.one_run``), with the state given two seconds to come back:

* no task (outside the fake's), busy thread, descriptor or socket left over the idle baseline,
  and the fake holding open exactly the connections the pools keep;
* the upstream let go (its connection closed or idle in the pool, the local sequence out of
  the batch) within ``run.RELEASE_STEPS`` task steps of the departure, and no request at the
  fake still pending;
* no replica slot, queue place, key stream or relay held;
* one access line, whose outcome names the phase (``completed`` or ``cancelled(<phase>)``),
  and says what the client saw; tokens sent + tokens for nobody = tokens made (its output
  count; with ``close``, the received + for nobody are at most that); a budgeted key charged
  what the line says; the fair scheduler's counters (a stream's, alone on its replica) grown
  by what the request used: its input estimate at each dispatch and every output token made,
  weighted; a Redis-limited key's stream leases and reservations in redis-server gone, and the
  connections Sluice holds there back to their idle count;
* the process still serves: every run is a fresh request through the same Sluice, whose
  replica allows one connection at a time, and after the last a request is read to its end.

The report (``--markdown``; ``make sweep`` writes docs/cancellation-sweep.md) gives per
scenario the checkpoints counted, the runs, the distinct cut points in code (the file:line
where the request's task was parked, deduplicated), the failures, and a heat strip of where
in the request's life the checkpoints sit.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import trio
import trio.testing

from proxy.bench.report import write_text
from proxy.bench.sweep.client import LEAVES
from proxy.bench.sweep.report import markdown
from proxy.bench.sweep.run import Sweep, sample, sweep_scenario
from proxy.bench.sweep.scenarios import SCENARIOS, Scenario

__all__ = ["SCENARIOS", "Scenario", "Sweep", "main", "sample", "sweep_all", "sweep_scenario"]

SERVERS = {"fast-path": True, "framework": False}
# How a run ends early: the client leaves (LEAVES), or its deadline passes.
ENDINGS = (*LEAVES, "deadline")
HEADING = "Cancellation at every checkpoint"
PREAMBLE = (
    "Written by `make sweep` (`python -m proxy.bench.sweep`; its module's docstring says "
    "what each run checks). Each scenario is one request through a Sluice in the sweep's "
    "process, in front of the fake upstream, on both server paths (*fast path*; "
    "*framework*: `[server] fast_path = false`) and both ways of leaving (*close*: the "
    "socket closed; *fin*: shut down for writing while the client reads on, so that what "
    "was sent is exactly what it read), and, for some, a third ending (*deadline*: the "
    "client stays, and the request's `X-Sluice-Deadline` passes at the step, trio's clock "
    "jumping past it). A scenario named `...@httpx` is the same over the httpx upstream "
    "transport. Counted once, then cut after each of its checkpoints (task steps of the "
    "tasks working for it), the client leaving there. *checkpoints*: steps the counting run "
    "took; *runs*: the count, one per cut, and a last whole request; *distinct cut points*: "
    "where in code the request's task was parked when its client left, deduplicated; "
    "*released within*: the most scheduler rounds (and task steps of Sluice) between a "
    "departure and its upstream let go, seen by the fake (the bound: 5 rounds, 8 over "
    "httpx; a local model's sequence: out of the batch within 2 engine steps, the one in "
    "flight at the cut and one more). The machine: 2 shared cores (AMD EPYC)."
)


async def sweep_all(
    names: Sequence[str], servers: Sequence[str], leaves: Sequence[str], every: int
) -> list[Sweep]:
    sweeps = []
    for name in names:
        scenario = SCENARIOS[name]
        for server in servers:
            if SERVERS[server] not in scenario.servers:
                continue
            for leave in leaves:
                if leave not in scenario.endings:
                    continue
                sweep = await sweep_scenario(
                    scenario, fast_path=SERVERS[server], leave=leave, every=every
                )
                sweeps.append(sweep)
                print(
                    f"{sweep.scenario:28} {sweep.server:9} {sweep.leave:5} "
                    f"checkpoints {sweep.counted:4} runs {len(sweep.runs):4} "
                    f"distinct {len(sweep.distinct):3} failures {len(sweep.failures)} "
                    f"{sweep.seconds:6.1f}s {sweep.skipped}",
                    flush=True,
                )
    return sweeps


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m proxy.bench.sweep",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--scenario", action="append", choices=sorted(SCENARIOS), help="(default: all)"
    )
    parser.add_argument("--server", action="append", choices=sorted(SERVERS))
    parser.add_argument("--leave", action="append", choices=ENDINGS)
    parser.add_argument(
        "--every",
        type=int,
        default=1,
        help="cut at every N-th checkpoint (and the first and last three) instead of each",
    )
    parser.add_argument("--markdown", help="write the report here")
    args = parser.parse_args(argv)
    names = args.scenario or list(SCENARIOS)
    # The deadline ending jumps the clock: one that runs at the real rate, and can.
    sweeps = trio.run(
        sweep_all,
        names,
        args.server or list(SERVERS),
        args.leave or list(ENDINGS),
        args.every,
        clock=trio.testing.MockClock(rate=1.0),
    )
    text = markdown(sweeps, heading=HEADING, preamble=PREAMBLE)
    if args.markdown:
        write_text(Path(args.markdown), text + "\n")
    else:
        print(text)
    if any(sweep.failures for sweep in sweeps):
        sys.exit(1)
