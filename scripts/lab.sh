#!/usr/bin/env bash
# Set up .venv (see scripts/setup.sh), copy the labs into your own work/ folder (disttrain-lab start
# --all: a lab fixed later never overwrites what you wrote there) and open JupyterLab on it.
#   bash scripts/lab.sh                         # JupyterLab on work/, opens your browser
#   LAB_ROOT=solutions bash scripts/lab.sh      # another folder (the instructor's notebooks), as it is
#   WORK_ROOT=DIR bash scripts/lab.sh           # your copies of the labs in DIR (default work/)
#   bash scripts/lab.sh --no-browser --port=0   # anything after it goes to `jupyter lab`
#   DISTTRAIN_RESOLUTION=lowest bash scripts/lab.sh   # in .venv-lowest, the lowest versions (scripts/setup.sh)
#   VENV=DIR bash scripts/lab.sh                # another virtual environment's folder (default .venv)
#   DISTTRAIN_KIT=instructor bash scripts/lab.sh   # with nbgrader's menus (default: the student's kit,
#                                               # JupyterLab without them; scripts/setup.sh --help)
#   bash scripts/lab.sh --help                  # this text (jupyter's own: .venv/bin/jupyter lab --help)
case "${1:-}" in -h|--help)    # the usage above, and nothing else done
    sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;;
esac
set -euo pipefail
cd "$(dirname "$0")/.."
# the venv scripts/setup.sh makes: .venv, or .venv-lowest with DISTTRAIN_RESOLUTION=lowest (as in test.sh)
case "${DISTTRAIN_RESOLUTION:-newest}" in lowest) VENV=${VENV:-.venv-lowest} ;; *) VENV=${VENV:-.venv} ;; esac
export VENV
DISTTRAIN_KIT=${DISTTRAIN_KIT:-student} bash scripts/setup.sh   # a venv that has more keeps it
export PATH="$PWD/$VENV/bin:$PATH"
as_root=()
[ "$(id -u)" = 0 ] && as_root=(--allow-root)   # containers and CI run as root; Jupyter refuses it otherwise
if [ -z "${LAB_ROOT:-}" ]; then
    # work/NN_name/: yours (labs/ is the kit's, tracked by git); a lab fixed later is offered beside yours
    "$VENV/bin/disttrain-lab" start --all --labs labs --into "${WORK_ROOT:-work}"
fi
exec "$VENV/bin/jupyter" lab "${LAB_ROOT:-${WORK_ROOT:-work}}" "${as_root[@]}" "$@"
