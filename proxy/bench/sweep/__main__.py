from proxy.bench.sweep import main

main()
