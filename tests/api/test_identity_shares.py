"""Identities mapped per subject share a key's limits, budget and fair share the way two keys
do: the scheduler's order under a saturated upstream, and the limits and budgets counted in a
real Redis shared by two instances. Real sockets on 127.0.0.1, a real issuer
(tests/api/issuer.py) signing the tokens, the fake upstream; the Redis test starts its own
``redis-server`` and skips, saying so, without one (tests/api/test_limits_redis.py)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from proxy.config import ACCOUNT_SEPARATOR, key_of_account
from tests.api.issuer import Issuer, start_issuer
from tests.api.test_identity import bearer, error_of, jwt_table
from tests.api.test_limits_redis import REDIS_SERVER, RedisServer, limits
from tests.api.test_token_budget_redis import charged
from tests.contracts.test_scheduling import (
    ENDLESS,
    MODEL,
    arrival_order,
    queued,
    said,
    streams_on,
)
from tests.ops.test_metrics import scrape, value
from tests.support import DEADLINE, Proxy, RawClient, chat_body, poll_until, start_fake, start_proxy

CHAT = "/v1/chat/completions"


def account(key: str, subject: str) -> str:
    return f"{key}{ACCOUNT_SEPARATOR}{subject}"


async def subjects_proxy(
    nursery: trio.Nursery, issuer: Issuer, upstream: str, *, per_subject: bool, **sections: Any
) -> Proxy:
    """One key, "batch", that every token of the issuer maps onto (``per_subject`` or not), on
    a model with one slot on its replica."""
    return await start_proxy(
        nursery,
        {MODEL: {"upstreams": [upstream], "max_connections": 1}},
        keys=[{"name": "batch", **sections.pop("key", {})}],
        auth={
            "jwt": [jwt_table(issuer.issuer, default_key="batch", per_subject=per_subject, map=[])]
        },
        **sections,
    )


@pytest.mark.parametrize(
    ("per_subject", "order"),
    [
        # Two tenants: bob has been served less than ann (whose stream held the slot all
        # along), so his one request goes before her backlog.
        (True, ["bob", "ann 1", "ann 2", "ann 3"]),
        # One tenant: the key's own requests in arrival order, bob behind all of ann's.
        (False, ["ann 1", "ann 2", "ann 3", "bob"]),
    ],
)
async def test_a_flooding_subject_does_not_make_another_of_its_key_wait_behind_it(
    nursery: trio.Nursery, client: httpx.AsyncClient, per_subject: bool, order: list[str]
) -> None:
    """The upstream saturated (one slot, held by ann's endless stream, ann's backlog of three
    queued): bob, mapped onto the same key, is served next when the key counts per subject,
    his wait bounded by the one request in progress, and behind ann's whole backlog when it
    does not. Metrics name the key alone either way."""
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0.01, tokens=3, max_running=1)
        issuer = await start_issuer(nursery, "RSA")
        proxy = await subjects_proxy(nursery, issuer, fake.url, per_subject=per_subject)
        tokens = {sub: issuer.token(sub=sub) for sub in ("ann", "bob")}
        holder = await RawClient.post(
            proxy,
            CHAT,
            chat_body(MODEL, messages=said("holder"), fake=ENDLESS),
            headers=bearer(tokens["ann"]),
        )
        await holder.read_until(b"data: ")
        answered: dict[str, float] = {}

        async def ask(sub: str, text: str) -> None:
            response = await client.post(
                proxy.url + CHAT,
                json=chat_body(MODEL, stream=False, messages=said(text)),
                headers=bearer(tokens[sub]),
            )
            assert response.status_code == 200, response.text
            answered[text] = trio.current_time()

        for number in (1, 2, 3):
            nursery.start_soon(ask, "ann", f"ann {number}")
            await queued(proxy, number)
        nursery.start_soon(ask, "bob", "bob")
        await queued(proxy, 4)
        await streams_on(proxy.state.scheduling)
        released = trio.current_time()
        await holder.close()
        await poll_until(lambda: len(answered) == 4)
        await proxy.state.tracker.wait_idle()
    assert arrival_order(fake) == ["holder", *order]
    waits = {text: at - released for text, at in answered.items()}
    if per_subject:
        # Bob's answer came first, within one short request's time of the slot freeing.
        assert waits["bob"] == min(waits.values())
        assert waits["bob"] < 0.5
    else:
        assert waits["bob"] == max(waits.values())
    tenants = sorted(t for t in proxy.state.scheduling.upstream.queue.counters if t)
    expected = [account("batch", "ann"), account("batch", "bob")] if per_subject else ["batch"]
    assert tenants == expected
    samples = await scrape(client, proxy)
    assert {key_of_account(t) for t in tenants} == {"batch"}
    assert value(samples, "sluice_requests_total", model=MODEL, key="batch", status="200") == 5


@pytest.mark.skipif(
    REDIS_SERVER is None,
    reason="redis-server is not installed (`make redis` installs Debian's package when root)",
)
async def test_per_subject_limits_and_budgets_are_kept_apart_in_redis_across_instances(
    nursery: trio.Nursery, client: httpx.AsyncClient, redis_server: RedisServer
) -> None:
    """Two instances on one Redis, one key mapped per subject (2 requests a minute, a token
    budget): each subject has its own window and budget under its own Redis keys (the key and
    the subject: ``KeyConfig.account``), counted across both instances; the key's name alone
    is in the metrics."""
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=3)
        issuer = await start_issuer(nursery, "RSA")
        settings: dict[str, Any] = {
            "key": {"requests_per_minute": 2, "tokens_per_day": 100_000},
            "limits": limits(redis_server),
        }
        first, second = [
            await subjects_proxy(nursery, issuer, fake.url, per_subject=True, **dict(settings))
            for _ in range(2)
        ]
        tokens = {sub: issuer.token(sub=sub) for sub in ("ann", "bob")}

        async def status(proxy: Proxy, sub: str) -> httpx.Response:
            return await client.post(
                proxy.url + CHAT,
                json=chat_body(MODEL, stream=False),
                headers=bearer(tokens[sub]),
            )

        # Ann's two requests, one on each instance; her third, on either, is refused.
        assert (await status(first, "ann")).status_code == 200
        assert (await status(second, "ann")).status_code == 200
        for proxy in (first, second):
            response = await status(proxy, "ann")
            assert response.status_code == 429
            assert "'batch'" in error_of(response)["message"]
        # Bob, the same key, has his own window: admitted on both.
        assert (await status(second, "bob")).status_code == 200
        assert (await status(first, "bob")).status_code == 200
        assert (await status(first, "bob")).status_code == 429
        # In Redis: a window and a budget per subject, none for the key itself.
        shared = first.state.keys.shared
        assert shared is not None
        store = await shared._connected()
        prefix = shared.limits.key_prefix
        names = sorted(name.decode("utf-8", "replace") for name in await store.keys(f"{prefix}*"))
        for sub in ("ann", "bob"):
            assert f"{prefix}{{{account('batch', sub)}}}:rpm" in names, names
            assert f"{prefix}{{{account('batch', sub)}}}:tokens" in names, names
        assert not [name for name in names if name.startswith(f"{prefix}{{batch}}")]
        _, ann_day = await charged(shared, account("batch", "ann"))
        _, bob_day = await charged(shared, account("batch", "bob"))
        # Each charged what its own two answers used (the fake's usage: the same for each).
        assert ann_day == bob_day > 0
        samples = await scrape(client, first)
        assert value(samples, "sluice_requests_total", model=MODEL, key="batch", status="429") == 2
