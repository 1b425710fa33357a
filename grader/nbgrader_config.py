# nbgrader configuration for disttrain-lab.  Plain `nbgrader ...` commands run from this
# folder pick it up; `disttrain-lab release|grade` run nbgrader from here too.
#
#   source  (instructor notebooks):  <repo>/solutions/      ($DISTTRAIN_SOURCE_DIR)
#   release (student notebooks):     <repo>/labs/           ($DISTTRAIN_RELEASE_DIR)
#   course  (gradebook.db, submitted/, autograded/, feedback/), outside the repo:
#            ~/.disttrain-lab/course                        ($DISTTRAIN_COURSE_DIR)
#
# disttrain_lab.grading.configure applies the rest; see disttrain_lab/grading/__init__.py:
#   c.Execute.timeout (per cell), RobustExecute.notebook_timeout (per notebook),
#   RobustExecute.memory_limit (RLIMIT_DATA per kernel/rank process), LimitOutput,
#   OverwriteCells.add_missing_cells, the robust executor, the submission pre-checks,
#   and CourseDirectory.ignore (only notebooks and data/ reach labs/).
from disttrain_lab.grading import Limits, configure

c = get_config()  # noqa: F821  (provided by nbgrader when it loads this file)

limits = Limits()  # 180 s per cell, 1500 s per notebook, 4 GiB per process; the env vars
# DISTTRAIN_CELL_TIMEOUT / _NOTEBOOK_TIMEOUT / _KERNEL_MEMORY override
# limits.cell_timeout = 300   # e.g. a slower course machine
configure(c, limits=limits)

# Where a lab's setup cell installs the kit from when it is missing (Colab): stamped into
# every released lab by `disttrain-lab release`, which refuses to release while it is unset.
#   "wheel"          release builds the kit's wheel into labs/wheels/; labs install ../wheels/<file>
#                    (a Hub or laptop that has the labs folder)
#   "wheel:https://raw.githubusercontent.com/YOUR-ORG/YOUR-REPO/main/labs/wheels"
#                    the same wheel from that URL: Colab opening the labs from GitHub (commit labs/wheels/)
#   "git+https://github.com/YOUR-ORG/YOUR-REPO@v1"    pip builds the kit from your repository
c.StampInstallSource.pip_requirement = "wheel"
