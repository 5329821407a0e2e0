"""NixlEndpoint on real NIXL/UCX agents (host memory): one-sided reads from a registered memfd
arena into the reader's staging area, under the default transports and under UCX_TLS=tcp.

Each scenario runs in a process of its own (tests/_support/nixl_scenarios.py says why).
Skipped, with one line saying so, where NIXL is not installed (``make test`` installs it).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from quillcache.transfer.nixl import nixl_missing

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(nixl_missing() is not None, reason=f"NIXL tests skipped: {nixl_missing()}")


def _scenario(name: str, tls: str = "default") -> None:
    env = {k: v for k, v in os.environ.items() if k != "UCX_TLS"}
    if tls != "default":
        env["UCX_TLS"] = tls
    r = subprocess.run([sys.executable, "-m", "tests._support.nixl_scenarios", name], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and f"OK {name}" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def test_a_read_returns_the_holders_bytes_and_gives_its_staging_back():
    _scenario("read_bytes")


def test_kept_views_hold_their_staging_until_the_last_is_gone():
    _scenario("kept_views_own_their_staging")


def test_an_extent_outside_the_holders_arena_or_a_stale_epoch_is_refused_before_any_transfer():
    _scenario("refused_before_transfer")


def test_a_restarted_holder_replaces_its_old_agent():
    _scenario("restarted_holder")


def test_a_read_larger_than_the_free_staging_is_a_clear_error():
    _scenario("staging_full")


@pytest.mark.parametrize("tls", ["default", "tcp"])
def test_a_read_from_another_process(tls):
    """Holder and reader in two processes, as two nodes are: under the default transports (shared
    memory / CMA on one host) and under UCX_TLS=tcp (as between hosts)."""
    _scenario("other_process", tls)


def test_the_scenario_runner_reports_a_failed_check():
    """The runner itself: a scenario that does not exist fails (exit 1, no OK line)."""
    with pytest.raises(AssertionError):
        _scenario("no_such_scenario")


def test_auto_takes_tcp_when_ucx_tls_names_only_tcp(monkeypatch):
    """auto: UCX_TLS naming only tcp (and self) means FETCH, made without an agent; shared memory,
    CMA, RDMA, a negated list or UCX's default keep NIXL possible; "nixl" is not affected."""
    from quillcache.transfer.nixl import ucx_tcp_only
    from quillcache.transfer.nixl_transport import make_endpoint
    assert ucx_tcp_only("tcp") and ucx_tcp_only("tcp,self") and ucx_tcp_only(" TCP ")
    for tls in ("default", "", "sm,tcp", "shm,cma,tcp", "rc,tcp", "^shm", "all"):
        assert not ucx_tcp_only(tls), tls
    monkeypatch.setenv("UCX_TLS", "tcp")
    assert make_endpoint("auto", arena=None, node_id="n", staging_bytes=1 << 20) is None
