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


def pick(slice_: str | None, worker: tuple[int, int] | None = None) -> subprocess.CompletedProcess:
    """40 ports picked by a process of slice ``slice_``, as pytest-xdist's worker ``gwK`` of ``W``
    when ``worker`` is (K, W)."""
    env = {k: v for k, v in os.environ.items()
           if k != "QUILLCACHE_PORT_SLICE" and not k.startswith("PYTEST_XDIST_")}
    if slice_ is not None:
        env["QUILLCACHE_PORT_SLICE"] = slice_
    if worker is not None:
        env["PYTEST_XDIST_WORKER"], env["PYTEST_XDIST_WORKER_COUNT"] = f"gw{worker[0]}", str(worker[1])
    return subprocess.run([sys.executable, "-c", PICK], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


def test_disjoint_slices_pick_disjoint_ports():
    even, odd = pick("0/2"), pick("1/2")
    assert even.returncode == 0 and odd.returncode == 0, (even.stderr, odd.stderr)
    assert {int(p) % 2 for p in even.stdout.split()} == {0}
    assert {int(p) % 2 for p in odd.stdout.split()} == {1}
    unset = pick(None)
    assert unset.returncode == 0 and len(set(unset.stdout.split())) == 40     # every port, none twice


def test_xdist_workers_split_their_slice_and_stay_out_of_the_others():
    """`make test`: the main suite's two workers (slice 0/2) and the engine tests (1/2)."""
    residues = []
    for k in range(2):
        r = pick("0/2", worker=(k, 2))
        assert r.returncode == 0, r.stderr
        residues.append({int(p) % 4 for p in r.stdout.split()})
    assert residues == [{0}, {2}]                   # even, as 0/2 is, and apart from each other
    engines = pick("1/2")
    assert {int(p) % 2 for p in engines.stdout.split()} == {1}
    alone = pick(None, worker=(1, 2))               # `pytest -n 2` by hand: halves of every port
    assert {int(p) % 2 for p in alone.stdout.split()} == {1}


def test_a_bad_slice_is_a_clear_error():
    for bad in ("2/2", "1", "a/b", "0/0"):
        r = pick(bad)
        assert r.returncode != 0
        assert f"QUILLCACHE_PORT_SLICE={bad!r}: give i/n with 0 <= i < n" in r.stderr
