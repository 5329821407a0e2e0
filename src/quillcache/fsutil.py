"""Small filesystem helpers shared by the durable parts (SSD tier, persistent index)."""
import os

__all__ = ["fsync_dir", "pread_full"]


def fsync_dir(path: str) -> None:
    """fsync a directory, so that a file created or renamed in it survives power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pread_full(fd: int, dst: memoryview, offset: int) -> int:
    """Read ``len(dst)`` bytes at ``offset`` into ``dst``; fewer only at the end of the file."""
    done, want = 0, len(dst)
    while done < want:
        n = os.preadv(fd, [dst[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done
