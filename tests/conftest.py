"""Shared pytest set-up: the slow flag and a few fixtures. Helpers live in tests/_support/."""
import glob
import os

import pytest

from tests._support import ucxshm
from tests._support.net import free_port

# vLLM infers its platform when first imported, possibly while a module is being collected;
# on these GPU-less machines it must be told before any test imports it.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="run long property/soak tests (also QUILLCACHE_SLOW=1)")
    parser.addoption("--crash-long", action="store_true", default=False,
                     help="run the long crash-injection campaign (make crash N=...)")


def slow_enabled(config) -> bool:
    return config.getoption("--slow") or os.environ.get("QUILLCACHE_SLOW", "") not in ("", "0")


def pytest_sessionstart(session):
    session.config._ucx_shm_before = set(glob.glob(ucxshm.PREFIX + "*"))


def pytest_sessionfinish(session, exitstatus):
    """UCX segments that appeared during the run and that no live process maps any more (a NIXL
    agent in a process that died without shutting UCX down) are removed, and named, so a leak the
    targeted reaping (``Daemon``, ``make cluster``) missed is seen rather than left in /dev/shm."""
    before = getattr(session.config, "_ucx_shm_before", set())
    removed = ucxshm.reap(set(glob.glob(ucxshm.PREFIX + "*")) - before)
    if removed:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"removed {len(removed)} UCX segment(s) left by a process that died: "
                                + ", ".join(removed), yellow=True)


def pytest_collection_modifyitems(config, items):
    if slow_enabled(config):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow or QUILLCACHE_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def loopback_port():
    return free_port()
