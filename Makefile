# Two commands set up a fresh machine by themselves:
#   make run    install if needed, then the main job on embedded defaults
#   make test   install if needed, then the whole test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
RUN_DIR ?=

.PHONY: install run test bench clean-venv

install: $(STAMP)

# Re-installs only when the pinned requirements or the package metadata change.
$(STAMP): requirements.txt pyproject.toml scripts/install.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/install.sh
	touch $(STAMP)

# The main job: the embedded default run (GRPO on arith with the tiny zoo model after a short
# supervised warm start). It prints the run directory; summary.json there has the accuracies.
run: $(STAMP)
	$(VENV)/bin/hybridlab train $(if $(RUN_DIR),trainer.run_dir=$(RUN_DIR))

test: $(STAMP)
	$(PY) -m pytest -q tests

clean-venv:
	rm -rf $(VENV)
