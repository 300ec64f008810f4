"""The KV-routing bench (``python -m proxy.bench.kv_routing``), small: its workloads, its oracle,
its loop and report against in-process fakes (token-block caches publishing KV events) and one
in-process Sluice per balance instead of the subprocesses it starts."""

from __future__ import annotations

import argparse

import pytest
import trio

from proxy.bench import kv_routing
from proxy.bench import settings as bench_settings
from proxy.bench.report import upsert_section
from proxy.testing.fake_upstream import prompt_tokens
from tests.support import start_fake, start_proxy

SMALL = kv_routing.KvRoutingSettings(
    replicas=2, groups=2, questions=3, system_tokens=64, question_tokens=16, rate=200.0,
    users=2, rounds=2, mt_system_tokens=48, mt_question_tokens=8, think=0.0, tokens=2,
    interval=0.001, ttft_base=0.0, prefill_us=100.0, metrics_interval=0.05,
)  # fmt: skip


def test_the_workloads_and_the_oracle() -> None:
    prompts = kv_routing.shared_prefix_prompts(SMALL, "t")
    assert len(prompts) == SMALL.groups * SMALL.questions
    lengths = {len(prompt_tokens({"messages": p}) or []) for p in prompts}
    assert lengths == {SMALL.system_tokens + SMALL.question_tokens}
    # Each round of a conversation starts with the one before, the answer between.
    first, second = (kv_routing.multi_turn_prompt(SMALL, "t", 0, r) for r in range(2))
    assert second[: len(first)] == first and second[len(first)]["role"] == "assistant"
    # 2 groups x 3 questions: 5 blocks each, 4 of them the group's; a large cache hits every
    # group's 4 blocks after its first question.
    assert kv_routing.oracle_hit_rate(prompts, 1000) == pytest.approx(4 * 4 / (6 * 5))
    # One block: only a group's first block, kept while the same group comes again.
    assert kv_routing.oracle_hit_rate(prompts, 1) < 0.1
    # 70% of the shared-prefix workload's 2 x 4 + 6 distinct blocks, over 2 replicas.
    assert SMALL.replica_blocks() == 5


async def test_each_balance_runs_both_workloads_and_reports() -> None:
    settings = SMALL
    runs = []
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            fakes = [
                await start_fake(
                    nursery,
                    ttft=0.001,
                    interval=settings.interval,
                    tokens=settings.tokens,
                    prefix_cache_size=settings.replica_blocks(),
                    prefix_block_tokens=kv_routing.BLOCK_TOKENS,
                    prefill_token_seconds=settings.prefill_us / 1e6,
                    ttft_hit=settings.ttft_base,
                    kv_events_port=0,
                )
                for _ in range(settings.replicas)
            ]
            urls = [fake.url for fake in fakes]
            events = [fake.upstream.kv_events_endpoint for fake in fakes]
            replicas = [bench_settings._address(url) for url in urls]
            for workload in kv_routing.WORKLOADS:
                for balance in kv_routing.BALANCES:
                    table = kv_routing.model_table(balance, urls, events, settings)
                    proxy = await start_proxy(nursery, {kv_routing.MODEL: table})
                    tag = f"{workload}-{balance}"
                    runs.append(
                        await kv_routing.run_workload(
                            settings, workload, balance, proxy.host_port, replicas, tag
                        )
                    )
            nursery.cancel_scope.cancel()
    report = kv_routing.KvRoutingReport(settings, runs, command="python -m proxy.bench.kv_routing")
    results = report.to_json()["results"]
    assert len(results) == len(kv_routing.WORKLOADS) * len(kv_routing.BALANCES)
    for result in results:
        expected = 6 if result["workload"] == "shared_prefix" else 4
        assert (result["requests"], result["errors"]) == (expected, 0)
        assert result["ttft_p90_ms"] is not None and 0 <= result["hit_rate"] <= 1
        assert sum(result["prefill_share"]) == pytest.approx(1)
    markdown = kv_routing.kv_routing_markdown(report)
    assert markdown.startswith("## KV-cache routing")
    assert markdown.count("| `cache_aware_approx` |") == 2
    doc = upsert_section("", settings.key(), markdown)
    assert upsert_section(doc, settings.key(), markdown) == doc


def test_the_command_line_and_the_configs() -> None:
    parser = argparse.ArgumentParser()
    kv_routing.add_arguments(parser)
    args = parser.parse_args(["--groups", "3", "--balance", "cache_aware", "--rate", "9"])
    settings = kv_routing.settings_from_args(args)
    assert (settings.groups, settings.rate, settings.balances) == (3, 9.0, ("cache_aware",))
    assert settings.workloads == kv_routing.WORKLOADS
    approx = kv_routing.model_table("cache_aware_approx", ["http://a"], ["tcp://a:1"], SMALL)
    assert approx["balance"] == "cache_aware" and "kv_events_endpoints" not in approx
    precise = kv_routing.model_table("cache_aware", ["http://a"], ["tcp://a:1"], SMALL)
    assert precise["kv_events_endpoints"] == ["tcp://a:1"]
    config = kv_routing.proxy_config(8000, precise)
    assert 'kv_events_endpoints = ["tcp://a:1"]' in config
    with pytest.raises(bench_settings.BenchError):
        kv_routing.KvRoutingSettings(balances=("round_robin",))
