"""quillctl against a real daemon process (free loopback ports, a tmp data dir), and
`quillctl wal verify` on logs written by the real WalWriter."""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quillcache._native.wal import WalReader, WalWriter, list_segments, lsn_offset
from quillcache_cli import exitcodes
from quillcache_cli.ctl_wal import CORRUPT
from tests._support.net import free_port

BIN = Path(sys.executable).parent
SCOPE = ["--model", "org/llama-3-8b", "--tokenizer", "llama3-tok", "--tenant", "default"]


def quillctl(*args, addr=None, input=None, env=None, timeout=60):
    cmd = [str(BIN / "quillctl")]
    if addr is not None:
        cmd += ["--addr", addr]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("QUILLCACHE_")}
    full_env.update(env or {})
    return subprocess.run([*cmd, *args], input=input, capture_output=True, timeout=timeout, env=full_env)


# --------------------------------------------------------------------------- wal verify

def _write_log(directory: Path, n: int = 100, size: int = 1000, segment_bytes: int = 65536) -> list[bytes]:
    directory.mkdir(parents=True, exist_ok=True)
    payloads = [bytes([i % 251]) * size + i.to_bytes(4, "little") for i in range(n)]
    with WalWriter(str(directory), segment_bytes=segment_bytes, backend="pwritev") as w:
        for p in payloads:
            w.append(p)
        w.commit()
    return payloads


def test_wal_verify_of_clean_dir_exits_zero_and_counts_every_record(tmp_path):
    _write_log(tmp_path / "wal", n=100)
    r = quillctl("wal", "verify", str(tmp_path), "--json")
    assert r.returncode == exitcodes.OK, r.stderr
    report = json.loads(r.stdout)
    assert report["clean"] is True and report["dropped_bytes"] == 0
    (log,) = report["logs"]
    assert log["records"] == 100
    assert log["payload_bytes"] == 100 * 1004
    assert len(log["segments"]) == len(list_segments(tmp_path / "wal")) >= 2
    human = quillctl("wal", "verify", str(tmp_path))
    assert human.returncode == 0 and b"100 record(s)" in human.stdout and b"clean" in human.stdout


def test_wal_verify_reports_checksum_mismatch_in_a_corrupted_segment(tmp_path):
    _write_log(tmp_path / "wal", n=100)
    first = tmp_path / "wal" / "000000000001.log"
    data = bytearray(first.read_bytes())
    data[5000] ^= 0xFF           # inside a record's payload in the first 32 KiB block
    first.write_bytes(bytes(data))
    r = quillctl("wal", "verify", str(tmp_path), "--json")
    assert r.returncode == CORRUPT == 65, r.stderr
    report = json.loads(r.stdout)
    assert report["clean"] is False
    (log,) = report["logs"]
    reasons = {d["reason"] for d in log["dropped"]}
    assert "checksum mismatch" in reasons
    bad = [d for d in log["dropped"] if d["reason"] == "checksum mismatch"][0]
    assert bad["segment"] == "000000000001.log"
    # the CRC failure drops the rest of that block (records after it in the block are lost)
    assert bad["offset"] < 5000 < bad["offset"] + bad["bytes"] <= 32768
    assert log["records"] < 100
    human = quillctl("wal", "verify", str(tmp_path))
    assert human.returncode == CORRUPT
    assert b"checksum mismatch" in human.stdout and b"CORRUPT" in human.stdout


def test_wal_verify_torn_tail_is_reported_but_not_corruption(tmp_path):
    _write_log(tmp_path / "wal", n=10)
    (seq, last), = list_segments(tmp_path / "wal")[-1:]
    size = os.path.getsize(last)
    os.truncate(last, size - 300)     # the writer died in the middle of the last record
    r = quillctl("wal", "verify", str(tmp_path), "--json")
    assert r.returncode == exitcodes.OK, r.stdout
    (log,) = json.loads(r.stdout)["logs"]
    assert log["records"] == 9
    assert log["tail_bytes"] == 1004 + 7 - 300
    assert log["dropped"] == []


def test_wal_verify_of_dir_without_log_exits_not_found(tmp_path):
    r = quillctl("wal", "verify", str(tmp_path))
    assert r.returncode == exitcodes.NOT_FOUND
    assert b"no WAL segments" in r.stderr and b"Traceback" not in r.stderr


def test_wal_verify_of_ssd_tier_checks_block_crcs_with_deep(tmp_path):
    from quillcache.model import KvBlockKey
    from quillcache.store.ssd import SsdTier
    tier = tmp_path / "tier"
    for reopen in range(2):          # the second open replays the WAL and writes a checkpoint
        t = SsdTier(str(tier), 16 << 20, direct_io=False)
        if not reopen:
            for i in range(6):
                t.put_sync(KvBlockKey("m", "t", None, "x", "p", f"b{i}", i), bytes([i + 1]) * 50_000)
        t.close_sync()
    r = quillctl("wal", "verify", "--deep", "--json", str(tmp_path))
    assert r.returncode == 0, r.stdout
    (ssd,) = json.loads(r.stdout)["ssd"]
    assert ssd["blocks"] == 6 and ssd["checkpoint_blocks"] == 6 and ssd["crc_failures"] == 0
    data = tier / "data.qc"
    raw = bytearray(data.read_bytes())
    raw[4096 * 13 + 5] ^= 0x01       # inside the second block (50 000 B = 13 units of 4 KiB each)
    data.write_bytes(bytes(raw))
    shallow = quillctl("wal", "verify", "--json", str(tmp_path))
    assert shallow.returncode == 0   # without --deep the block bytes are not read
    deep = quillctl("wal", "verify", "--deep", "--json", str(tmp_path))
    assert deep.returncode == CORRUPT
    (ssd,) = json.loads(deep.stdout)["ssd"]
    assert ssd["crc_failures"] == 1 and ssd["crc_failed_offsets"] == [4096 * 13]


def test_bench_pattern_detects_one_wrong_byte():
    from quillcache_cli.ctl_bench import Pattern
    p = Pattern(4096, seed=7)
    buf = bytearray(4096)
    p.fill(buf, key=3, version=2)
    assert p.check(buf, key=3, max_version=2)
    assert not p.check(buf, key=4, max_version=2)          # another key's block
    assert not p.check(buf, key=3, max_version=1)          # a version never sent
    buf[4000] ^= 0x10
    assert not p.check(buf, key=3, max_version=2)


# --------------------------------------------------------------------------- against a real daemon

class Node:
    def __init__(self, tmp: Path, extra: str = ""):
        self.port, mport = free_port(), free_port()
        self.data = tmp / "data"
        cfg = tmp / "quillcache.toml"
        cfg.write_text(f'[metrics]\nlisten = "127.0.0.1:{mport}"\n[store]\ndram = "128MiB"\n'
                       f'[ssd]\ncapacity = "32MiB"\n{extra}')
        self.log = open(tmp / "quillcached.log", "wb")
        self.proc = subprocess.Popen([str(BIN / "quillcached"), "--config", str(cfg), "--listen",
                                      f"127.0.0.1:{self.port}", "--data-dir", str(self.data)],
                                     stdout=self.log, stderr=self.log)
        self.addr = f"127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (tmp / "quillcached.log").read_text()
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("quillcached did not start")

    def ctl(self, *args, **kw):
        return quillctl(*args, addr=self.addr, **kw)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    n = Node(tmp_path_factory.mktemp("node"))
    yield n
    n.stop()


def test_put_then_get_round_trips_through_files(node, tmp_path):
    src = tmp_path / "block.bin"
    src.write_bytes(os.urandom(300_000))
    r = node.ctl("put", *SCOPE, "-p", "p1", "-b", "b1", str(src))
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out.bin"
    r = node.ctl("get", *SCOPE, "-p", "p1", "-b", "b1", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == src.read_bytes()


def test_put_from_stdin_and_get_to_stdout_with_keyfields_from_env(node):
    data = os.urandom(70_000) + b"\x00\r\n\xff"
    env = {"QUILLCACHE_MODEL": "org/llama-3-8b", "QUILLCACHE_TOKENIZER": "llama3-tok",
           "QUILLCACHE_ADAPTER": "lora/sql-v2"}
    r = node.ctl("put", "-p", "p2", "-b", "b/+=", "-i", "3", "--durable", "-", input=data, env=env)
    assert r.returncode == 0, r.stderr
    r = node.ctl("get", "-p", "p2", "-b", "b/+=", "-i", "3", env=env)
    assert r.returncode == 0 and r.stdout == data
    # the adapter is part of the key: the base model is refused the adapter's KV
    r = node.ctl("get", "-p", "p2", "-b", "b/+=", "-i", "3", env={**env, "QUILLCACHE_ADAPTER": ""})
    assert r.returncode == exitcodes.UNSAFE_REUSE and r.stdout == b""
    assert b"adapter" in r.stderr


def test_json_outputs_parse_and_ls_key_feeds_get(node):
    for i in (2, 0, 1):
        r = node.ctl("put", *SCOPE, "-p", "chain", "-b", f"blk{i}", "-i", str(i), "-", "--json",
                     input=bytes([i]) * 1000)
        assert r.returncode == 0
        assert json.loads(r.stdout)["stored"] == 1000
    r = node.ctl("--json", "ls", *SCOPE, "-p", "chain")
    keys = json.loads(r.stdout)["keys"]
    assert [k["block_hash"] for k in keys] == ["blk0", "blk1", "blk2"]      # key order: by index
    assert keys[0]["model"] == "org/llama-3-8b" and keys[0]["adapter"] is None
    r = node.ctl("get", "--key", keys[2]["key"])
    assert r.returncode == 0 and r.stdout == bytes([2]) * 1000
    human = node.ctl("ls", *SCOPE, "-p", "chain")
    assert human.returncode == 0 and b"3 key(s)" in human.stdout and b"blk1" in human.stdout
    stats = json.loads(node.ctl("stats", "--json").stdout)
    assert stats["store"]["entries"] >= 3
    ping = json.loads(node.ctl("ping", "--json").stdout)
    assert ping["ok"] is True and ping["rtt_ms"] > 0


def test_rm_removes_and_a_second_rm_or_get_exits_not_found(node):
    assert node.ctl("put", *SCOPE, "-p", "p3", "-b", "gone", "-", input=b"x" * 10).returncode == 0
    r = node.ctl("rm", *SCOPE, "-p", "p3", "-b", "gone", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["removed"] is True
    assert node.ctl("rm", *SCOPE, "-p", "p3", "-b", "gone").returncode == exitcodes.NOT_FOUND
    r = node.ctl("get", *SCOPE, "-p", "p3", "-b", "gone")
    assert r.returncode == exitcodes.NOT_FOUND and r.stdout == b""
    assert b"Traceback" not in r.stderr


def test_pin_and_unpin_report_and_missing_key_exits_not_found(node):
    assert node.ctl("put", *SCOPE, "-p", "p4", "-b", "pinned", "-", input=b"y" * 100).returncode == 0
    r = node.ctl("pin", *SCOPE, "-p", "p4", "-b", "pinned", "--ttl", "60s", "--hard", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {**json.loads(r.stdout), "pinned": True, "ttl_s": 60.0, "hard": True}
    assert node.ctl("unpin", *SCOPE, "-p", "p4", "-b", "pinned").returncode == 0
    assert node.ctl("pin", *SCOPE, "-p", "p4", "-b", "nope", "--ttl", "5s").returncode == exitcodes.NOT_FOUND
    bad = node.ctl("pin", *SCOPE, "-p", "p4", "-b", "pinned", "--ttl", "8d")
    assert bad.returncode == exitcodes.USAGE


def test_info_prints_sections_as_the_node_sends_them(node):
    r = node.ctl("info")
    assert r.returncode == 0
    text = r.stdout.decode()
    for section in ("# Server", "# Store", "# Tiers", "# WAL"):
        assert section in text
    assert "mode:open" in text
    one = node.ctl("info", "server").stdout.decode()
    assert one.startswith("# Server") and "# Store" not in one


def test_bench_runs_for_a_second_and_verifies_every_read(node):
    r = node.ctl("bench", "--duration", "1s", "--block-size", "64KiB", "--concurrency", "4",
                 "--mix", "0.3", "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["verify_failures"] == 0 and out["errors"] == {}
    assert out["get_ops"] > 0 and out["put_ops"] > 0
    assert out["ops_per_s"] > 0 and out["mb_per_s"] > 0 and out["get_p99_ms"] >= out["get_p50_ms"]
    assert b"\r" not in r.stderr          # no progress bar when not a terminal


def test_usage_errors_exit_2_and_change_nothing(node):
    r = node.ctl("get", *SCOPE, "-b", "x")               # no --prefix-hash
    assert r.returncode == exitcodes.USAGE and b"--prefix-hash" in r.stderr
    r = node.ctl("put", "-p", "p", "-b", "b", "-", input=b"z")   # no model anywhere
    assert r.returncode == exitcodes.USAGE and b"--model" in r.stderr
    r = node.ctl("put", *SCOPE, "-p", "p", "-b", "b", "-", input=b"")
    assert r.returncode == exitcodes.USAGE and b"empty" in r.stderr
    assert node.ctl("get", *SCOPE, "-p", "p", "-b", "b").returncode == exitcodes.NOT_FOUND


def test_unreachable_node_exits_unavailable_with_a_clear_message():
    dead = f"127.0.0.1:{free_port()}"
    for args in (("ping",), ("get", *SCOPE, "-p", "p", "-b", "b"), ("info",)):
        r = quillctl(*args, addr=dead)
        assert r.returncode == exitcodes.UNAVAILABLE
        assert b"cannot connect" in r.stderr and b"Traceback" not in r.stderr


def test_wal_verify_of_a_stopped_node_dir_clean_then_corrupt(tmp_path):
    n = Node(tmp_path)
    try:
        for i in range(5):
            r = n.ctl("put", *SCOPE, "-p", "d", "-b", f"b{i}", "--durable", "-", input=bytes([i]) * 20_000)
            assert r.returncode == 0, r.stderr
    finally:
        n.stop()
    r = quillctl("wal", "verify", "--deep", "--json", str(n.data))
    assert r.returncode == 0, r.stdout
    report = json.loads(r.stdout)
    assert report["clean"] and sum(log["records"] for log in report["logs"]) >= 1
    (ssd,) = report["ssd"]
    assert ssd["blocks"] == 5 and ssd["crc_failures"] == 0
    (seq, seg), = list_segments(n.data / "wal")[:1]
    lsn, payload = next(iter(WalReader(seg)))
    raw = bytearray(Path(seg).read_bytes())
    raw[lsn_offset(lsn) - 2] ^= 0xFF      # the last payload bytes of the first record
    Path(seg).write_bytes(bytes(raw))
    r = quillctl("wal", "verify", str(n.data))
    assert r.returncode == CORRUPT
    assert b"checksum mismatch" in r.stdout and b"CORRUPT" in r.stdout


def test_token_binds_the_tenant_and_a_bad_token_exits_permission(tmp_path):
    from quillcache.settings.convert import hash_token
    n = Node(tmp_path, f'[[auth.tenants]]\nname = "acme"\ntoken = "{hash_token("s3cret")}"\n')
    try:
        env = {"QUILLCACHE_TOKEN": "s3cret", "QUILLCACHE_MODEL": "m"}
        r = n.ctl("put", "-p", "p", "-b", "b", "--json", "-", input=b"t" * 100, env=env)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["tenant"] == "acme"          # the default: the token's tenant
        r = n.ctl("get", "-p", "p", "-b", "b", "--tenant", "other", env=env)
        assert r.returncode == exitcodes.PERMISSION             # another tenant's key space
        r = n.ctl("get", "-p", "p", "-b", "b", env={**env, "QUILLCACHE_TOKEN": "wrong"})
        assert r.returncode == exitcodes.PERMISSION and b"Traceback" not in r.stderr
        assert b"refused the token" in r.stderr
        r = n.ctl("ping", env={})                                # no token at all: say what is missing
        assert r.returncode == exitcodes.PERMISSION and b"needs a token (--token or QUILLCACHE_TOKEN)" in r.stderr
    finally:
        n.stop()


def test_cli_durations_take_units_or_bare_seconds():
    import click

    from quillcache_cli.params import cli_duration
    assert cli_duration("2") == 2.0 and cli_duration("1.5") == 1.5
    assert cli_duration("200ms") == pytest.approx(0.2) and cli_duration("2m") == 120.0
    with pytest.raises(click.BadParameter, match="bare number means seconds"):
        cli_duration("soon")
