"""``tests/_support/ucxshm``: what a node killed with SIGKILL leaves in ``/dev/shm`` (a NIXL
agent's UCX segments) is removed after it, and nothing a live process still uses is."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid

from tests._support import ucxshm

# A child that creates two segments under UCX's prefix, maps one and keeps the other open (as a
# UCX worker does), then waits to be killed.
CREATE = textwrap.dedent("""
    import mmap, os, sys, time
    mapped, opened = sys.argv[1], sys.argv[2]
    fd = os.open(mapped, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 1 << 16)
    m = mmap.mmap(fd, 1 << 16)
    os.close(fd)
    keep = os.open(opened, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    print("ready", flush=True)
    time.sleep(60)
""")


def _names(n: int) -> list[str]:
    tag = uuid.uuid4().hex[:8]
    return [f"{ucxshm.PREFIX}test{tag}{i}" for i in range(n)]


# A child that maps a segment another process created (UCX attaching to a peer's) and creates one.
ATTACH = textwrap.dedent("""
    import mmap, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR)
    m = mmap.mmap(fd, 1 << 16)
    os.close(fd)
    own = os.open(sys.argv[2], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    print("ready", flush=True)
    time.sleep(60)
""")


def _child(script: str, *paths: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", script, *paths], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _clean(procs: list[subprocess.Popen], paths: list[str]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    for path in paths:
        if os.path.exists(path):
            os.unlink(path)


def test_a_killed_processes_segments_are_reaped_and_a_live_ones_are_not():
    mapped, opened, other = _names(3)
    victim = _child(CREATE, mapped, opened)
    bystander = _child(CREATE, other, other + "b")  # a live process's segments
    try:
        taken = ucxshm.segments(victim.pid)
        assert taken == {mapped, opened}
        # a live process keeps its segments: reap touches nothing it has open or mapped
        assert ucxshm.reap(ucxshm.segments(bystander.pid) | taken) == []
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        assert os.path.exists(mapped) and os.path.exists(opened)     # SIGKILL unlinks nothing
        # the killed one's go; one the bystander also maps would stay (it has none of them here)
        assert sorted(ucxshm.reap(taken | {other})) == sorted([mapped, opened])
        assert not os.path.exists(mapped) and not os.path.exists(opened) and os.path.exists(other)
        assert ucxshm.reap(taken) == []             # twice is harmless
    finally:
        _clean([victim, bystander], [mapped, opened, other, other + "b"])


def test_a_segment_a_live_peer_maps_is_kept_after_the_killer_dies():
    """The killed node mapped a peer's segment (UCX attaches to its peers' segments): the peer is
    alive and still maps it, so its name stays."""
    own, peer_seg = _names(2)
    peer = _child(CREATE, peer_seg, peer_seg + "b")
    victim = _child(ATTACH, peer_seg, own)
    try:
        taken = ucxshm.segments(victim.pid)
        assert taken == {peer_seg, own}
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        assert ucxshm.reap(taken) == [own]
        assert os.path.exists(peer_seg) and not os.path.exists(own)
    finally:
        _clean([victim, peer], [own, peer_seg, peer_seg + "b"])
