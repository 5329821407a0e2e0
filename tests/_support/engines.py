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
    venv, raise inside it -- also when the installed version is not the one in ``VERSIONS``,
    which every engine test names: a test never passes against an engine it does not name."""
    if name == "vllm" or name.startswith("vllm."):
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")   # a VllmConfig needs it on CPU
    if not in_engines_venv():
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            pytest.skip(f"engine test: needs {name} ({exc}); runs in .venv-engines under `make test`",
                        allow_module_level=True)
    mod = importlib.import_module(name)
    top = name.split(".")[0]
    if top in VERSIONS and not version(top).startswith(VERSIONS[top]):
        raise RuntimeError(f"{top} {version(top)} is installed; the engine tests name {VERSIONS[top]} "
                           "(update VERSIONS, requirements/engines.txt, docs/engines.md and the tests)")
    return mod


def version(name: str) -> str:
    """The installed version of an engine package, for the test's own record."""
    from importlib.metadata import version as dist_version
    return dist_version(name)


class _Unusable:
    """An import-time stand-in: any attribute is another stand-in, any call raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unusable(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is not installed in the engines' venv")


def _unusable_module(name: str) -> ModuleType:
    import importlib.machinery

    mod = ModuleType(name)
    mod.__path__ = []
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)

    def attr(a: str):
        if a.startswith("__"):
            raise AttributeError(a)
        return _Unusable(f"{name}.{a}")
    mod.__getattr__ = attr
    return mod


TORCHVISION_NAMES = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")


def import_sglang(*names: str) -> list[ModuleType]:
    """Import SGLang modules whose import chain reaches ``sglang.srt.configs`` (the host KV
    pools, the radix cache), whose vision-model configs import torchvision at module level.
    torchvision has no CPU build for torch 2.13 on this index (its manylinux wheel links
    libc10_cuda), so while these modules are imported, and only then, torchvision is an
    import-only stand-in whose every use raises; it is removed again, so
    ``find_spec("torchvision")`` is None for everything else (transformers decided so already)."""
    require("sglang")
    import transformers  # noqa: F401  (decides "no torchvision" before the stand-in exists)
    try:
        importlib.import_module("torchvision")
        stub = False
    except ImportError:
        stub = True
    if stub:
        for name in TORCHVISION_NAMES:
            sys.modules[name] = _unusable_module(name)
    try:
        return [importlib.import_module(n) for n in names]
    finally:
        if stub:
            for name in TORCHVISION_NAMES:
                sys.modules.pop(name, None)
