"""What the grader takes from a submission folder, ``submitted/<student>/<lab>/``: the
notebook and nbgrader's ``timestamp.txt`` and ``submission_secret.txt``, each read only if it
is a regular file, never through a symbolic link (the folders included); everything else is
listed for the grade report and never copied to where the student's code runs.

The folder is the student's data.  nbgrader itself copies every other file in it into the
autograded folder (the kernel's working directory, first on ``sys.path``: a ``torch/`` or
``disttrain_lab/`` there shadows the real one) and follows symbolic links as it copies,
as the grading account: a link to the gradebook, a hidden test or a classmate's notebook
would hand their contents to the student.  So ``disttrain-lab grade`` never shows nbgrader
the folder: :func:`stage` writes what the grader takes into a folder of its own, and
nbgrader grades that (``--CourseDirectory.submitted_directory``).  :func:`read_notebook` is
also what nbgrader's reader (``submission.SubmissionExporter``), the scan and the resume
digest use.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
from pathlib import Path

MAX_NOTEBOOK_BYTES = 50_000_000
TIMESTAMP = "timestamp.txt"  # nbgrader's submission time (late penalties)
MAX_TIMESTAMP_BYTES = 1000
# nbgrader's exchange (`nbgrader submit`) writes it; `nbgrader release_feedback` names the feedback
# it hands back to this submission after it, so it travels to autograded/ and feedback/ (the
# student's own: it says nothing of anyone else's)
SECRET = "submission_secret.txt"
NBGRADER_FILES = (TIMESTAMP, SECRET)  # at most MAX_TIMESTAMP_BYTES each
# written by stage() beside a notebook it could not take: why (the staged notebook is empty)
REFUSED_NOTE = ".disttrain-refused.json"

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a named pipe must not wait for a writer (a regular file ignores it)
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Refused(Exception):
    """Why the grader does not take a submitted notebook (said to the student)."""


def kind(mode: int) -> str:
    """What a file system entry is, in words (from an lstat: a link is a link)."""
    for test, words in (
        (stat.S_ISREG, "a file"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a device file"),
        (stat.S_ISBLK, "a device file"),
    ):
        if test(mode):
            return words
    return "a special file"


def _shown(name: str) -> str:
    return name if name.isprintable() else ascii(name)


def _open_folder(folder: Path) -> int:
    """An fd of ``<submitted>/<student>/<lab>``; neither ``<student>`` nor ``<lab>`` may be a
    symbolic link (``<submitted>`` is the course's own)."""
    fd = os.open(folder.parent.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in (folder.parent.name, folder.name):
            try:
                inner = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                what = kind(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
                raise Refused(
                    f"is in a submission folder that is {what}, not a plain folder ({_shown(name)}/): "
                    "a link is never followed"
                ) from None
            os.close(fd)
            fd = inner
        return fd
    except BaseException:
        os.close(fd)
        raise


def _read_regular(name: str, folder_fd: int, limit: int) -> bytes:
    """The bytes of ``name`` in the folder if it is a regular file of at most ``limit`` bytes."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=folder_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Refused(
                "is a symbolic link, not a file: a link is never followed (it could point at anyone's "
                "file), only the notebook file itself is graded"
            ) from None
        if exc.errno == errno.ENOENT:
            raise Refused("is missing") from None
        raise Refused(f"could not be opened ({os.strerror(exc.errno or 0)})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise Refused(f"is {kind(st.st_mode)}, not a notebook file")
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1) if st.st_size <= limit else b""
        if len(data) > limit or st.st_size > limit:  # (it may grow while read)
            raise Refused(f"is {max(st.st_size, len(data)) // 10**6} MB, more than the {limit // 10**6} MB allowed")
        return data


def read_notebook(path: Path, limit: int = MAX_NOTEBOOK_BYTES) -> bytes:
    """The bytes of a submitted notebook ``<submitted>/<student>/<lab>/<name>.ipynb``, or
    :class:`Refused` saying why not (a link, a pipe, a folder, too big, a linked folder)."""
    path = Path(path)
    fd = _open_folder(path.parent)
    try:
        try:
            note = json.loads(_read_regular(REFUSED_NOTE, fd, 10_000))
        except (Refused, ValueError):
            note = None
        if isinstance(note, dict) and note.get("refused"):  # stage() could not take it
            raise Refused(str(note["refused"]))
        return _read_regular(path.name, fd, limit)
    finally:
        os.close(fd)


def _nbgrader_file(folder_fd: int, name: str) -> bytes | None:
    """nbgrader's file ``name`` (one of :data:`NBGRADER_FILES`) if it is a small regular file."""
    try:
        return _read_regular(name, folder_fd, MAX_TIMESTAMP_BYTES)
    except Refused:
        return None


def fingerprint(path: Path) -> bytes:
    """What grading takes from the folder of notebook ``path``, as bytes to hash: the
    notebook (or why it is refused) and the timestamp; extra files do not count."""
    h = hashlib.sha256()
    try:
        h.update(b"notebook\0" + read_notebook(path))
    except Refused as refused:
        h.update(b"refused\0" + str(refused).encode())
    except OSError as exc:  # no such folder
        h.update(b"absent\0" + str(exc.errno).encode())
    try:
        fd = _open_folder(Path(path).parent)
    except (Refused, OSError):
        return h.digest()
    try:
        h.update(b"\0timestamp\0" + (_nbgrader_file(fd, TIMESTAMP) or b"-"))
    finally:
        os.close(fd)
    return h.digest()


def extras(path: Path) -> list[str]:
    """Everything in the folder of notebook ``path`` that the grader does not take, one line
    each (name and what it is; a link's target as written, never followed); [] if none."""
    folder = Path(path).parent
    try:
        fd = _open_folder(folder)
    except (Refused, OSError):  # a linked folder is not looked into (read_notebook says why)
        return []
    lines = []
    try:
        with os.scandir(fd) as entries:
            found = sorted(entries, key=lambda e: e.name)
        for entry in found:
            st = entry.stat(follow_symlinks=False)
            if entry.name in (Path(path).name, *NBGRADER_FILES) and stat.S_ISREG(st.st_mode):
                if entry.name == Path(path).name or st.st_size <= MAX_TIMESTAMP_BYTES:
                    continue
            what = kind(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                what += f" to {_shown(os.readlink(entry.name, dir_fd=fd))}"
            elif stat.S_ISDIR(st.st_mode):
                inner = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
                try:
                    count = len(os.listdir(inner))
                    what += f" of {count} entr{'y' if count == 1 else 'ies'}"
                finally:
                    os.close(inner)
            elif stat.S_ISREG(st.st_mode):
                what += f" of {st.st_size} bytes"
            lines.append(f"{_shown(entry.name)}: {what}")
    finally:
        os.close(fd)
    return lines


def stage(submitted: Path, students: list[str], lab: str, into: Path) -> Path:
    """Write what the grader takes of each student's ``submitted/<student>/<lab>/`` into
    ``into/<student>/<lab>/`` (the notebook ``<lab>.ipynb``, a regular ``timestamp.txt`` and
    ``submission_secret.txt``; a notebook that cannot be taken is staged empty, with
    :data:`REFUSED_NOTE` saying why);
    returns ``into``, for nbgrader's ``--CourseDirectory.submitted_directory``."""
    # nbgrader matches paths below its submitted directory with a regular expression built
    # from that path unescaped: the path must read as itself
    if not re.fullmatch(r"[\w./-]+", str(into)):
        raise ValueError(
            f"the grading temp dir {str(into)!r} has characters nbgrader cannot use in a path "
            "(only letters, digits, '_', '.', '-' and '/'): set TMPDIR to a plain path"
        )
    for student in students:
        folder = Path(submitted) / student / lab
        staged = into / student / lab
        staged.mkdir(parents=True)
        notebook = folder / f"{lab}.ipynb"
        try:
            data = read_notebook(notebook)
        except Refused as refused:
            data = b""
            (staged / REFUSED_NOTE).write_text(json.dumps({"refused": str(refused)}))
        except OSError as exc:
            data = b""
            (staged / REFUSED_NOTE).write_text(json.dumps({"refused": f"could not be read ({exc.strerror})"}))
        (staged / notebook.name).write_bytes(data)
        try:
            fd = _open_folder(folder)
        except (Refused, OSError):
            continue
        try:
            found = {name: _nbgrader_file(fd, name) for name in NBGRADER_FILES}
        finally:
            os.close(fd)
        for name, data in found.items():
            if data is not None:
                (staged / name).write_bytes(data)
    return into
