"""What a sandboxed kernel sees of the grader's environment: an allowlist, never the grader's own
(tokens, ``HOME``, the course's paths).  Standard library only: ``run_sandbox.py`` and
``run_container.py`` load it by its path (they run as files, outside the package);
``sandbox.kernel_env`` names it for the grader's side."""

from __future__ import annotations

import os

# names passed through as they are: the locale, thread counts, the kit's and torch's settings
ENV_NAMES = {
    "PATH",
    "LANG",
    "LANGUAGE",
    "TZ",
    "TERM",
    "MPLBACKEND",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "PYTHONDONTWRITEBYTECODE",
    "PYTHONUNBUFFERED",
    "PYTHONHASHSEED",
    "NBGRADER_EXECUTION",
    "CUDA_VISIBLE_DEVICES",
}
ENV_PREFIXES = ("LC_", "DISTTRAIN_LAB_", "GLOO_", "NCCL_")


def kernel_env(environ: dict, *, home: str, runtime: str, keep: list[str]) -> dict:
    """What a sandboxed kernel sees of the grader's environment: the allowlist above;
    ``PYTHONPATH`` only with its entries inside the kept paths (the kit); ``HOME`` and the
    config dirs in the sandbox's private home.  Everything else -- a token, the course's
    paths (``DISTTRAIN_COURSE_DIR``), the grader's ``HOME`` -- stays out."""
    env = {k: v for k, v in environ.items() if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}
    inside = [
        p
        for p in environ.get("PYTHONPATH", "").split(os.pathsep)
        if p
        and any(os.path.realpath(p) == k or os.path.realpath(p).startswith(k.rstrip(os.sep) + os.sep) for k in keep)
    ]
    if inside:
        env["PYTHONPATH"] = os.pathsep.join(inside)
    env.update(
        HOME=home,
        TMPDIR="/tmp",
        JUPYTER_RUNTIME_DIR=runtime,
        IPYTHONDIR=os.path.join(home, ".ipython"),
        MPLCONFIGDIR=os.path.join(home, ".matplotlib"),
        USER="student",
        LOGNAME="student",
        JPY_PARENT_PID="1",
    )  # ipykernel's parent poller: its parent is the sandbox's init
    return env
