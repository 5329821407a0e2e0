"""The Cython extensions of QuillCache (one per concern; ``setup.py`` builds every ``*.pyx``).

``missing_extensions()`` says which of them cannot be imported: the daemon refuses to start
on a broken build instead of failing later on the first request that needs one.
"""
import importlib

__all__ = ["EXTENSIONS", "REBUILD_HINT", "missing_extensions"]

EXTENSIONS = ("crc", "codec", "alloc", "art", "walread", "wal")   # every _native/*.pyx
REBUILD_HINT = "rebuild the extensions: `make build` (or `pip install -e .` with Cython and a C compiler)"


def missing_extensions() -> list[tuple[str, str]]:
    """``[(module, why)]`` for every extension that does not import; empty when the build is whole."""
    out = []
    for name in EXTENSIONS:
        module = f"{__name__}.{name}"
        try:
            importlib.import_module(module)
        except ImportError as exc:
            out.append((module, f"{type(exc).__name__}: {exc}"))
    return out
