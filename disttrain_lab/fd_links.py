"""What a process's open file descriptors link to, read from ``/proc/<pid>/fd``: which sockets a
rank holds (``socket:[N]``, by inode), for ``wire.owners``.

Also run as a file, ``python -I fd_links.py PID ...`` (it prints the links as JSON), by ``wire.owners``
as another user (``setpriv``): a grader that may not read another uid's ``/proc/<pid>/fd`` reads it as
that uid.  So it imports nothing but the standard library.
"""

from __future__ import annotations

import json
import os
import sys

__all__ = ["socket_links"]


def socket_links(pids: list[int]) -> dict[str, list[str]]:
    """What each of ``pids``'s open file descriptors links to (``socket:[N]`` for a socket); raises
    OSError when a process's descriptors cannot be listed."""
    links: dict[str, list[str]] = {}
    for pid in pids:
        links[str(pid)] = []
        for fd in os.listdir(f"/proc/{pid}/fd"):  # (a rank that cannot be read fails the whole count)
            try:
                links[str(pid)].append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except FileNotFoundError:  # closed since the listing: nothing left to count on it
                pass
    return links


if __name__ == "__main__":  # `python -I fd_links.py PID ...`: socket_links, as JSON (wire.owners, as another user)
    print(json.dumps(socket_links([int(p) for p in sys.argv[1:]])))
