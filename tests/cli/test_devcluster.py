"""`make cluster` (tests/_support/devcluster.py) as a newcomer drives it: etcd and three nodes come
up, kill -9 of one node is reported while the others keep serving (the README's failure-detection
demo: `quillctl cluster` shows it gone, a block is read again), and Ctrl-C stops everything, exits
0 and removes var/cluster."""
from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests._support.etcd import etcd_binary

ROOT = Path(__file__).resolve().parents[2]
QUILLCTL = str(Path(sys.executable).with_name("quillctl"))

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="make cluster needs etcd (Debian etcd-server)")


@pytest.fixture
def short_dir():
    """The demo's working directory, on a short path: each node's Unix socket lies five levels
    under it (var/cluster/node-a/data/quillcached.sock) and a socket path may have 107 bytes,
    which pytest's tmp_path inside a pytest-xdist worker's directory can exceed."""
    d = Path(tempfile.mkdtemp(prefix="qc-dc-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Demo:
    def __init__(self, cwd: Path) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
        # its own session: SIGINT to the group is what a terminal's Ctrl-C does
        self.proc = subprocess.Popen([sys.executable, "-m", "tests._support.devcluster"], cwd=cwd, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.out = b""
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)

    def wait_for(self, text: str, timeout: float = 90) -> str:
        deadline = time.monotonic() + timeout
        while text.encode() not in self.out:
            assert time.monotonic() < deadline and self.proc.poll() is None, self.out.decode(errors="replace")
            if self._sel.select(0.5):
                self.out += os.read(self.proc.stdout.fileno(), 65536)
        return self.out.decode(errors="replace")

    def ctrl_c(self) -> tuple[int, str]:
        os.killpg(self.proc.pid, signal.SIGINT)
        rest = self.proc.communicate(timeout=60)[0]
        return self.proc.returncode, (self.out + rest).decode(errors="replace")


def quillctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([QUILLCTL, *args], capture_output=True, timeout=60)


def test_kill_9_of_one_node_is_reported_the_others_serve_and_ctrl_c_exits_0_and_cleans_up(short_dir):
    demo = Demo(short_dir)
    try:
        text = demo.wait_for("Ctrl-C stops the pool")
        table = re.findall(r"^(node-\w)\s+(127\.0\.0\.1:\d+)\s+pid (\d+)", text, re.M)
        nodes = {n: addr for n, addr, _ in table}
        pids = {n: int(p) for n, _, p in table}
        assert sorted(nodes) == ["node-a", "node-b", "node-c"]
        assert (short_dir / "var" / "cluster").is_dir()
        blob = short_dir / "b"
        blob.write_bytes(b"hello pool\n")
        a, b = nodes["node-a"], nodes["node-b"]
        assert quillctl("put", "--addr", a, "-m", "demo", "-p", "p0", "-b", "b0", str(blob)).returncode == 0

        # the failure-detection demo: kill -9 the node the banner names
        victim = int(re.search(r"failure detection: kill -9 (\d+)", text).group(1))
        assert victim == pids["node-c"]
        os.kill(victim, signal.SIGKILL)
        text = demo.wait_for("keep serving")
        assert "node-c (pid %d) was killed by SIGKILL" % victim in text
        assert "node-a, node-b keep serving" in text
        deadline = time.monotonic() + 30
        while True:                          # its lease expires: the survivors' view drops it
            r = quillctl("cluster", "--addr", a, "--json")
            assert r.returncode == 0, r.stderr
            up = {m["node_id"] for m in json.loads(r.stdout)["members"] if m["state"] == "up"}
            if up == {"node-a", "node-b"}:
                break
            assert time.monotonic() < deadline, up
            time.sleep(0.5)
        r = quillctl("get", "--addr", b, "-m", "demo", "-p", "p0", "-b", "b0", "-o", str(short_dir / "back"))
        assert r.returncode == 0, r.stderr
        assert (short_dir / "back").read_bytes() == b"hello pool\n"
        r = quillctl("ls", "--addr", b, "-m", "demo", "-p", "p0", "--pool", "--json")
        assert r.returncode == 0, r.stderr
        (listed,) = json.loads(r.stdout)["keys"]
        assert listed["block_hash"] == "b0" and set(listed["holders"]) <= {"node-a", "node-b"} and listed["holders"]
    finally:
        code, text = demo.ctrl_c()
    assert code == 0, text
    assert "make cluster: stopped; var/cluster removed" in text
    assert "exited with code 0" not in text and "Traceback" not in text
    assert not (short_dir / "var" / "cluster").exists()


def test_sigterm_stops_the_pool_with_exit_0_too(short_dir):
    demo = Demo(short_dir)
    demo.wait_for("Ctrl-C stops the pool")
    demo.proc.send_signal(signal.SIGTERM)            # only the demo: it stops the rest itself
    rest = demo.proc.communicate(timeout=60)[0]
    assert demo.proc.returncode == 0, (demo.out + rest).decode(errors="replace")
    assert not (short_dir / "var" / "cluster").exists()


def test_a_pool_that_does_not_come_up_in_time_says_what_each_process_did_and_keeps_the_logs(short_dir):
    # 10 ms is too short for any node to see the others: the path a newcomer meets when a node
    # cannot start (a port taken, etcd slow to answer) or the machine is slow
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "tests._support.devcluster", "--start-timeout", "0.01"], cwd=short_dir,
                       env=env, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "the 3 nodes did not all come up and see each other within 0.01 s" in out
    assert "Traceback" not in out
    for name in ("etcd", "node-a", "node-b", "node-c"):
        line = re.search(rf"^  {name} \(pid \d+\): (.+); the end of (\S+):$", out, re.M)
        assert line, out
        assert Path(line.group(2)).is_file(), line.group(2)          # kept: the log it names is there
    node_a_log = re.search(r"^  node-a \(pid \d+\): .+; the end of (\S+):$", out, re.M).group(1)
    assert "quillcached" in Path(node_a_log).read_text()          # the daemon's own start lines
    assert (short_dir / "var" / "cluster").is_dir()
    assert "is kept for a look" in out and "--start-timeout" in out
    assert "var/cluster removed" not in out
