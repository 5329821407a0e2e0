"""Residency index backends behind ``model.IndexBackend``.

``ArtIndex`` (in memory, adaptive radix tree) and ``PersistentArtIndex`` (ArtIndex + WAL +
checkpoints).  The RocksDB baseline the storage study compares them with lives in
``bench/lsm_index.py`` (it needs the ``bench`` extra rocksdict).
"""
from quillcache.index.art import ArtIndex
from quillcache.index.persistent import CorruptCheckpoint, CorruptLog, PersistentArtIndex

__all__ = ["ArtIndex", "PersistentArtIndex", "CorruptCheckpoint", "CorruptLog"]
