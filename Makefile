# Two commands do everything: `make serve` (set up + run the proxy on embedded
# defaults) and `make test` (set up + pass the tests). Both create .venv themselves.
# `make test-lowest` runs the suite again at the oldest versions pyproject.toml allows.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: serve test test-lowest test-integrations demo simulate bench lint system-deps clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Stamps re-run the install only when pyproject.toml changes.
$(VENV)/.serve: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[demo,redis]'
	touch $@

# The newest versions pyproject.toml allows, also in a venv that already holds older ones.
$(VENV)/.test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --upgrade --upgrade-strategy eager -e '.[demo,redis,test,test-agents,dev]'
	touch $@

serve: $(VENV)/.serve
	$(BIN)/spanmeter serve

demo: $(VENV)/.serve
	$(BIN)/spanmeter demo

simulate: $(VENV)/.serve
	$(BIN)/spanmeter simulate

# The suite starts a real redis-server (and a Redis Cluster of three, created with redis-cli,
# which comes with it in redis-tools) and a real Prometheus on ephemeral ports.
system-deps:
	@if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null || ! command -v prometheus >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server redis-tools prometheus; \
	  else \
	    echo "Install redis-server, redis-tools and prometheus (e.g. sudo apt-get install redis-server redis-tools prometheus); the tests that need them are skipped without them."; \
	  fi; \
	fi

test: $(VENV)/.test system-deps
	$(BIN)/pytest -q

# Every direct dependency pinned to its floor (.ci/floors.py turns `>=X` into `==X`), in a
# venv of its own, rebuilt whole when the floors change. The extra test-agents is left out:
# the MCP SDK and openai-agents need newer libraries than spanmeter's floors (mcp 2.0 needs
# pydantic>=2.12), so the test files that drive them run in `make test` only.
LOWEST       := .venv-lowest
AGENT_TESTS  := tests/e2e/test_mcp.py tests/e2e/test_mcp_ceilings.py tests/e2e/test_wrap_up.py \
                tests/e2e/test_refusal_labels.py \
                tests/deploy/test_dashboard_names.py tests/deploy/test_dashboards_prometheus.py

$(LOWEST)/.installed: pyproject.toml .ci/floors.py
	rm -rf $(LOWEST)
	$(PYTHON) -m venv $(LOWEST)
	$(LOWEST)/bin/pip install -q --upgrade pip
	$(PYTHON) .ci/floors.py demo redis test > $(LOWEST)/constraints.txt
	$(LOWEST)/bin/pip install -q --constraint $(LOWEST)/constraints.txt -e '.[demo,redis,test]'
	touch $@

test-lowest: $(LOWEST)/.installed system-deps
	@echo "floors under test:"; $(LOWEST)/bin/pip list --format=freeze 2>/dev/null \
	  | grep -iE "^($$(cut -d= -f1 $(LOWEST)/constraints.txt | sed 's/[-_.]/[-_.]/g' | paste -sd'|' -))==" | paste -sd' ' -
	$(LOWEST)/bin/pytest -q $(addprefix --ignore=,$(AGENT_TESTS))

# The backends people read spanmeter's traces in, for real: Arize Phoenix (the version
# docs/integrations.md records) in a virtualenv of its own, as it pins many packages; the
# test starts it on ephemeral ports and reads the spans back through its REST API.
PHOENIX_VENV    := .venv-phoenix
PHOENIX_VERSION ?= 20.26.1

$(PHOENIX_VENV)/bin/phoenix:
	$(PYTHON) -m venv $(PHOENIX_VENV)
	$(PHOENIX_VENV)/bin/pip install -q --upgrade pip
	$(PHOENIX_VENV)/bin/pip install -q 'arize-phoenix==$(PHOENIX_VERSION)'

test-integrations: $(VENV)/.test $(PHOENIX_VENV)/bin/phoenix
	PHOENIX_BIN=$(PHOENIX_VENV)/bin/phoenix $(BIN)/pytest -q -m phoenix

# The bench prefers nginx (+ echo module) as the fast upstream and py-spy for the profile;
# without them it falls back to an aiohttp upstream and skips the profile, and says so.
bench: $(VENV)/.test
	$(BIN)/pip install -q -e '.[bench]'
	@if ! { command -v nginx && command -v wrk; } >/dev/null && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get install -y -qq --no-install-recommends nginx libnginx-mod-http-echo wrk || true; fi
	$(BIN)/python bench/run.py

lint: $(VENV)/.test
	$(BIN)/ruff check proxy tracing tests bench
	$(BIN)/mypy proxy tracing

clean:
	rm -rf $(VENV) $(LOWEST) $(PHOENIX_VENV) .pytest_cache .mypy_cache .ruff_cache
