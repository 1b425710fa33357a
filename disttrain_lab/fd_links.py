"""What a process's open file descriptors link to, read from ``/proc/<pid>/fd``: which sockets a
rank holds (``socket:[N]``, by inode), for ``wire.holders``.

Also run as a file, ``python -I fd_links.py PID ...`` (it prints the links as JSON), by ``wire.holders``
as another user (``setpriv``): a grader that may not read another uid's ``/proc/<pid>/fd`` reads it as
that uid.  So it imports nothing but the standard library.
"""

from __future__ import annotations

import json
import os
import sys

__all__ = ["socket_links"]


def socket_links(pids: list[int], skip_gone: bool = False) -> dict[str, list[str]]:
    """What each of ``pids``'s open file descriptors links to (``socket:[N]`` for a socket); raises
    OSError when a process's descriptors cannot be listed (``skip_gone``: but for one that has ended,
    which holds nothing)."""
    links: dict[str, list[str]] = {}
    for pid in pids:
        try:
            listed = os.listdir(f"/proc/{pid}/fd")  # (a rank that cannot be read fails the whole count)
        except FileNotFoundError:
            if not skip_gone:
                raise
            continue
        links[str(pid)] = []
        for fd in listed:
            try:
                links[str(pid)].append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except FileNotFoundError:  # closed since the listing: nothing left to count on it
                pass
    return links


if __name__ == "__main__":  # `python -I fd_links.py [--skip-gone] PID ...`: socket_links, as JSON (wire.holders)
    skip = sys.argv[1:2] == ["--skip-gone"]
    print(json.dumps(socket_links([int(p) for p in sys.argv[1 + skip :]], skip_gone=skip)))
