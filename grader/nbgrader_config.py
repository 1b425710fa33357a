# nbgrader configuration for disttrain-lab.  Plain `nbgrader ...` commands run from this
# folder pick it up; `disttrain-lab release|grade` run nbgrader from here too.
#
#   source  (instructor notebooks):  <repo>/solutions/      ($DISTTRAIN_SOURCE_DIR)
#   course  (gradebook.db, release/, submitted/, autograded/, feedback/), outside the repo:
#            ~/.disttrain-lab/course                        ($DISTTRAIN_COURSE_DIR)
#   release (student notebooks, wheels/ beside them):
#            <course>/release/ with $DISTTRAIN_COURSE_DIR set (nbgrader's own layout, where
#            `disttrain-lab release` writes for a course and `nbgrader release_assignment` reads);
#            without it, the maintainer's <repo>/labs/       ($DISTTRAIN_RELEASE_DIR wins over both)
#
# disttrain_lab.grading.configure applies the rest; see disttrain_lab/grading/__init__.py:
#   c.Execute.timeout (per cell), RobustExecute.notebook_timeout (per notebook),
#   RobustExecute.memory_limit (RLIMIT_DATA per kernel/rank process), LimitOutput,
#   OverwriteCells.add_missing_cells, the robust executor, the submission pre-checks,
#   and CourseDirectory.ignore (only notebooks and data/ reach a release).
from disttrain_lab.grading import Limits, configure
from disttrain_lab.grading.releasing import release_folder

c = get_config()  # noqa: F821  (provided by nbgrader when it loads this file)

limits = Limits()  # 180 s per cell, 1500 s per notebook, 4 GiB per process; the env vars
# DISTTRAIN_CELL_TIMEOUT / _NOTEBOOK_TIMEOUT / _KERNEL_MEMORY override
# limits.cell_timeout = 300   # e.g. a slower course machine
configure(c, limits=limits)
# a course folder's own release/ (the same rule as `disttrain-lab release`), else labs/
c.CourseDirectory.release_directory = str(release_folder())

# A course on a JupyterHub, through nbgrader's exchange (release_assignment, collect, release_feedback;
# grader/README.md, "The Hub workflow"), needs two more settings: the course's id and the shared folder
# every student's server sees.  Put them in your own ~/.jupyter/nbgrader_config.py (nbgrader reads it
# as well as this file), and the same two lines in the students' (the user image's
# /etc/jupyter/nbgrader_config.py):
#   c.CourseDirectory.course_id = "dl101"
#   c.Exchange.root = "/srv/nbgrader/exchange"

# Where a lab's setup cell installs the kit from when it is missing (Colab): stamped into
# every released lab by `disttrain-lab release`, which refuses to release while it is unset.
#   "wheel"          release builds the kit's wheel into wheels/ beside the labs (<course>/release/wheels/,
#                    or labs/wheels/); labs install ../wheels/<file> (a Hub or laptop that has the folder)
#   "wheel:https://raw.githubusercontent.com/YOUR-ORG/YOUR-REPO/main/labs/wheels"
#                    the same wheel from that URL: Colab opening the labs from GitHub (commit labs/wheels/)
#   "git+https://github.com/YOUR-ORG/YOUR-REPO@v1"    pip builds the kit from your repository
c.StampInstallSource.pip_requirement = "wheel"
