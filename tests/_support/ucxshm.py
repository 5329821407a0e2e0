"""UCX's shared-memory segments (``/dev/shm/ucx_shm_posix_*``) that a process killed by a test
leaves behind.

A NIXL agent's UCX worker creates a POSIX shared-memory segment for its shared-memory transport
and unlinks it when it shuts down; a process killed with SIGKILL never does, and the name stays in
``/dev/shm`` until someone removes it.  A test that kills a node takes the node's segments first
(``segments``: what the process has open or mapped), and once the process is gone removes those
that no live process still has open or mapped (``reap``): a peer that mapped a segment keeps its
mapping whether or not the name exists, and a segment another live process created is never
touched."""
from __future__ import annotations

import os

PREFIX = "/dev/shm/ucx_shm_posix_"


def segments(pid: int | str) -> set[str]:
    """The UCX segments process ``pid`` has open or mapped (empty if it is gone or unreadable):
    take them before killing it."""
    found: set[str] = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                i = line.find(PREFIX)
                if i >= 0:
                    found.add(line[i:].split()[0])
    except OSError:
        pass
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        fds = []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(PREFIX):
            found.add(target.split()[0])
    return found


def reap(paths: set[str]) -> list[str]:
    """Remove the segments of ``paths`` that still exist and that no live process has open or
    mapped; returns those removed."""
    left = {p for p in paths if os.path.exists(p)}
    if not left:
        return []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            left -= segments(entry)
            if not left:
                return []
    removed = []
    for p in sorted(left):
        try:
            os.unlink(p)
            removed.append(p)
        except OSError:          # gone meanwhile, or another user's (the sticky /dev/shm)
            pass
    return removed
