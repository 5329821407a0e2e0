"""The exit codes of quillcached and quillctl, defined once (sysexits.h where one fits).

Both programs and their manual pages take them from here; ``quillcache_cli.exitcodes``
re-exports this module for the command-line code.
"""
from __future__ import annotations

__all__ = ["OK", "FAILURE", "USAGE", "NOT_FOUND", "UNSAFE_REUSE", "PERMISSION", "CAPACITY", "DATAERR",
           "UNAVAILABLE", "SOFTWARE", "IOERR", "TEMPFAIL", "CONFIG", "QUILLCACHED_EXIT_CODES",
           "QUILLCTL_EXIT_CODES"]

OK = 0
FAILURE = 1           # the request was answered with an error (not found, refused, ...)
USAGE = 2             # click's own code for bad command-line usage
NOT_FOUND = 3         # the key is not there (or not visible to this tenant)
UNSAFE_REUSE = 4      # refused: another model, tokenizer or adapter of this tenant
PERMISSION = 5        # the token does not allow it
CAPACITY = 6          # the node is full
DATAERR = 65          # EX_DATAERR: corrupted data found (wal verify; a corrupt SSD checkpoint at start)
UNAVAILABLE = 69      # EX_UNAVAILABLE: cannot connect to the node (quillctl); no native extensions (quillcached)
SOFTWARE = 70         # EX_SOFTWARE: a protocol error / internal error
IOERR = 74            # EX_IOERR: cannot read or write a local file
TEMPFAIL = 75         # EX_TEMPFAIL: timed out (quillctl); the data dir is locked (quillcached)
CONFIG = 78           # EX_CONFIG: the configuration is invalid

# (code, meaning) for quillcached(8); the systemd unit does not restart on 65 or 78
QUILLCACHED_EXIT_CODES = (
    (OK, "clean stop (SIGTERM or SIGINT)"),
    (DATAERR, "the data directory holds state the node refuses to trust (a corrupt SSD checkpoint): "
              "the log line names the file and what to do"),
    (UNAVAILABLE, "the native extensions (quillcache._native) cannot be loaded: a broken build; the "
                  "message names the module and how to rebuild"),
    (SOFTWARE, "internal error (the log has a traceback)"),
    (TEMPFAIL, "the data directory is locked by another running quillcached"),
    (CONFIG, "invalid configuration (the message names file, section, key and value), or one that the "
             "machine or the data directory contradicts: the address is in use, permission denied, "
             "an SSD capacity or unit that does not fit the data already there"),
)

# (code, meaning) for quillctl --help and quillctl(1)
QUILLCTL_EXIT_CODES = (
    (OK, "ok"), (FAILURE, "the node refused the request"), (USAGE, "bad usage"), (NOT_FOUND, "key not found"),
    (UNSAFE_REUSE, "unsafe reuse refused"), (PERMISSION, "permission denied"), (CAPACITY, "node full"),
    (DATAERR, "corrupt data (wal verify)"), (UNAVAILABLE, "node unreachable"),
    (SOFTWARE, "protocol or internal error"), (IOERR, "local file error"), (TEMPFAIL, "timed out"),
    (CONFIG, "bad configuration"),
)
