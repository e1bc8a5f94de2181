# kvcached: `make demo` runs the main job, `make test` runs the whole suite.
# Both set up .venv on first use (torch pinned to the CPU build on this machine).
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
TORCH   ?= torch==2.13.0

.PHONY: demo test lint cuda bench clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "$(TORCH)"
	$(VPY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VPY) -m kvcached demo

test: $(STAMP)
	$(VPY) -m pytest -q -ra

lint: $(STAMP)
	$(VPY) -m ruff check kvcached tests scripts

cuda: $(STAMP)
	$(VPY) -m kvcached build-cuda

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
