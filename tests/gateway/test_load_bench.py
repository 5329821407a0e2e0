"""bench/gateway_load.py at a tiny size, so that it cannot rot (real engine and gateway
processes on loopback), and the process handling it shares with bench/gateway_replay.py
(bench/_serve.py): logs kept only when asked or when a run fails, a dead process named."""
import asyncio
import json
import sys
import tempfile

import aiohttp
import pytest

from bench import gateway_load
from bench._serve import Processes, scratch


def test_both_phases_run_and_leave_nothing_behind(tmp_path, capsys, monkeypatch):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = tmp_path / "load.json"
    assert gateway_load.main(["--clients", "2", "--seconds", "1", "--json-out", str(out)]) == 0
    doc = json.loads(out.read_text())
    for phase in ("direct", "gateway"):
        assert doc[phase]["requests"] > 0 and doc[phase]["errors"] == 0
        assert doc[phase]["ttft_p50_ms"] > 0
    assert doc["gateway_alive_at_end"] is True
    assert doc["gateway_rss_mib"]["peak"] >= doc["gateway_rss_mib"]["start"] > 0
    each = doc["gateway_rss_mib_each_second"]      # sampled each second: a leak shows as a slope
    assert len(each) >= 2 and max(each) == round(doc["gateway_rss_mib"]["peak"], 1)
    assert "| through the gateway |" in capsys.readouterr().out
    assert list(scratch.iterdir()) == []          # a clean run removes its logs


@pytest.mark.parametrize("argv", [["--clients", "0"], ["--seconds", "0"], ["--engines", "0"]])
def test_bad_arguments_are_a_usage_error(argv):
    with pytest.raises(SystemExit) as e:
        gateway_load.main(argv)
    assert e.value.code == 2


def test_logs_are_removed_unless_kept(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for keep in (False, True):
        procs = Processes("qc-test-", "a bench")
        procs.spawn([sys.executable, "-c", "print('engine says hello')"], "engine-0").wait(timeout=30)
        procs.stop(keep=keep)
        assert procs.tmp.exists() is keep
        assert all(log.closed for log in procs.logs)
    assert (procs.tmp / "engine-0.log").read_text() == "engine says hello\n"
    assert f"a bench: logs are in {procs.tmp}" in capsys.readouterr().err


@pytest.mark.parametrize("code, name, timeout_s, said, logged", [
    ("import sys; print('bad flag'); sys.exit(3)", "engine-0", 30.0, "exited with 3", "bad flag\n"),
    ("import time; time.sleep(60)", "gateway", 0.3, "did not answer http://127.0.0.1:9/health in 0s", ""),
])
def test_a_process_that_does_not_answer_is_named_with_its_log(tmp_path, monkeypatch, code, name, timeout_s, said,
                                                               logged):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    procs = Processes("qc-test-", "a bench")
    proc = procs.spawn([sys.executable, "-c", code], name)

    async def wait() -> None:
        async with aiohttp.ClientSession() as s:
            await procs.wait_http(s, "http://127.0.0.1:9/health", proc, name, timeout_s=timeout_s)

    with pytest.raises(SystemExit) as e:
        asyncio.run(wait())
    assert str(e.value) == f"a bench: {name} {said} (log: {procs.tmp / name}.log)"
    assert (procs.tmp / f"{name}.log").read_text() == logged      # the log it names holds the output
    procs.stop(keep=False)
    assert proc.poll() is not None and not procs.tmp.exists()


def test_a_scratch_folder_goes_when_the_run_ends_well_and_stays_when_it_raises(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with scratch("qc-test-", "a bench") as tmp:
        (tmp / "etcd.log").write_text("fine")
    assert not tmp.exists()
    with pytest.raises(ValueError):
        with scratch("qc-test-", "a bench") as tmp:
            (tmp / "etcd.log").write_text("what went wrong")
            raise ValueError("the bench failed")
    assert (tmp / "etcd.log").read_text() == "what went wrong"
    assert f"a bench: logs are in {tmp}" in capsys.readouterr().err
