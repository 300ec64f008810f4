"""``python -m proxy.bench``: the load bench (see the package's docstring); with ``--sessions``
(or ``--replicas``, ``--instances``), the balance bench (proxy.bench.balance); with ``--matrix``,
the cancellation scorecard (proxy.bench.matrix); with ``--fairness``, the fairness bench
(proxy.bench.fairness, which the load bench's ``main`` hands it to, for ``sluice bench`` too)."""

import sys

from proxy.bench.balance import wants_balance
from proxy.bench.matrix import wants_matrix

if wants_matrix(sys.argv[1:]):
    from proxy.bench.matrix import main
elif wants_balance(sys.argv[1:]):
    from proxy.bench.balance import main
else:
    from proxy.bench import main

main()
