"""asv's discovery of the suites (asv.conf.json's ``benchmark_dir``, bench/suites/): ``asv check``
on this interpreter, as ``make bench`` runs it, so that a module that breaks discovery fails
``make test`` instead of the performance history weeks later (issue 27)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from quillcache.protocol.route import POLICIES

ROOT = Path(__file__).resolve().parent.parent
CONF = json.loads((ROOT / "asv.conf.json").read_text())
SUITES = ROOT / CONF["benchmark_dir"]
CHECK_TIMEOUT_S = 120


def _env() -> dict:
    # the suites import bench.* and tests._support by absolute name; asv hands the environment on
    # (asv drops PYTHONPATH from the benchmarks' environment unless ASV_PYTHONPATH names it)
    path = [str(ROOT / "src"), str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path), ASV_PYTHONPATH=os.pathsep.join(path))


def _require_asv() -> None:
    try:
        import asv  # noqa: F401
    except ImportError:
        pytest.fail("asv is not installed in this interpreter: it is in the `test` extra (pip install -e '.[test]')")


def _asv(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    _require_asv()
    return subprocess.run([sys.executable, "-m", "asv", *args], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=CHECK_TIMEOUT_S)


def _check(conf: Path) -> subprocess.CompletedProcess:
    return _asv("check", "--config", str(conf), "-E", f"existing:{sys.executable}", cwd=conf.parent)


def test_benchmark_dir_holds_only_the_suites():
    # a standalone script (one that may import torch at module level) lives in bench/, never here
    assert SUITES == ROOT / "bench" / "suites"
    modules = sorted(p.name for p in SUITES.glob("*.py"))
    assert modules and all(m.startswith(("suite_", "_")) for m in modules), modules
    assert not [p for p in SUITES.iterdir() if p.is_dir() and p.name != "__pycache__"]


def test_asv_check_passes_on_the_suites():
    r = _check(ROOT / "asv.conf.json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "No problems found" in r.stdout


def test_asv_check_fails_on_a_suite_that_breaks_discovery(tmp_path):
    copy = tmp_path / "suites"
    shutil.copytree(SUITES, copy, ignore=shutil.ignore_patterns("__pycache__"))
    conf = tmp_path / "asv.conf.json"
    conf.write_text(json.dumps({**CONF, "repo": str(ROOT), "benchmark_dir": str(copy),
                                "env_dir": str(tmp_path / "env"), "results_dir": str(tmp_path / "results"),
                                "html_dir": str(tmp_path / "html")}))
    good = _check(conf)
    assert good.returncode == 0, good.stdout + good.stderr      # the copy itself is fine
    # what bench/lmcache_plugin.py did to the whole history: an engine imported at module level
    (copy / "suite_broken.py").write_text("import quillcache_engine_not_installed  # noqa: F401\n\n\n"
                                          "class Broken:\n    def time_nothing(self):\n        pass\n")
    bad = _check(conf)
    out = bad.stdout + bad.stderr
    assert bad.returncode != 0, out
    assert "suite_broken" in out and "No module named 'quillcache_engine_not_installed'" in out, out


def test_every_hot_path_suite_is_discovered(tmp_path):
    _require_asv()
    from asv.runner import BENCHMARK_RUN_SCRIPT

    out = tmp_path / "discovered.json"
    r = subprocess.run([sys.executable, BENCHMARK_RUN_SCRIPT, "discover", str(SUITES), str(out)], cwd=tmp_path,
                       env=_env(), capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    assert r.returncode == 0, r.stdout + r.stderr
    found = {b["name"]: b for b in json.loads(out.read_text())}
    wanted = [
        "suite_client.Located.time_located_get_release_64", "suite_client.Located.time_reserve_commit_64",
        "suite_client.BytesGet.time_get", "suite_client.BytesGet.time_get_into",
        "suite_control.Indexer.time_ingest", "suite_control.Indexer.time_find_matches_100",
        "suite_control.Router.time_route_and_free_100", "suite_control.Gateway.time_decide_100",
        "suite_cluster.CrossNodeGet.time_get_via_second_node", "suite_cluster.CrossNodeGet.time_get_at_holder",
        "suite_connector.ConnectorCoreIO.time_load", "suite_connector.ConnectorCoreIO.time_save",
        # round 1's suites are still there (their names are the history's keys)
        "suite_alloc.CdefPairs.time_pairs", "suite_art.ArtTree.time_get_many_hit",
        "suite_codec.SmallFrames.time_parse_20k_get_frames", "suite_store.StoreGet.time_get_release_hits",
        "suite_wal.WalAppend.time_append",
        # round 3: the node's key cache with more keys in use than it holds; a put into a full DRAM tier
        "suite_codec.KeyCacheMisses.time_decode_32k_misses", "suite_store.StorePut.time_put_evicting",
    ]
    assert [n for n in wanted if n not in found] == []
    # one router decision per policy on the wire: a policy added to POLICIES is timed too
    assert found["suite_control.Router.time_route_and_free_100"]["params"] == [[repr(p) for p in POLICIES]]
    assert found["suite_client.BytesGet.time_get"]["params"][0] == ["'tcp'", "'unix'"]
