"""Named exit codes of quillctl and quillcached (sysexits.h where one fits)."""
OK = 0
FAILURE = 1           # the request was answered with an error (not found, refused, ...)
USAGE = 2             # click's own code for bad command-line usage
NOT_FOUND = 3         # the key is not there (or not visible to this tenant)
UNSAFE_REUSE = 4      # refused: another model, tokenizer or adapter of this tenant
PERMISSION = 5        # the token does not allow it
CAPACITY = 6          # the node is full
DATAERR = 65          # EX_DATAERR: corrupted data found (wal verify)
UNAVAILABLE = 69      # EX_UNAVAILABLE: cannot connect to the node
SOFTWARE = 70         # EX_SOFTWARE: a protocol error / internal error
IOERR = 74            # EX_IOERR: cannot read or write a local file
TEMPFAIL = 75         # EX_TEMPFAIL: timed out
CONFIG = 78           # EX_CONFIG: the configuration is invalid
