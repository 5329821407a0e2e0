"""Client steps run inside a network namespace by the netns tests (``ip netns exec``):
each prints one JSON line.

    python -m tests._support.netns_client put ADDR N SIZE
    python -m tests._support.netns_client get ADDR N SIZE
    python -m tests._support.netns_client members ADDR COUNT TIMEOUT     (wait for COUNT up)
    python -m tests._support.netns_client gone ADDR NODE TIMEOUT         (wait for NODE to leave)
    python -m tests._support.netns_client epoch ADDR NODE
"""
from __future__ import annotations

import json
import sys
import time

from quillcache import Client
from quillcache.errors import NotFound, QuillCacheError
from quillcache.model import KvBlockKey
from tests._support.cluster import cluster_view


def key(i: int) -> KvBlockKey:
    return KvBlockKey("m", "tok", None, "t0", f"p{i // 8}", f"nb{i}")


def content(i: int, size: int) -> bytes:
    return (f"netns-{i}-".encode() + bytes(range(256)) * (size // 256 + 1))[:size]


def up(addr: str) -> dict:
    return {m["node_id"]: m for m in cluster_view(addr)["members"] if m["state"] == "up"}


def main(argv: list[str]) -> int:
    op, addr = argv[0], argv[1]
    out: dict = {}
    if op == "put":
        n, size = int(argv[2]), int(argv[3])
        with Client(addr) as c:
            for i in range(n):
                c.put(key(i), content(i, size))
        out = {"put": n}
    elif op == "get":
        n, size = int(argv[2]), int(argv[3])
        hits = misses = wrong = errors = 0
        slowest = 0.0
        with Client(addr, timeout=5.0) as c:
            for i in range(n):
                t0 = time.monotonic()
                try:
                    if c.get(key(i)) == content(i, size):
                        hits += 1
                    else:
                        wrong += 1
                except NotFound:
                    misses += 1
                except QuillCacheError:
                    errors += 1
                slowest = max(slowest, time.monotonic() - t0)
        out = {"hits": hits, "misses": misses, "wrong": wrong, "errors": errors, "slowest_s": slowest}
    elif op in ("members", "gone"):
        deadline = time.monotonic() + float(argv[3])
        t0 = time.monotonic()
        ok = False
        while time.monotonic() < deadline:
            try:
                view = up(addr)
                ok = len(view) == int(argv[2]) if op == "members" else argv[2] not in view
            except QuillCacheError:
                ok = False
            if ok:
                break
            time.sleep(0.02)
        out = {"ok": ok, "seconds": time.monotonic() - t0}
    elif op == "epoch":
        out = {"epoch": up(addr).get(argv[2], {}).get("epoch")}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
