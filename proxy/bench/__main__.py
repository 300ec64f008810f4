"""``python -m proxy.bench``: the load bench (see the package's docstring)."""

from proxy.bench import main

main()
