"""Named exit codes of quillctl and quillcached: defined in ``quillcache.exitcodes`` (one
place, shared with the daemon), re-exported here for the command-line modules."""
from quillcache.exitcodes import *  # noqa: F403
from quillcache.exitcodes import __all__  # noqa: F401
