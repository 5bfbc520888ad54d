# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,finetune
STAMP  := $(VENV)/.installed

.PHONY: setup test demo clean bench

setup: $(STAMP)

# torch first: left to itself pip may pick a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m megadiff demo

bench: $(STAMP)
	$(PY) bench/attention.py

clean:
	rm -rf $(VENV) runs .pytest_cache
