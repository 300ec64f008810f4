"""``python -m proxy.bench``: the load bench (see the package's docstring); with ``--sessions``
(or ``--replicas``, ``--instances``), the balance bench (proxy.bench.balance)."""

import sys

from proxy.bench.balance import wants_balance

if wants_balance(sys.argv[1:]):
    from proxy.bench.balance import main
else:
    from proxy.bench import main

main()
