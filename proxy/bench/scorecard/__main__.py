"""``python -m proxy.bench.scorecard``: see the package's docstring."""

from proxy.bench.scorecard import main

main()
