"""Residency index backends behind ``model.IndexBackend``.

``ArtIndex`` (in memory, adaptive radix tree), ``PersistentArtIndex`` (ArtIndex + WAL +
checkpoints) and ``LsmIndex`` (the RocksDB baseline; needs the ``bench`` extra rocksdict,
so it is imported on first use).
"""
from quillcache.index.art import ArtIndex
from quillcache.index.persistent import CorruptCheckpoint, CorruptLog, PersistentArtIndex

__all__ = ["ArtIndex", "PersistentArtIndex", "LsmIndex", "CorruptCheckpoint", "CorruptLog"]


def __getattr__(name):
    if name == "LsmIndex":
        from quillcache.index.lsm import LsmIndex
        return LsmIndex
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
