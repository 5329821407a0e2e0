"""The Cython extensions of QuillCache: one per ``*.pyx`` of this directory (``setup.py``
builds every one, and ships the ``.pyx`` beside them so that this list holds in a wheel too).

``missing_extensions()`` says which of them cannot be imported: the daemon refuses to start
on a broken build instead of failing later on the first request that needs one.
"""
import importlib
from pathlib import Path

__all__ = ["REBUILD_HINT", "extension_names", "missing_extensions"]

REBUILD_HINT = "rebuild the extensions: `make build` (or `pip install -e .` with Cython and a C compiler)"


def extension_names() -> list[str]:
    """The module names of the extensions this package is built with (``quillcache._native.X``)."""
    return [f"{__name__}.{p.stem}" for p in sorted(Path(__file__).parent.glob("*.pyx"))]


def missing_extensions() -> list[tuple[str, str]]:
    """``[(module, why)]`` for every extension that does not import; empty when the build is whole."""
    out = []
    for module in extension_names():
        try:
            importlib.import_module(module)
        except ImportError as exc:
            out.append((module, f"{type(exc).__name__}: {exc}"))
    return out
