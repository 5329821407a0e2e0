"""``make cluster``: etcd and three quillcached nodes on loopback, for a newcomer to try.

    make cluster            # Ctrl-C (or SIGTERM) stops everything and exits 0
    quillctl cluster --addr 127.0.0.1:<port of node-a>
    quillctl put --addr ... -m demo -p p0 -b b0 FILE   (on one node)
    quillctl get --addr ... -m demo -p p0 -b b0        (on another)

Failure detection: ``kill -9`` one node's pid (printed at start).  The others keep serving;
this prints what happened, and once the dead node's etcd lease expires (3 s here) ``quillctl
cluster`` on a survivor shows it gone and a block it held is read again from another holder or
recomputed by the caller.  State (configs, logs, the etcd data dir) lives under ./var/cluster
and is removed on exit, unless the nodes did not come up: then it is kept for a look, and
what each process did (exited, or running and not answering yet, with the end of its log) is
printed before exiting 1.  ``--start-timeout S`` (default 30) is how long they get.
"""
from __future__ import annotations

import argparse
import shutil
import signal
import sys
import time
from pathlib import Path

from quillcache import Client
from tests._support import ucxshm
from tests._support.cluster import CREDENTIAL, Pool, cluster_view
from tests._support.etcd import EtcdServer

LEASE_TTL = "3s"
POLL_S = 0.5                     # seconds between looks at the processes
START_TIMEOUT_S = 30.0           # seconds for every node to see every other one up
LOG_TAIL = 12                    # lines of a process's log shown when the pool did not come up
QUILLCTL = ".venv/bin/quillctl"


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _transport(pool: Pool, d, timeout: float = 10.0) -> str:
    """The node's [cluster] transport once ``auto`` settled (NIXL's agent is made in the background)."""
    deadline = time.monotonic() + timeout
    while True:
        with Client(d.addr, token=pool.token) as c:        # INFO is a tenant's request, not a node's
            info = c.info("cluster")["Cluster"]
        if info["transport_transport"] == "nixl" or "transport auto -> tcp" in d.log() \
                or time.monotonic() > deadline:
            extra = f" (UCX_TLS {info['transport_ucx_tls']})" if info["transport_transport"] == "nixl" else ""
            return info["transport_transport"] + extra
        time.sleep(0.05)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="make cluster")
    ap.add_argument("nodes", nargs="?", type=int, default=3)
    ap.add_argument("--start-timeout", type=float, default=START_TIMEOUT_S, metavar="S",
                    help="seconds for the nodes to come up and see each other")
    args = ap.parse_args(argv)
    n = args.nodes
    root = Path("var/cluster").resolve()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    stop: list[int] = []
    kept = False

    def on_signal(signum, _frame) -> None:
        stop.append(signum)

    # Ctrl-C reaches every process of the terminal's group: the nodes drain and stop on their
    # own, and this loop must not take their exit for a failure.
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        with EtcdServer(root / "etcd") as etcd:
            with Pool(root, etcd.endpoint, n, lease_ttl=LEASE_TTL, dram="512MiB", cluster_id="dev") as pool:
                try:
                    pool.wait_members(n, timeout=args.start_timeout)
                except AssertionError:
                    _explain(etcd, pool, n, args.start_timeout, root)
                    kept = True
                    return 1
                _banner(etcd, pool)
                _watch(etcd, pool, stop)
                for d in pool.nodes.values():        # a clean stop: TERM drains (the pool's close kills)
                    if d.proc.poll() is None:
                        d.stop(signal.SIGTERM, timeout=15)
    finally:
        if not kept:
            shutil.rmtree(root, ignore_errors=True)
    print("make cluster: stopped; var/cluster removed", flush=True)
    return 0


def _processes(etcd: EtcdServer, pool: Pool) -> list:
    """(name, process, log path, address) of etcd and of each node."""
    return [("etcd", etcd.proc, etcd.log_path, etcd.endpoint)] + \
        [(k, d.proc, d.log_path, d.addr) for k, d in pool.nodes.items()]


def _tail(path: Path, lines: int = LOG_TAIL) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError as exc:
        return f"      ({path}: {exc.strerror or exc})"
    return "\n".join(f"      {line}" for line in text) or "      (empty)"


def _explain(etcd: EtcdServer, pool: Pool, n: int, timeout: float, root: Path) -> None:
    """What each process did when the pool did not come up in time (its logs are kept)."""
    print(f"make cluster: the {n} nodes did not all come up and see each other within {timeout:g} s",
          flush=True)
    for name, proc, log, addr in _processes(etcd, pool):
        if proc.poll() is not None:
            state = _how(proc.returncode)
        elif name == "etcd":
            state = f"running on {addr}"
        else:
            try:
                members = cluster_view(addr, timeout=2.0, token=pool.token)["members"]
                up = sorted(m["node_id"] for m in members if m["state"] == "up")
                state = f"answering on {addr}, sees {len(up)} of {n} up ({', '.join(up) or 'none'})"
            except Exception as exc:        # what a newcomer needs is the reason, whatever it is
                state = f"running, not answering on {addr} ({exc})"
        print(f"  {name} (pid {proc.pid}): {state}; the end of {log}:\n{_tail(log)}", flush=True)
    print(f"make cluster: {root} is kept for a look (the next `make cluster` removes it); "
          f"`make cluster CLUSTER_ARGS=\"--start-timeout 120\"` gives the nodes longer", flush=True)


def _banner(etcd: EtcdServer, pool: Pool) -> None:
    print(f"etcd      {etcd.endpoint}   pid {etcd.proc.pid}")
    for node_id, d in pool.nodes.items():
        print(f"{node_id:9} {d.addr}   pid {d.proc.pid}   transport {_transport(pool, d)}   config {d.config}   "
              f"log {d.log_path}")
    nodes = list(pool.nodes.values())
    a = nodes[0].addr
    print(f"\ntry:  {QUILLCTL} cluster --addr {a}")
    print(f"      echo hello > /tmp/b; {QUILLCTL} put --addr {a} -m demo -p p0 -b b0 /tmp/b")
    for d in nodes[1:]:
        print(f"      {QUILLCTL} get --addr {d.addr} -m demo -p p0 -b b0")
    print(f"      {QUILLCTL} locate --addr {a} -m demo -p p0 -b b0")
    if len(nodes) > 1:
        print(f"failure detection: kill -9 {nodes[-1].proc.pid}   (then `{QUILLCTL} cluster --addr {a}` "
              f"after {LEASE_TTL}, and read the block again)")
    print(f"(node-to-node credential: {CREDENTIAL}; Ctrl-C stops the pool)", flush=True)


def _watch(etcd: EtcdServer, pool: Pool, stop: list[int]) -> None:
    """Until a stop signal: report each process that ends, keep the others serving."""
    reported: set[str] = set()
    shm: dict[str, set[str]] = {}      # each live node's UCX segments, as last seen (``ucxshm``)
    while True:
        time.sleep(POLL_S)
        if stop:
            return
        for name, proc, log, _ in _processes(etcd, pool):
            if name in reported:
                continue
            if proc.poll() is None:
                if name != "etcd":
                    shm[name] = ucxshm.segments(proc.pid)
                continue
            reported.add(name)
            ucxshm.reap(shm.pop(name, set()))    # a node killed with SIGKILL never unlinks its own
            alive = [k for k, d in pool.nodes.items() if d.proc.poll() is None]
            print(f"make cluster: {name} (pid {proc.pid}) {_how(proc.returncode)}; see {log}", flush=True)
            if name == "etcd":
                print("make cluster: without etcd the nodes keep serving what they hold but see no "
                      "membership change; Ctrl-C stops the rest", flush=True)
            elif alive:
                addr = pool.nodes[alive[0]].addr
                print(f"make cluster: {', '.join(alive)} keep serving; {name}'s lease expires within "
                      f"{LEASE_TTL}: watch `{QUILLCTL} cluster --addr {addr}`", flush=True)
            else:
                print("make cluster: no node is left; Ctrl-C stops etcd", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
