# Two commands set up a fresh machine by themselves:
#   make run    install if needed, then the main job on embedded defaults
#   make test   install if needed, then the whole test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
RUN_DIR ?=

.PHONY: install run test lab clean-venv system

install: $(STAMP) system

# Re-installs only when the pinned requirements or the package metadata change.
$(STAMP): requirements.txt pyproject.toml scripts/install.sh scripts/top_level.py
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/install.sh
	touch $(STAMP)

# Debian's chromium (the browser tests) and bubblewrap (the code sandbox), checked on every `make
# install` and `make test` (the step above runs only when its inputs change): installed when
# missing, as root with apt.
system:
	@bash scripts/install.sh --system

# The main job: the embedded default run (GRPO on arith with the tiny zoo model after a short
# supervised warm start). It prints the run directory; summary.json there has the accuracies.
run: $(STAMP)
	$(VENV)/bin/hybridlab train $(if $(RUN_DIR),trainer.run_dir=$(RUN_DIR))

# Two pytest-xdist workers, each pinned to its own core (tests/conftest.py), a test module per unit
# of work, the longest first.
test: $(STAMP) system
	$(PY) -m compileall -q --invalidation-mode timestamp hybridlab  # bytecode of what changed since the install (scripts/install.sh)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests

# JupyterLab for the notebooks, with this environment as the kernel, on localhost only; it prints
# the URL with its token (open it in a browser on this machine, or through an SSH tunnel).
LAB_PORT ?= 8888
lab: $(STAMP)
	$(PY) -m ipykernel install --sys-prefix --name hybridlab --display-name "hybridlab (.venv)" >/dev/null
	$(VENV)/bin/jupyter lab --ip=127.0.0.1 --port=$(LAB_PORT) --no-browser --ServerApp.root_dir=notebooks \
		--LabApp.news_url=None --LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate \
		$(if $(filter 0,$(shell id -u)),--allow-root)

clean-venv:
	rm -rf $(VENV)
