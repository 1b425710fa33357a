#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install the kit.
#
#   bash scripts/setup.sh          # the developer's: kit, JupyterLab, instructor tools, test tools
#   DISTTRAIN_KIT=student bash scripts/setup.sh      # the kit and JupyterLab, nothing else (what
#                                  # scripts/lab.sh installs unless told otherwise)
#   DISTTRAIN_KIT=instructor bash scripts/setup.sh   # + nbgrader and the grading tools (release, grade)
#   DISTTRAIN_RESOLUTION=lowest bash scripts/setup.sh   # the same in .venv-lowest, every direct
#                                  # dependency at the lowest version pyproject.toml allows
#   PYTHON=python3.12 bash scripts/setup.sh   # the interpreter that makes the venv (default python3)
#   VENV=DIR bash scripts/setup.sh  # the venv's folder (default .venv, or .venv-lowest)
#   bash scripts/setup.sh --help   # this text
#
# Without DISTTRAIN_RESOLUTION, pip resolves the newest versions the registry serves (what a
# fresh machine, CI and a new user get).  With `lowest`, uv (installed into that venv)
# resolves `--resolution lowest-direct`: each dependency we name at its lower bound, theirs at
# their newest, which proves the lower bounds in pyproject.toml true.
#
# Students on Colab or a Hub need none of this: a lab's setup cell installs the lean kit.
#
# torch: an installed torch is never replaced.  The venv sees the interpreter's
# site-packages (--system-site-packages), so a torch that comes with the machine
# (Colab, a Hub image, a conda env) is used as it is.  Only where no torch can be
# imported do we install the pinned CPU build, torch==2.13.0 -- never an unpinned torch,
# which would pull several GB of CUDA packages.
case "${1:-}" in
    -h|--help)    # the usage above, and nothing else done
        sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;;
    "") ;;
    *)  echo "setup: unknown argument '$1' (it takes none; settings are environment variables: see --help)" >&2; exit 2 ;;
esac
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESOLUTION=${DISTTRAIN_RESOLUTION:-newest}
# what goes in besides the kit (pyproject.toml's extras): the student's JupyterLab (`lab`), the
# instructor's nbgrader and grading tools (`grader`), the developer's pytest, Playwright, JupyterHub (`test`)
case "${DISTTRAIN_KIT:-developer}" in
    student) EXTRAS="lab" ;;
    instructor) EXTRAS="lab,grader" ;;
    developer) EXTRAS="lab,grader,test" ;;
    *) echo "setup: DISTTRAIN_KIT must be 'student', 'instructor' or 'developer' (the default), not '$DISTTRAIN_KIT'" >&2; exit 2 ;;
esac
case "$RESOLUTION" in
    newest) VENV=${VENV:-.venv} ;;
    lowest) VENV=${VENV:-.venv-lowest} ;;
    *) echo "setup: DISTTRAIN_RESOLUTION must be 'newest' (the default) or 'lowest', not '$RESOLUTION'" >&2; exit 2 ;;
esac
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv --system-site-packages "$VENV"
fi
VPY="$VENV/bin/python"
"$VPY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if "$VPY" -c "import torch" >/dev/null 2>&1; then
    echo "setup: using the installed torch $("$VPY" -c 'import torch; print(torch.__version__)')"
else
    echo "setup: no torch found; installing the pinned CPU build torch==2.13.0"
    "$VPY" -m pip install -q "torch==2.13.0"
fi
if [ "$RESOLUTION" = lowest ]; then
    "$VPY" -m pip install -q uv
    "$VENV/bin/uv" pip install -q --python "$VPY" --resolution lowest-direct -e ".[$EXTRAS]"
else
    "$VPY" -m pip install -q -e ".[$EXTRAS]"
fi
echo "setup: ready in $VENV, ${DISTTRAIN_KIT:-developer}'s kit, $RESOLUTION versions ($("$VPY" -c 'import torch, disttrain_lab; print("torch", torch.__version__, "disttrain_lab", disttrain_lab.__version__)'))"
