"""What the upstreams say of the models they serve (``[upstream] list_upstream_models``).

One task per replica asks its ``GET /v1/models`` every ``models_refresh_interval``, through
the replica's own proxy, TLS settings and key (``transports.health_client``), and keeps, for
each Sluice model it serves, the entry that names it (by the model's ``upstream_model``, the
name the server knows), or the only entry, when the server lists one model under its own name,
as ``vllm serve --served-model-name`` does not require. ``GET
/v1/models`` merges those entries into its own: ``max_model_len``, ``owned_by``, ``root``...

A replica that does not answer keeps its last entries; nothing here ever delays a request.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import trio

from proxy.backends.upstream.replica import USER_AGENT, UpstreamReplica
from proxy.backends.upstream.transports import health_client

log = logging.getLogger("sluice.upstream")

# An upstream's model list is small; a larger answer is not one.
_MAX_LIST_BYTES = 1024 * 1024
# The fields of an upstream's entry that are its own to say (the id and object stay Sluice's).
_IGNORED_FIELDS = frozenset({"id", "object"})


class ModelCatalog:
    def __init__(self) -> None:
        self.entries: dict[str, dict[str, Any]] = {}

    async def refresh_forever(
        self,
        served: Mapping[UpstreamReplica, Sequence[str]],
        interval: float,
        upstream_names: Mapping[str, str] | None = None,
    ) -> None:
        """Keep the entries fresh; runs under the app's nursery and ends with it.
        ``upstream_names``: each aliased model's name upstream (its ``upstream_model``); a
        model not in it is listed upstream under its own name."""
        aliases = dict(upstream_names or {})
        async with trio.open_nursery() as nursery:
            for replica, names in served.items():
                nursery.start_soon(self._refresh_replica, replica, list(names), interval, aliases)

    async def _refresh_replica(
        self,
        replica: UpstreamReplica,
        names: list[str],
        interval: float,
        upstream_names: Mapping[str, str],
    ) -> None:
        async with health_client(replica.connection, interval) as client:
            while True:
                with trio.move_on_after(interval):
                    try:
                        listed = await _fetch(client, replica)
                    except (httpx.HTTPError, ValueError) as error:
                        log.info("models of %s: %s", replica.url, error)
                    else:
                        self._merge(names, listed, upstream_names)
                await trio.sleep(interval)

    def _merge(
        self,
        names: list[str],
        listed: list[dict[str, Any]],
        upstream_names: Mapping[str, str] | None = None,
    ) -> None:
        by_id = {entry.get("id"): entry for entry in listed if isinstance(entry, dict)}
        aliases = upstream_names or {}
        for name in names:
            entry = by_id.get(aliases.get(name, name))
            if entry is None and len(by_id) == 1:
                entry = next(iter(by_id.values()))
            if entry is not None:
                self.entries[name] = {
                    key: value for key, value in entry.items() if key not in _IGNORED_FIELDS
                }


async def _fetch(client: httpx.AsyncClient, replica: UpstreamReplica) -> list[dict[str, Any]]:
    headers = {"User-Agent": USER_AGENT.decode()}
    if replica.authorization is not None:
        headers["Authorization"] = replica.authorization
    url = replica.root_url + "/v1/models"
    async with client.stream("GET", url, headers=headers) as response:
        if response.status_code != 200:
            raise ValueError(f"GET /v1/models answered {response.status_code}")
        body = b""
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > _MAX_LIST_BYTES:
                raise ValueError("GET /v1/models answered more than 1 MiB")
    listing = json.loads(body)
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        raise ValueError("GET /v1/models answered no 'data' list")  # noqa: TRY004 - a bad answer
    return data
