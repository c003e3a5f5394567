#!/usr/bin/env bash
# Install posattn into the current Python environment without ever pulling a CUDA torch build:
# torch==2.13.0 (a CPU wheel on the project's machines) goes first, then the project, whose
# "torch>=2.5" is then already satisfied. On a GPU machine any torch >= 2.5 works: install it
# first yourself and this script keeps it. Usage: scripts/install.sh [EXTRAS], e.g. "test".
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==2.13.0"
fi
python -m pip install -q -e ".${1:+[$1]}"
