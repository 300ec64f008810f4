"""Keeps ``--dist loadgroup`` grouping (a plugin of ``tests/conftest.py``).

pytest-xdist's worker tells the scheduler a test's group by appending ``@group`` to the node id
it reports, which it does by writing ``item._nodeid``. pytest 9.2 keeps a node's id elsewhere
(a structured ``NodeId``), so that write changes nothing (pytest-xdist#1386, open for xdist
3.8): every test is then scheduled on its own, and a module's expensive fixture (the real
SmolLM2 loaded, a wheel built) is made once on each worker, the two copies competing for the
same two cores. Here the suffix is written where pytest 9.2 reads it, after xdist's own hook,
and only where that hook's did not take: with a pytest or an xdist that works, this does
nothing.
"""

import pytest


def _group_suffix(item: pytest.Item) -> str | None:
    """The suffix xdist's worker gives a test of ``item``'s groups (as it joins them)."""
    names = {
        str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
        for mark in item.iter_markers("xdist_group")
    }
    return "@" + "_".join(sorted(names)) if names else None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Set only in an xdist worker, and true only under --dist loadgroup.
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        suffix = _group_suffix(item)
        if suffix is None or item.nodeid.endswith(suffix) or not hasattr(item, "_id"):
            continue
        from _pytest.nodeid import NodeId  # pytest >= 9.2, which has Node._id

        item._id = NodeId.parse(item.nodeid + suffix)
