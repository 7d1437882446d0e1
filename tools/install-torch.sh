#!/usr/bin/env bash
# Installs PyTorch 2.x (and expecttest, which PyTorch's testing helpers import) into tools/.venv, the
# interpreter that the PyTorch baselines use by default (recipes/bench/tp_step.lua --python=...).
# Only benchmark/fixture scripts use it; `make test` never needs torch.
#   tools/install-torch.sh            # python3 -m venv tools/.venv && pip install torch numpy expecttest
#   PYTHON=python3.12 tools/install-torch.sh
# The default PyPI wheel carries the CUDA libraries (about 5 GB on disk); on a machine that can reach
# PyTorch's CPU wheel index, TORCH_INDEX=https://download.pytorch.org/whl/cpu makes it much smaller.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV="$ROOT/tools/.venv"
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV" || { echo "install-torch: '$PY -m venv' failed (apt-get install python3-venv)"; exit 1; }
fi
if "$VENV/bin/python" -c 'import torch, expecttest' 2>/dev/null; then
  echo "install-torch: $("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)') already in $VENV"
  exit 0
fi
extra=()
if [ -n "${TORCH_INDEX:-}" ]; then extra=(--index-url "$TORCH_INDEX" --extra-index-url https://pypi.org/simple); fi
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install "${extra[@]}" torch numpy expecttest
"$VENV/bin/python" -c 'import torch; print("install-torch: torch", torch.__version__, "in '"$VENV"'")'
