"""The loopback ports tests pick (``tests/_support/ports.py``): two pytest processes of one
`make test` run, given disjoint ``QUILLCACHE_PORT_SLICE``s, never pick the same port."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PICK = ("from tests._support.ports import free_port, _LOWEST, _EPHEMERAL_LOW\n"
        "ports = [free_port() for _ in range(40)]\n"
        "assert all(_LOWEST <= p < _EPHEMERAL_LOW for p in ports), ports\n"
        "print(' '.join(map(str, ports)))")


def pick(slice_: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "QUILLCACHE_PORT_SLICE"}
    if slice_ is not None:
        env["QUILLCACHE_PORT_SLICE"] = slice_
    return subprocess.run([sys.executable, "-c", PICK], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


def test_disjoint_slices_pick_disjoint_ports():
    even, odd = pick("0/2"), pick("1/2")
    assert even.returncode == 0 and odd.returncode == 0, (even.stderr, odd.stderr)
    assert {int(p) % 2 for p in even.stdout.split()} == {0}
    assert {int(p) % 2 for p in odd.stdout.split()} == {1}
    unset = pick(None)
    assert unset.returncode == 0 and len(set(unset.stdout.split())) == 40     # every port, none twice


def test_a_bad_slice_is_a_clear_error():
    for bad in ("2/2", "1", "a/b", "0/0"):
        r = pick(bad)
        assert r.returncode != 0
        assert f"QUILLCACHE_PORT_SLICE={bad!r}: give i/n with 0 <= i < n" in r.stderr
