"""quillctl cluster and quillctl locate against a real pool (etcd and three nodes)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quillcache import Client
from quillcache.cluster.hrw import Ring, key_hash
from quillcache.model import encode_key
from quillcache_cli import exitcodes
from tests._support.cluster import Pool, content, key
from tests._support.etcd import EtcdServer, etcd_binary

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="etcd not installed (Debian etcd-server)")

BIN = Path(sys.executable).parent


def quillctl(addr: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUILLCACHE_")}
    return subprocess.run([str(BIN / "quillctl"), "--addr", addr, *args], capture_output=True, timeout=60,
                          env=env, text=True)


def test_cluster_lists_the_members_and_locate_names_home_order_and_holders(tmp_path):
    with EtcdServer(tmp_path / "etcd") as etcd, Pool(tmp_path, etcd.endpoint, 3, lease_ttl="2s") as pool:
        pool.wait_members(3)
        k = key(7)
        with Client(pool["a"].addr) as a:
            a.put(k, content(7, 1000))
        r = quillctl(pool["b"].addr, "cluster", "--json")
        assert r.returncode == exitcodes.OK, r.stderr
        view = json.loads(r.stdout)
        assert view["node_id"] == "node-b" and view["state"] == "ok"
        assert {m["node_id"] for m in view["members"] if m["state"] == "up"} == {"node-a", "node-b", "node-c"}
        assert all(len(m["epoch"]) > 0 and m["free"] > 0 for m in view["members"])
        human = quillctl(pool["b"].addr, "cluster")
        assert human.returncode == 0 and "* node-b" in human.stdout and "state ok" in human.stdout
        order = Ring(["node-a", "node-b", "node-c"]).order(key_hash(encode_key(k)))
        fields = ["--model", k.model_id, "--tokenizer", k.tokenizer_id, "--tenant", k.tenant_id,
                  "--prefix-hash", k.prefix_hash, "--block-hash", k.block_hash, "--tokens", str(k.token_count)]
        deadline = time.monotonic() + 3
        while True:                                         # the record reaches the home in ms
            r = quillctl(pool["c"].addr, "locate", *fields, "--json")
            assert r.returncode == exitcodes.OK, r.stderr
            found = json.loads(r.stdout)
            if found["holders"] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert found["key"] == encode_key(k).hex()
        assert found["home"] == order[0] and found["order"] == order and found["holders"] == ["node-a"]
        human = quillctl(pool["c"].addr, "locate", *fields)
        assert human.returncode == 0 and f"home     {order[0]}" in human.stdout
        assert "holders  node-a" in human.stdout
