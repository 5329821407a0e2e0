"""Small filesystem helpers shared by the durable parts (SSD tier, persistent index)."""
import os

__all__ = ["fsync_dir"]


def fsync_dir(path: str) -> None:
    """fsync a directory, so that a file created or renamed in it survives power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
