"""The peers the benches compare Sluice with, each started in front of the fake upstream with a
committed config that is fair for streaming: the FastAPI peer (``fastapi_gateway.py``, this
project's own), LiteLLM's proxy, Envoy, nginx, vllm-router, sglang-router and Portkey's
gateway. Each is installed, pinned, into its own folder under ``.peers/`` (gitignored).

``specs``: the static facts the reports name (package, version, how it is configured, what it
cannot serve, its own tracker entries); ``install``: ``ensure_installed``; ``configs``: the
config templates and argv (pure); ``start``: ``start_peer``, owned by the caller's nursery.
"""

from proxy.bench.peers.install import PEERS_ROOT, ensure_installed, installed, peer_dir
from proxy.bench.peers.specs import PEER_NAMES, SPECS, PeerSpec, spec
from proxy.bench.peers.start import StartedPeer, peer_version, start_peer

__all__ = [
    "PEERS_ROOT",
    "PEER_NAMES",
    "SPECS",
    "PeerSpec",
    "StartedPeer",
    "ensure_installed",
    "installed",
    "peer_dir",
    "peer_version",
    "spec",
    "start_peer",
]
