"""The exceptions of QuillCache, shared by the library, the daemon and the client.

A leaf module with no imports from the rest of the package, so every layer
(the native core included) can raise these.  Each carries a stable ``status``
code: the wire protocol sends the code and the client raises the same class.
"""
from __future__ import annotations

__all__ = [
    "QuillCacheError", "NotFound", "UnsafeReuse", "PermissionDenied", "CapacityError",
    "ProtocolError", "ConnectionLost", "ConfigError", "ReadOnlyError", "InvalidArgument",
    "Timeout", "Busy", "CorruptCheckpoint", "STATUS_CLASSES", "error_for_status", "status_error",
]


class QuillCacheError(Exception):
    status = 1  # generic internal error


class InvalidArgument(QuillCacheError, ValueError):
    """A request or call whose arguments break a limit or the format."""

    status = 2


class NotFound(QuillCacheError, KeyError):
    """No block for that key that this requester may see."""

    status = 3

    def __str__(self) -> str:  # KeyError quotes its argument; we want the plain message
        return Exception.__str__(self)


class UnsafeReuse(QuillCacheError):
    """The content is resident only under another model, tokenizer or adapter of the
    requester's own tenant: serving it would give numerically wrong KV."""

    status = 4
    VIOLATIONS = ("model", "tokenizer", "adapter")

    def __init__(self, violation: str, message: str | None = None) -> None:
        if violation not in self.VIOLATIONS:
            raise ValueError(f"unknown reuse violation {violation!r}")
        self.violation = violation
        super().__init__(message or f"unsafe reuse refused: {violation} mismatch")


class PermissionDenied(QuillCacheError):
    status = 5


class CapacityError(QuillCacheError, MemoryError):
    """Not enough room: says how much was asked, how much is free and the largest extent."""

    status = 6

    def __init__(self, requested: int = 0, free: int = 0, largest_free: int = 0,
                 message: str | None = None) -> None:
        self.requested = requested
        self.free = free
        self.largest_free = largest_free
        super().__init__(message or (
            f"out of capacity: asked for {requested} bytes, {free} bytes free, "
            f"largest free extent {largest_free} bytes"))


class ProtocolError(QuillCacheError):
    status = 7


class ConnectionLost(QuillCacheError, ConnectionError):
    status = 8


class ReadOnlyError(QuillCacheError):
    """The store stopped accepting writes (a failed fsync is fatal for the log)."""

    status = 9


class Timeout(QuillCacheError, TimeoutError):
    status = 10


class Busy(QuillCacheError):
    """A limit on concurrent work was reached (in-flight requests, leases)."""

    status = 11


class ConfigError(QuillCacheError):
    """A configuration file or value is invalid; the message names file, section, key, value."""

    status = 12


class CorruptCheckpoint(QuillCacheError):
    """A checkpoint file (the SSD tier's block map, store/blockmap.py, or the residency
    index's, index/checkpoint.py) fails its checksum or structure checks: refused, never
    half-loaded.  ``problem`` says why in a few words; ``hint`` what the operator can do.
    Raised at start, never sent on the wire (the generic status)."""

    def __init__(self, path: str, problem: str,
                 hint: str = "move it away to recover from the WAL alone") -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"checkpoint {path} is corrupt ({problem}): refusing to start; {hint}")


STATUS_CLASSES = {cls.status: cls for cls in (
    QuillCacheError, InvalidArgument, NotFound, UnsafeReuse, PermissionDenied, CapacityError,
    ProtocolError, ConnectionLost, ReadOnlyError, Timeout, Busy, ConfigError)}


def error_for_status(status: int, message: str, *, violation: str = "model",
                     capacity: tuple[int, int, int] = (0, 0, 0)) -> QuillCacheError:
    """The exception a wire ``status`` stands for (the class from STATUS_CLASSES), with
    ``message``; an unknown status gives a QuillCacheError that carries it.  ``violation``
    and ``capacity`` (requested, free, largest free) are the details of UnsafeReuse and
    CapacityError where the caller knows them (an ERROR body has them, a status list not)."""
    cls = STATUS_CLASSES.get(status)
    if cls is None:
        err = QuillCacheError(message)
        err.status = status
        return err
    if cls is UnsafeReuse:
        return UnsafeReuse(violation, message)
    if cls is CapacityError:
        return CapacityError(*capacity, message=message)
    return cls(message)


def status_error(status: int, what: str) -> QuillCacheError:
    """``error_for_status`` of one item of a batch reply: ``"{what}: status N (ClassName)"``."""
    name = STATUS_CLASSES.get(status, QuillCacheError).__name__
    return error_for_status(status, f"{what}: status {status} ({name})")
