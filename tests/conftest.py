"""Shared pytest set-up: the slow flag and a few fixtures. Helpers live in tests/_support/."""
import glob
import importlib.util
import os
import shutil
import tempfile

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


def pytest_configure(config):
    """Caches that engine packages write under /tmp by default go to a directory of the run's own,
    removed when it ends: torch's inductor cache (``/tmp/torchinductor_<user>``) and, where LMCache
    is installed (``.venv-engines``), its Prometheus multiprocess files (``/tmp/lmcache_prometheus``,
    a file per process that ever counted a metric).  Set before any test module is collected (they
    import the engines); a value the caller set is kept."""
    own = tempfile.mkdtemp(prefix="quillcache-test-caches-")
    config._own_caches = own
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(own, "torchinductor"))
    if importlib.util.find_spec("lmcache") is not None:
        prom = os.path.join(own, "prometheus")
        os.makedirs(prom)
        os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", prom)


def pytest_unconfigure(config):
    own = getattr(config, "_own_caches", None)
    if own is not None:
        shutil.rmtree(own, ignore_errors=True)


def _xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_sessionstart(session):
    if not _xdist_worker(session.config):           # under -n N the controller, before and after every worker
        session.config._ucx_shm_before = set(glob.glob(ucxshm.PREFIX + "*"))


def pytest_sessionfinish(session, exitstatus):
    """UCX segments that appeared during the run and that no live process maps any more (a NIXL
    agent in a process that died without shutting UCX down) are removed, and named, so a leak the
    targeted reaping (``Daemon``, ``make cluster``) missed is seen rather than left in /dev/shm."""
    if _xdist_worker(session.config):               # another worker's NIXL agent may still be starting
        return
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
