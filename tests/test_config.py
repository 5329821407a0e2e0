"""The settings registry, TOML validation and the sample config."""
from pathlib import Path

import pytest

from quillcache.node.settings import SETTINGS, ConfigError, load_config, render_sample
from quillcache.settings.convert import format_byte_size, hash_token, parse_byte_size, parse_duration
from quillcache.net import parse_hostport

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_load_and_convert():
    cfg = load_config()
    assert cfg.node.listen == ("127.0.0.1", 7470)
    assert cfg.metrics.listen == ("127.0.0.1", 7471)
    assert cfg.store.dram == 1 << 30
    assert cfg.wal.commit_window == pytest.approx(0.001)
    assert cfg.guard.mode == "strict"
    assert cfg.auth.tenants == ()


@pytest.mark.parametrize("text,value", [
    ("4GiB", 4 << 30), ("512MiB", 512 << 20), ("64k", 64000), ("1.5GiB", 3 << 29), ("123", 123), ("1 KiB", 1024),
])
def test_byte_sizes(text, value):
    assert parse_byte_size(text) == value


@pytest.mark.parametrize("text,value", [("200ms", 0.2), ("10s", 10.0), ("1.5m", 90.0), ("500us", 0.0005)])
def test_durations(text, value):
    assert parse_duration(text) == pytest.approx(value)


def test_hostports():
    assert parse_hostport("[::1]:80") == ("::1", 80)
    assert parse_hostport("localhost:1") == ("localhost", 1)
    for bad in ("localhost", "1.2.3.4:99999", "[zz]:1", 7470):
        with pytest.raises(ValueError):
            parse_hostport(bad)


def write(tmp_path, text):
    p = tmp_path / "quillcache.toml"
    p.write_text(text)
    return str(p)


def test_bad_value_names_file_section_key_value_and_example(tmp_path):
    path = write(tmp_path, '[store]\ndram = "12Q"\n')
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert str(exc.value) == f'{path}: [store] dram = "12Q": not a byte size (e.g. "4GiB")'


@pytest.mark.parametrize("text,fragment", [
    ('[store]\ndramm = "1GiB"\n', "[store] unknown key 'dramm' (did you mean 'dram'?)"),
    ('[stor]\ndram = "1GiB"\n', "unknown section [stor] (did you mean 'store'?)"),
    ('[node]\ndram = "1GiB"\n', "[node] unknown key 'dram' (it belongs in [store])"),
    ('[guard]\nmode = "lenient"\n', '[guard] mode = "lenient": not one of "strict", "tenant", "off"'),
    ('[store]\nlow_watermark = 0.95\n', "low_watermark = 0.95: must be below high_watermark"),
    ('[store]\ndram = "8GiB"\nmax_block = "3GiB"\n', '[store] max_block = "3GiB": out of range 1..2GiB'),
    ('[node]\nlisten = "nowhere"\n', '[node] listen = "nowhere": not a host:port'),
    ('[auth]\ntenants = [{name = "a", token = "plain"}]\n', "plain tokens are refused"),
    ('[store\n', "not valid TOML"),
    ('[cluster]\nenabled = true\ncredential = "0123456789abcdef"\nnode_id = "a@1"\n',
     '[cluster] node_id = "a@1": no "@" in a node id'),
    ('[cluster]\nenabled = true\ncredential = "short"\n', "[cluster] credential: needs at least 16 characters"),
    ('[cluster]\netcd = ["https://e:2379"]\n', "TLS to etcd is not supported"),
    ('[cluster]\netcd = ["e:notaport"]\n', "'e:notaport': not a host:port"),
    ('[cluster]\netcd = []\n', "not a list of host:port"),
])
def test_invalid_configs_are_refused_with_specific_messages(tmp_path, text, fragment):
    with pytest.raises(ConfigError) as exc:
        load_config(write(tmp_path, text))
    assert fragment in str(exc.value)


def test_tenants_with_hashed_tokens_are_accepted(tmp_path):
    token = hash_token("s3cret")
    cfg = load_config(write(tmp_path, f'[[auth.tenants]]\nname = "acme"\ntoken = "{token}"\n'))
    assert cfg.auth.tenants == (("acme", token, False, (), None),)
    assert cfg.auth.tenants[0].pin_bytes is None


def test_a_tenant_pin_quota_is_a_byte_size(tmp_path):
    token = hash_token("s3cret")
    cfg = load_config(write(tmp_path, f'[[auth.tenants]]\nname = "acme"\ntoken = "{token}"\npin_bytes = "1MiB"\n'))
    assert cfg.auth.tenants[0].pin_bytes == 1 << 20
    with pytest.raises(ConfigError, match="pin_bytes"):
        load_config(write(tmp_path, f'[[auth.tenants]]\nname = "acme"\ntoken = "{token}"\npin_bytes = "lots"\n'))


def test_sample_loads_and_equals_every_default():
    cfg = load_config(text=render_sample())
    defaults = load_config()
    for setting in SETTINGS:
        assert cfg.get(setting.qualname) == defaults.get(setting.qualname), setting.qualname
        assert f"\n{setting.name} = " in render_sample()


def test_conf_sample_file_is_the_generated_sample():
    assert (ROOT / "conf" / "quillcache.toml").read_text() == render_sample()


def test_reloadable_changes_split_reloadable_from_fixed():
    a = load_config()
    b = a.with_overrides({"guard.mode": "tenant", "store.dram": "2GiB"})
    apply, fixed = a.reloadable_changes(b)
    assert apply == {"guard.mode": "tenant"} and fixed == ["store.dram"]


def test_format_byte_size_round_trips():
    for n in (1, 1024, 3 << 20, 5 << 30):
        assert parse_byte_size(format_byte_size(n)) == n


@pytest.mark.parametrize("value,want", [
    ('["127.0.0.1:2379"]', (("127.0.0.1", 2379),)),
    ('["http://10.0.0.1:2379/", "http://10.0.0.2:2379"]', (("10.0.0.1", 2379), ("10.0.0.2", 2379))),
    ('"e1:2379,e2:2380"', (("e1", 2379), ("e2", 2380))),          # as etcdctl --endpoints writes them
    ('["etcd-0"]', (("etcd-0", 2379),)),                          # etcd's client port
    ('["[::1]", "[::1]:3000"]', (("::1", 2379), ("::1", 3000))),
])
def test_etcd_endpoints_are_read_as_etcds_own_tools_write_them(tmp_path, value, want):
    assert load_config(write(tmp_path, f"[cluster]\netcd = {value}\n")).cluster.etcd == want
