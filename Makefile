# Two commands on a fresh Debian/Ubuntu machine with Python 3.11+:
#   make run    create the venv, install, start sitsmesh + local Envoy on embedded defaults
#   make test   install what the tests need, then run the whole suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: run test test-unit test-integration lint protos check-protos check-breaking bench sysdeps clean

$(PY): | sysdeps
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# xds-protos ships an old copy of opentelemetry/proto; whichever installs last wins, so
# opentelemetry-proto (what the OTLP exporter needs) is installed again, last.
OTEL_PROTO = $(PIP) install --quiet --force-reinstall --no-deps \
	"opentelemetry-proto==$$($(PY) -c 'from importlib.metadata import version; print(version("opentelemetry-proto"))')"

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --quiet -e '.[test,dev]'
	$(OTEL_PROTO)
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/sitsmesh dev $(ARGS)

# System packages, as CHECK=PACKAGE pairs; installed when root, otherwise named. cmake
# and g++ build llama-cpp-python (a real LLM engine for the token-stream tests; pip
# caches the wheel after the first ~5 min build).
TEST_SYSDEPS  := "$(PYTHON) -c 'import ensurepip, venv'=python3-venv" \
                 "command -v redis-server=redis-server" \
                 "command -v redis-cli=redis-tools" \
                 "ls /usr/lib/postgresql/*/bin/pg_ctl=postgresql" \
                 "command -v openssl=openssl" \
                 "command -v promtool=prometheus" \
                 "command -v chromium=chromium" \
                 "command -v npm=npm" \
                 "command -v zsh=zsh" \
                 "command -v cmake=cmake" \
                 "command -v g++=g++"
BENCH_SYSDEPS := "command -v h2load=nghttp2-client"

sysdeps:
	@scripts/sysdeps.sh $(TEST_SYSDEPS)

# Istio's CRD schemas, compiled by @kubernetes-models/istio (pinned in its lock file).
ISTIO_SCHEMAS := tests/istio/node_modules/.package-lock.json
$(ISTIO_SCHEMAS): tests/istio/package-lock.json | sysdeps
	npm ci --prefix tests/istio --no-audit --no-fund --silent

# The buf CLI (admin API lint and breaking-change check), pinned in its lock file; the
# platform binary comes as an optional dependency of @bufbuild/buf.
BUF       := tools/buf/node_modules/.bin/buf
BUF_STAMP := tools/buf/node_modules/.package-lock.json
$(BUF_STAMP): tools/buf/package-lock.json | sysdeps
	npm ci --prefix tools/buf --no-audit --no-fund --silent

check-breaking: $(BUF_STAMP)
	scripts/check_breaking.sh

# Two passes: most tests spread over two workers, then the ones that judge timing under
# their own load, alone (the `serial` list in tests/conftest.py).
test: sysdeps $(STAMP) $(ISTIO_SCHEMAS) $(BUF_STAMP) check-protos
	$(VENV)/bin/pytest -q -n 2 --dist loadfile -m "not serial"
	$(VENV)/bin/pytest -q -m serial

test-unit: $(STAMP) $(ISTIO_SCHEMAS) $(BUF_STAMP)
	$(VENV)/bin/pytest -q tests/unit

test-integration: $(STAMP)
	$(VENV)/bin/pytest -q tests/integration

lint: $(STAMP) $(BUF_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(BUF) lint protos
	scripts/check_breaking.sh

protos: $(STAMP)
	PYTHON=$(PY) scripts/gen_protos.sh

check-protos: $(STAMP)
	PYTHON=$(PY) scripts/gen_protos.sh --check

bench: sysdeps $(STAMP)
	@scripts/sysdeps.sh $(BENCH_SYSDEPS)
	$(PIP) install --quiet -e '.[test,dev,bench]'
	$(OTEL_PROTO)
	$(PY) bench/health_throughput.py
	$(PY) bench/ratelimit_throughput.py
	$(PY) bench/ratelimit_envoy.py
	$(PY) bench/authz_throughput.py
	$(PY) bench/authz_envoy.py
	$(PY) bench/accesslog_throughput.py
	$(PY) bench/swap_triton.py
	$(PY) bench/overload/run.py

clean:
	rm -rf $(VENV) .run .pytest_cache .mypy_cache .ruff_cache
