"""Where a bench writes its results, checked when its arguments are parsed.

A replay or a sweep runs for minutes and writes its files at the end; an output path in a
directory that does not exist used to fail there, with the run lost.  ``out_path`` is an
argparse ``type``: the path's directory must exist and be writable, and the path must not be
a directory, so a wrong path is a usage error before any work is done."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def out_path(text: str) -> str:
    """``text`` unchanged, or ``argparse.ArgumentTypeError`` saying what is wrong with it."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    path = Path(text)
    parent = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a directory; give a file's path")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no directory {parent}; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: directory {parent} is not writable")
    return text
