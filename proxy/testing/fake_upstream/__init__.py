"""A fake OpenAI-compatible upstream that behaves like vLLM's OpenAI server.

It exists for tests, benchmarks and demos: it streams deterministic tokens on a schedule,
injects failures on request, and records what it saw (above all, *when* it saw the client go
away). The proxy forwards the original request body, so a test steers the fake per request
with an extra ``"fake": {...}`` field in the JSON body.

Its HTTP/1.1 server side is its own, written by hand on raw trio sockets, rather than the
proxy's codec in ``proxy/protocol/http1.py`` (which the bench's client uses), h11 or a server
library. The reason is speed. The fake shares the machine with the proxy under test in every
benchmark, so what it spends the proxy does not get, and it must feed ~1000 concurrent streams
at 20 ms/token from one core. So a token is one precomputed ``bytes`` object, written by one
clock task (``clock.Ticker``) that wakes once per due batch of tokens of all streams; a
stream's own task only handles what can block. Measured: about 14 us of CPU per token at 1000
streams, connection setup included.

Timing follows vLLM: a streaming response sends its headers at once (Starlette sends
``http.response.start`` before the first token exists), the first token ``ttft`` seconds after
the request was read, and token ``i`` at ``ttft + i * interval``. The schedule is absolute, so
a slow reader gets the tokens it missed in a burst, as from a real server that kept generating.

By default a connection lives as long as its client wants. Real servers are less patient, and a
client's pool must survive them, so the fake can take up their habits: close right after an
answer without saying ``Connection: close`` (legal, and common), close a connection idle for
``keepalive_timeout`` seconds (uvicorn, vLLM's server, does so after 5 s), or close ``late_close``
seconds after an answer without reading what arrived meanwhile: the keep-alive race, in which a
request written onto a connection the server has already given up meets EOF or a reset before
any byte of an answer.

It can serve HTTPS (``tls_cert``/``tls_key``, optionally requiring a client certificate signed
by ``tls_client_ca``), and with ``via_proxy`` it is the HTTP proxy in front of itself: it answers
``CONNECT`` (whatever the target's name, the tunnel leads to the fake) and absolute-form
requests, and refuses a client that bypassed the proxy, so a client's proxy settings can be
tested without a second server. Over TLS the ticker cannot write a token to the socket itself
(the bytes need encrypting), so it hands each token to the stream's task: TLS costs a task
switch per token, the plain path nothing.

The endpoints, each in the shape vLLM serves it, are listed in ``answers``.

A serving model, when asked (each off by default, so every other test sees the plain fake):

* ``max_running``: at most that many requests generate at once; the others wait, in order
  (``num_requests_waiting``), and their TTFT counts from when they start.
* ``prefix_cache_size``: an LRU of that many prompt blocks (``prefix_block_bytes`` each, hashed
  as a chain, so a block stands for the whole prompt up to it, as vLLM's automatic prefix
  caching does). A prompt's TTFT is ``ttft_hit`` plus ``ttft_miss - ttft_hit`` times the
  fraction of its bytes not in the cache: a conversation's next turn on the replica that served
  the previous one is fast, anywhere else slow. The prompt is the chat messages (role and
  text), the prompt, or the input, and instructions or system. A request's own ``fake.ttft``
  still wins.
* ``prefix_block_tokens``: the same cache in blocks of that many tokens, the tokens as
  ``/tokenize`` makes them and the blocks named as vLLM names them (a sha256 chain seeded at
  random per process), used tail first as vLLM frees them. A prompt's uncached tokens are
  prefilled one prompt at a time (``prefill_token_seconds`` each, as an engine's compute is
  shared), looked up when its turn comes (as vLLM's scheduler does, so it hits what the
  prefills before it stored), then its TTFT is ``ttft_hit``. With ``kv_events_port`` the
  blocks stored and evicted are published as vLLM's KV events (``proxy.testing.kv_events``),
  with a replay socket. ``/tokenize`` and ``/detokenize`` take no slot and no prefill.

The modules, bottom to top: ``content`` (what it says: token texts, vectors, scores), ``wire``
(the HTTP/1.1 server side and the framing of streams), ``recorder`` (what it saw),
``prefix_cache``, ``clock`` (the token writer), ``behaviours`` (settings, plans, schedule,
faults, connection habits, the serving model), ``answers`` (each endpoint's answer),
``server`` (``FakeUpstream``), ``cli``. Import from this package; the modules are its inside.
"""

from proxy.testing.fake_upstream.behaviours import MALFORMED_EVENT, MODES, FakeSettings
from proxy.testing.fake_upstream.cli import (
    add_arguments,
    main,
    run_from_args,
    settings_from_args,
)
from proxy.testing.fake_upstream.content import (
    MAX_MODEL_LEN,
    WORDS,
    embedding_vector,
    prompt_tokens,
    relevance_score,
    token_text,
)
from proxy.testing.fake_upstream.prefix_cache import PrefixCache, prompt_bytes
from proxy.testing.fake_upstream.recorder import NoRecordsYet, Outcome, Recorder, RequestRecord
from proxy.testing.fake_upstream.server import FakeUpstream
from proxy.testing.fake_upstream.wire import MAX_BODY_BYTES

__all__ = [
    "MALFORMED_EVENT",
    "MAX_BODY_BYTES",
    "MAX_MODEL_LEN",
    "MODES",
    "WORDS",
    "FakeSettings",
    "FakeUpstream",
    "NoRecordsYet",
    "Outcome",
    "PrefixCache",
    "Recorder",
    "RequestRecord",
    "add_arguments",
    "embedding_vector",
    "main",
    "prompt_bytes",
    "prompt_tokens",
    "relevance_score",
    "run_from_args",
    "settings_from_args",
    "token_text",
]
