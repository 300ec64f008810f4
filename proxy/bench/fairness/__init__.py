"""``sluice bench --fairness``: how Sluice's queue shares a saturated upstream between keys,
FIFO against fair, and what preemption gives an urgent band, in one run.

The bench starts one fake upstream (``proxy.testing.fake_upstream``) with ``--max-running S``:
at most S answers generate at once, as in a serving engine with S slots. In front of it, two
Sluice processes with the same config (``max_connections = S`` for that replica, so that every
request past S waits in Sluice's queue; three keys, A, B and C, each of weight 1) but for
``[scheduling] policy``: ``"fifo"`` and ``"fair"``. Each phase runs through one of them, then
through the other (the order reversed each ``--repeat`` round), every request of a phase
served before the next phase begins, so that the two see the same load on the same fake, one
at a time, minutes apart at most: the machine's speed drifts too much for anything else.

The phases:

* **baseline**: B and C alone, each ``--rate`` short requests per second (C half a period
  after B): their TTFT with nothing in the way;
* **flood**: the same, and A at ``--flood-factor`` times their rate with long answers, more
  than the S slots can serve: a queue builds, and every request is served in the end.
  Per key: TTFT p50/p99, the seconds it was backlogged (a request of it waiting in Sluice's
  queue) and the tokens it was served meanwhile; per pair of keys, the largest difference in
  service (the scheduler's own measure: input tokens x ``w_in`` as a request reaches the
  upstream, output tokens x ``w_out`` as they reach the client) over any interval where both
  were backlogged, against the VTC bound ``2 * max(w_in * L_in, w_out * M)``
  (``proxy.protocol.scheduling.vtc_bound``; ``M``: S slots x the longest answer); throughput;
  the proxy's CPU per relayed event, from ``/proc``;
* **deadline**: A's backlog (3 x S long requests at once), then B's requests each with an SDK
  read timeout (``x-stainless-read-timeout``, as the OpenAI SDK sends its ``timeout``), many
  shorter than their wait; then C's requests that start at once and pass their deadline while
  running (a read timeout shorter than the fake's TTFT, or an ``x-sluice-deadline`` shorter
  than the answer). From the fake's records: no request may reach the upstream after its
  client's deadline; from the clients: those refused get 503 ``deadline_unmeetable``; for
  those cancelled while running, the time from the deadline to the fake seeing its
  connection close.

* **preempt**, through two more Sluice processes, both fair and with the same config but for
  ``[scheduling] preempt_after`` (0, and ``--preempt-after``), the order reversed each round:
  first the interactive key (band 0) alone, its TTFT on an idle upstream; then the batch key
  (band 5) holding every slot with one long stream each while the interactive key's short
  requests arrive. Its TTFT with and without preemption (its wait in Sluice's queue and its
  TTFT upstream apart); each batch stream's text, against the fake's uninterrupted answer; the
  batch's makespan; the pauses, from ``/metrics`` (``sluice_preemptions_total``,
  ``sluice_pause_seconds``), the access lines and the fake's records.

With ``--fair-preempt-after SECONDS`` the fair process of the comparison also has that
``[scheduling] preempt_after`` (every other setting Sluice's default). Its keys are all in band
0, so every pause it makes is within the band: a waiting request of B's or C's pauses one of
A's streams. The flood phase then also reports, per process, B's and C's TTFT p99 against
``preempt_after`` plus twice their TTFT p99 with no flood (the baseline phase, through the same
process), the pauses, and the throughput over FIFO's (at least 0.95).

The checks it prints: under the flood, B's and C's TTFT p99 at most ``1.5 x (A's request
duration / S)`` plus their TTFT p99 with no flood; every pair within the bound; fair's CPU per
event at most 5% over FIFO's; no deadline broken, every cancel seen upstream within 10 ms p99;
with preemption, the interactive TTFT p99 at most ``preempt_after`` plus twice its p99 on an
idle upstream; every batch stream whole; pauses with preemption, none without; with
``--fair-preempt-after``, B's and C's TTFT p99 under the flood through the fair process within
``preempt_after + 2 x`` their p99 with no flood, and its throughput at least 0.95 x FIFO's.

**--long MINUTES** runs none of the phases: the flood's mix for MINUTES through ONE Sluice,
fair with preemption (A's flood in the batch band, B in A's band, C in a more urgent one), its
TTFT per key, its throughput and the proxy's cost minute by minute; the check: each
interactive key's TTFT p99 in the last minute at most 1.5 x its p99 in the first.

The modules: ``settings``, ``stats`` (the figures, pure), ``load`` (the phases' requests and
the client), ``run`` (the processes and the phases), ``report``, ``cli``; for the long run,
``minutes`` (its figures per minute, pure), ``long_run`` and ``long_report``.
"""

from proxy.bench.fairness.cli import main, wants_fairness
from proxy.bench.fairness.settings import FairnessSettings

__all__ = ["FairnessSettings", "main", "wants_fairness"]
