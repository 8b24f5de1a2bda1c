# Two commands set up a fresh machine by themselves:
#   make run    install if needed, then the main job on embedded defaults
#   make test   install if needed, then the whole test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
RUN_DIR ?= runs/quickstart

.PHONY: install run test bench clean-venv

install: $(STAMP)

# Re-installs only when the pinned requirements or the package metadata change.
$(STAMP): requirements.txt pyproject.toml scripts/install.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/install.sh
	touch $(STAMP)

# Until the RL loop lands, the main job is the supervised warm start plus its evaluation.
run: $(STAMP)
	$(VENV)/bin/hybridlab sft --task arith --model tiny --out $(RUN_DIR)/sft-tiny-arith
	$(VENV)/bin/hybridlab eval --model $(RUN_DIR)/sft-tiny-arith --task arith --json

test: $(STAMP)
	$(PY) -m pytest -q tests

clean-venv:
	rm -rf $(VENV)
