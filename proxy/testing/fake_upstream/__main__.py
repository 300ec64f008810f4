"""``python -m proxy.testing.fake_upstream``: the fake upstream on its own (the balance bench
starts its replicas so)."""

from proxy.testing.fake_upstream.cli import main

main()
