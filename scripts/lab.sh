#!/usr/bin/env bash
# Set up .venv (see scripts/setup.sh) and open JupyterLab on the student notebooks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
exec .venv/bin/jupyter lab labs/ "$@"
