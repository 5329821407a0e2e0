"""Named kill points, fault switches and the I/O journal of the crash harness.

Everything here is off unless an environment variable turns it on; the variables are read
once, at import, so a disabled check costs one global bool test.

QUILLCACHE_KILLPOINT=name[:n]
    ``killpoint(name)`` sends SIGKILL to this process at the n-th hit of that point
    (default the first).  Names: KILLPOINTS.
QUILLCACHE_FAULTS=name[:n][,name[:n]...]
    ``fire(name)`` returns True from the n-th call on (a fault stays on once it fired).
    Names: FAULTS.
QUILLCACHE_SSD_READ_DELAY_MS=ms
    ``ssd_read_delay()`` sleeps this many milliseconds, in the thread that reads, before
    every read of a block from the SSD tier's data file (a slow or saturated device).
QUILLCACHE_IO_JOURNAL=path
    The SSD tier appends one line per data-file write ("W id offset length"), per data-file
    fdatasync ("S id": every write with an id <= id is synced) and per WAL commit ("L lsn":
    the WAL is durable up to lsn).  The harness uses it to emulate a power loss: it throws
    away what was written but not yet synced.
"""
from __future__ import annotations

import os
import signal
import threading
import time

__all__ = ["KILLPOINTS", "FAULTS", "KILL_ENABLED", "FAULTS_ENABLED", "JOURNAL_ENABLED",
           "killpoint", "fire", "journal_write", "journal_sync_begin", "journal_sync", "journal_lsn",
           "parse_spec", "ssd_read_delay", "SSD_READ_DELAY_S"]

KILLPOINTS = ("before_data_write", "after_data_write", "after_data_fsync", "after_wal_append",
              "after_wal_fsync", "mid_checkpoint", "mid_recovery")
FAULTS = (
    "wal_fsync_eio",     # the WAL's fsync reports EIO (after really syncing): the tier goes read-only
    "wal_enospc",        # WAL writes fail with ENOSPC: the tier goes read-only
    "data_enospc",       # a data-file pwrite fails with ENOSPC: that put fails, nothing changes
    "data_fsync_eio",    # the data file's fdatasync fails with EIO: the tier goes read-only
)


def parse_spec(spec: str, known: tuple[str, ...], what: str) -> dict[str, int]:
    """'a:3,b' -> {'a': 3, 'b': 1}; ValueError naming the bad part."""
    out: dict[str, int] = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, count = part.partition(":")
        if name not in known:
            raise ValueError(f"{what}: unknown name {name!r}; expected one of {', '.join(known)}")
        try:
            n = int(count) if count else 1
        except ValueError:
            raise ValueError(f"{what}: {part!r}: the countdown must be an integer") from None
        if n < 1:
            raise ValueError(f"{what}: {part!r}: the countdown must be >= 1")
        out[name] = n
    return out


_KILL = parse_spec(os.environ.get("QUILLCACHE_KILLPOINT", ""), KILLPOINTS, "QUILLCACHE_KILLPOINT")
_FAULT = parse_spec(os.environ.get("QUILLCACHE_FAULTS", ""), FAULTS, "QUILLCACHE_FAULTS")
_JOURNAL_PATH = os.environ.get("QUILLCACHE_IO_JOURNAL", "")


def _parse_delay(spec: str) -> float:
    """'200' (milliseconds) -> 0.2 seconds; ValueError naming the variable."""
    if not spec.strip():
        return 0.0
    try:
        ms = float(spec)
    except ValueError:
        raise ValueError(f"QUILLCACHE_SSD_READ_DELAY_MS: {spec!r} is not a number of milliseconds") from None
    if not 0 <= ms <= 60_000:
        raise ValueError(f"QUILLCACHE_SSD_READ_DELAY_MS: {spec!r} must be in [0, 60000] ms")
    return ms / 1000.0


SSD_READ_DELAY_S = _parse_delay(os.environ.get("QUILLCACHE_SSD_READ_DELAY_MS", ""))
KILL_ENABLED = bool(_KILL)
FAULTS_ENABLED = bool(_FAULT)
JOURNAL_ENABLED = bool(_JOURNAL_PATH)

_lock = threading.Lock()
_kill_hits: dict[str, int] = {}
_fault_hits: dict[str, int] = {}


def killpoint(name: str) -> None:
    """SIGKILL this process if QUILLCACHE_KILLPOINT names this point and its countdown ran out."""
    if not KILL_ENABLED:
        return
    target = _KILL.get(name)
    if target is None:
        return
    with _lock:
        hits = _kill_hits.get(name, 0) + 1
        _kill_hits[name] = hits
    if hits == target:
        os.kill(os.getpid(), signal.SIGKILL)


def fire(name: str) -> bool:
    """True when the fault ``name`` is switched on and its countdown ran out (then stays True)."""
    if not FAULTS_ENABLED:
        return False
    target = _FAULT.get(name)
    if target is None:
        return False
    with _lock:
        hits = _fault_hits.get(name, 0) + 1
        _fault_hits[name] = hits
    return hits >= target


def ssd_read_delay() -> None:
    """Sleep QUILLCACHE_SSD_READ_DELAY_MS before an SSD data read (in the reading thread)."""
    if SSD_READ_DELAY_S:
        time.sleep(SSD_READ_DELAY_S)


# ---- the I/O journal (power-loss emulation) -------------------------------------------------
_journal_fd = -1
_write_id = 0


def _journal(line: str) -> None:
    global _journal_fd
    if _journal_fd < 0:
        _journal_fd = os.open(_JOURNAL_PATH, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    os.write(_journal_fd, line.encode())   # one O_APPEND write per line: survives our SIGKILL


def journal_write(offset: int, length: int) -> None:
    """Record a data-file write about to start (before the bytes move: a kill mid-write counts)."""
    global _write_id
    if not JOURNAL_ENABLED:
        return
    with _lock:
        _write_id += 1
        _journal(f"W {_write_id} {offset} {length}\n")


def journal_sync_begin() -> int:
    """The id of the last write journaled before a data-file fdatasync starts."""
    with _lock:
        return _write_id


def journal_sync(covered_id: int) -> None:
    """Record that the data-file fdatasync covering writes <= covered_id returned."""
    if not JOURNAL_ENABLED:
        return
    with _lock:
        _journal(f"S {covered_id}\n")


def journal_lsn(lsn: int) -> None:
    """Record that the WAL is durable up to ``lsn`` (after the commit returned)."""
    if not JOURNAL_ENABLED:
        return
    with _lock:
        _journal(f"L {lsn}\n")
