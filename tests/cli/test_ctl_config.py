"""quillctl config / quillcached config errors, run as real processes."""
import subprocess
import sys
from pathlib import Path


BIN = Path(sys.executable).parent


def run(args, **kw):
    return subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True, timeout=60, **kw)


def test_sample_piped_into_check_exits_zero():
    sample = run(["quillctl", "config", "sample"])
    assert sample.returncode == 0 and "[store]" in sample.stdout
    check = run(["quillctl", "config", "check", "-"], input=sample.stdout)
    assert check.returncode == 0, check.stderr


def test_check_of_bad_dram_exits_78_naming_section_key_and_value(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[store]\ndram = "12Q"\n')
    r = run(["quillctl", "config", "check", str(bad)])
    assert r.returncode == 78
    assert "[store] dram" in r.stderr and "12Q" in r.stderr


def test_daemon_with_bad_config_exits_78_without_traceback(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[store]\ndram = "12Q"\n')
    r = run(["quillcached", "--config", str(bad)])
    assert r.returncode == 78
    assert "[store] dram" in r.stderr and "12Q" in r.stderr and "Traceback" not in r.stderr


def test_missing_config_file_exits_78(tmp_path):
    r = run(["quillcached", "--config", str(tmp_path / "nope.toml")])
    assert r.returncode == 78 and "cannot read" in r.stderr


def test_hash_token_matches_library():
    from quillcache.settings.convert import hash_token
    r = run(["quillctl", "auth", "hash-token", "abc"])
    assert r.returncode == 0 and r.stdout.strip() == hash_token("abc")
    for args in (["-"], []):                       # "-" and no argument both read stdin
        r = run(["quillctl", "auth", "hash-token", *args], input="abc\n")
        assert r.returncode == 0 and r.stdout.strip() == hash_token("abc")
