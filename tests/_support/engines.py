"""The engines' venv (``make engines`` builds ``.venv-engines``) as seen from a test module.

Convention: a test module that imports torch or an engine package starts with

    pytestmark = pytest.mark.engines
    torch = engines.require("torch")

``make test`` runs ``-m "not engines"`` in ``.venv`` and then ``-m engines`` in ``.venv-engines``.
``require`` skips the module in a venv that is not the engines' one (the main venv collects every
module), and fails loudly inside the engines' venv: there a missing package is a broken build,
never a skip.
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

ENGINES_STAMP = ".engines-installed"        # written by `make engines` as its last step

# The versions the adapters were written and tested against (requirements/engines.txt pins them).
VERSIONS = {"torch": "2.13.0", "vllm": "0.33.0", "sglang": "0.5.23", "lmcache": "0.5.6"}


def in_engines_venv() -> bool:
    return (Path(sys.prefix) / ENGINES_STAMP).exists()


def require(name: str) -> ModuleType:
    """Import ``name`` (e.g. "torch", "vllm"): skip the calling module outside the engines'
    venv, raise inside it."""
    if name == "vllm" or name.startswith("vllm."):
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")   # a VllmConfig needs it on CPU
    if not in_engines_venv():
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            pytest.skip(f"engine test: needs {name} ({exc}); runs in .venv-engines under `make test`",
                        allow_module_level=True)
    return importlib.import_module(name)


def version(name: str) -> str:
    """The installed version of an engine package, for the test's own record."""
    from importlib.metadata import version as dist_version
    return dist_version(name)
