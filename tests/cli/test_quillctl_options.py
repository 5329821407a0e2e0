"""quillctl as a newcomer types it: options after the command, one --addr everywhere (the
gateway's too), exit 2 with a clear message for bad usage, and the gateway's config file
understood by `quillctl config check` and printed by `quillcache-gateway config sample`."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from quillcache_cli import exitcodes
from tests._support.daemon import Daemon
from tests._support.net import free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run(*args, prog="quillctl", stdin=None):
    return subprocess.run([str(BIN / prog), *args], capture_output=True, text=True, timeout=60, input=stdin)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with Daemon(tmp_path_factory.mktemp("opts")) as d:
        yield d


def test_connection_options_work_before_and_after_the_command(node, tmp_path):
    assert run("--addr", node.addr, "ping").stdout.startswith("PONG")
    assert run("ping", "--addr", node.addr).stdout.startswith("PONG")
    assert run("ping", "--addr", f"unix:{node.data_dir / 'quillcached.sock'}", "--timeout", "5").returncode == 0
    r = run("info", "server", "--addr", node.addr, "--json")
    assert r.returncode == 0 and '"listen"' in r.stdout
    # after the command wins over before it (the nearest one)
    r = run("--addr", f"127.0.0.1:{free_port()}", "ping", "--addr", node.addr)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("addr", ["127.0.0.1", "1.2.3", "host:99999", "unix:", "[::1:7470"])
def test_a_malformed_addr_is_bad_usage_exit_2_before_or_after(addr):
    for argv in (("--addr", addr, "ping"), ("ping", "--addr", addr)):
        r = run(*argv)
        assert r.returncode == exitcodes.USAGE == 2, (argv, r.stderr)
        assert "Invalid value for '--addr'" in r.stderr and "127.0.0.1:7470" in r.stderr


def test_a_bad_key_says_what_a_good_one_is(node):
    r = run("get", "--addr", node.addr, "--key", "zz", "-o", "/dev/null")
    assert r.returncode == 2
    assert "--key 'zz': not hex" in r.stderr and "fromhex" not in r.stderr and "ls --json" in r.stderr
    r = run("get", "--addr", node.addr, "--key", "00ff", "-o", "/dev/null")
    assert r.returncode == 2 and "not an encoded key" in r.stderr


def test_quillctl_gateway_takes_addr_as_its_one_address_option():
    port = free_port()                           # nothing listens: each form names the same URL
    for argv in (("gateway", "--addr", f"127.0.0.1:{port}"), ("gateway", "--addr", f"http://127.0.0.1:{port}"),
                 ("gateway", "--url", f"http://127.0.0.1:{port}"), ("--addr", f"127.0.0.1:{port}", "gateway")):
        r = run(*argv)
        assert r.returncode == exitcodes.UNAVAILABLE, (argv, r.stderr)
        assert f"cannot reach the gateway at http://127.0.0.1:{port}" in r.stderr, (argv, r.stderr)
    r = run("gateway", "--addr", "not a url")
    assert r.returncode == 2 and "not a gateway address" in r.stderr


def test_config_check_understands_the_gateway_file_and_the_gateway_prints_its_sample(tmp_path):
    r = run("config", "check", str(ROOT / "conf" / "gateway.toml"))
    assert r.returncode == 0 and "ok (gateway configuration)" in r.stdout, r.stderr
    r = run("config", "check", str(ROOT / "conf" / "quillcache.toml"))
    assert r.returncode == 0 and "ok (node configuration)" in r.stdout
    sample = run("config", "sample", prog="quillcache-gateway")
    assert sample.returncode == 0 and "[gateway]" in sample.stdout and "[router]" in sample.stdout
    r = run("config", "check", "-", stdin=sample.stdout)
    assert r.returncode == 0 and "<stdin>: ok (gateway configuration)" in r.stdout
    r = run("config", "check", "-", stdin='[gateway]\nlisten = "nowhere"\n')
    assert r.returncode == exitcodes.CONFIG and '[gateway] listen = "nowhere"' in r.stderr
    r = run("--help", prog="quillcache-gateway")
    assert "quillcache-gateway config sample" in r.stdout


def test_ls_pool_on_a_node_outside_a_pool_lists_its_own_blocks_and_says_so(node, tmp_path):
    f = tmp_path / "blk"
    f.write_bytes(b"x" * 10)
    assert run("put", "--addr", node.addr, "-m", "solo", "-p", "p", "-b", "b1", str(f)).returncode == 0
    r = run("ls", "--addr", node.addr, "-m", "solo", "-p", "p", "--pool")
    assert r.returncode == 0, r.stderr
    assert "1 key(s) in the pool" in r.stdout and "not in a pool" in r.stdout and "(this node)" in r.stdout


def test_token_after_the_command_reaches_a_node_with_auth_on(tmp_path):
    from tests._support.engine_node import EngineNode
    with EngineNode(tmp_path) as d:
        r = run("ping", "--addr", d.addr)
        assert r.returncode == exitcodes.PERMISSION and "needs a token" in r.stderr
        assert run("ping", "--addr", d.addr, "--token", d.token).stdout.startswith("PONG")
        assert run("--token", d.token, "ping", "--addr", d.unix).stdout.startswith("PONG")
        r = run("ping", "--addr", d.addr, "--token", "wrong")
        assert r.returncode == exitcodes.PERMISSION and "refused the token" in r.stderr
