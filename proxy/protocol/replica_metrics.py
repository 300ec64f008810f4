"""What an inference server says of its own load, sans-IO: its Prometheus text parsed into the
few numbers routing needs.

- vLLM: ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
  ``vllm:kv_cache_usage_perc`` (before vLLM 0.10: ``vllm:gpu_cache_usage_perc``), a fraction
  in [0, 1] despite its name.
- llama.cpp (``--metrics``): ``llamacpp:requests_deferred`` (waiting),
  ``llamacpp:requests_processing`` (running); it reports no KV usage that means the same.

A server serving several models labels each sample with ``model_name``: the samples of the
model asked for are summed (several label sets, as vLLM's engines, add up); when none carries
that name, every sample is (a server that names its one model otherwise). KV usage, a fraction,
is the highest of those samples, not their sum.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

_WAITING = ("vllm:num_requests_waiting", "llamacpp:requests_deferred")
_RUNNING = ("vllm:num_requests_running", "llamacpp:requests_processing")
_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_WANTED = frozenset(_WAITING + _RUNNING + _KV)


@dataclass(frozen=True, slots=True)
class ReplicaMetrics:
    waiting: float
    running: float
    kv_usage: float = 0.0


class MetricsParseError(ValueError):
    """A scrape that is not Prometheus text, or names none of the known load gauges."""


def parse_replica_metrics(text: str, model: str | None = None) -> ReplicaMetrics:
    """The load in one scrape; raise :class:`MetricsParseError` when it says nothing usable."""
    # name -> (samples for `model`, all samples)
    found: dict[str, tuple[list[float], list[float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name not in _WANTED:
                    continue
                mine, every = found.setdefault(sample.name, ([], []))
                every.append(sample.value)
                if model is not None and sample.labels.get("model_name") == model:
                    mine.append(sample.value)
    except ValueError as error:
        raise MetricsParseError(f"not Prometheus text: {error}") from None
    named = any(mine for mine, _ in found.values())

    def values(names: tuple[str, ...]) -> list[float] | None:
        for name in names:
            if name in found:
                mine, every = found[name]
                return mine if named else every
        return None

    waiting, running, kv = values(_WAITING), values(_RUNNING), values(_KV)
    if waiting is None and running is None:
        raise MetricsParseError(
            "no load gauge (vllm:num_requests_waiting/running, llamacpp:requests_deferred/"
            "processing) in the scrape"
        )
    return ReplicaMetrics(
        waiting=sum(waiting or ()),
        running=sum(running or ()),
        kv_usage=min(1.0, max(kv, default=0.0)) if kv else 0.0,
    )
