"""Every forward pass of a served local model runs in its engine's thread, the start-up check of
its cache included, and a load in a thread of its own that ends with it: a thread that runs
torch keeps an OpenMP team, and more teams than cores make the engine's workers sleep and wake
between the regions of each step (``inference/torch_threads.py`` has the measurements)."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import pytest
import trio

from inference.torch_threads import in_own_thread
from tests.support import RawClient, chat_body, start_local_proxy


class ThreadRecorder:
    """The serving forward, recording the name of each thread that calls it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.config = inner.config
        self.threads: list[str] = []

    def __call__(self, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        return self.inner(**kwargs)


@pytest.mark.parametrize("slots", [1, 4])
async def test_every_forward_pass_runs_in_the_engine_thread(
    nursery: trio.Nursery, tiny_loaded_model: Any, slots: int
) -> None:
    recorder = ThreadRecorder(tiny_loaded_model.serving)
    loaded = dataclasses.replace(tiny_loaded_model, forward=recorder)
    with trio.fail_after(30):
        proxy = await start_local_proxy(nursery, loaded, slots=slots)
        local = proxy.state.local_backends["tiny"]
        raw = await RawClient.post(proxy, "/v1/chat/completions", chat_body("tiny", max_tokens=5))
        await raw.read_until(b"data: [DONE]")
        await raw.close()
    # The check of the cache (several slots only), the prefill (the first token) and 4 decode
    # steps.
    assert len(recorder.threads) == (slots > 1) + 5
    assert set(recorder.threads) == {f"sluice engine {local.model.name}"}
    assert local.engine.batching


def test_in_own_thread_runs_its_work_elsewhere_and_hands_back_its_outcome() -> None:
    here = threading.get_ident()
    assert in_own_thread(threading.get_ident) != here

    def fails() -> None:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        in_own_thread(fails)
    # The thread is gone once the call returns.
    assert not any(t.name == "sluice torch" for t in threading.enumerate())
