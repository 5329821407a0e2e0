"""The benches measure what they say.  ``bench/local_path.py`` times the sides it compares under
the same conditions: each is called once untimed before any is timed (the first writer of fresh
arena pages pays their faults), and the rounds rotate the order, so no side always follows the
same one.  ``bench/router_decision.py --branch-points`` does meet the shared-prefix rule, and
``bench/router_predict.py`` says when it had nothing to compare.  A bench asked to write where
it cannot says so before it runs, not after."""
from __future__ import annotations

import time

import pytest

import quillcache.control.policies as policies
from bench import local_path, router_decision


def test_interleaved_warms_every_side_then_rotates_the_order():
    calls: list[str] = []
    checked: list[str] = []
    sides = {n: (lambda n=n: calls.append(n)) for n in ("a", "b", "c")}
    medians = local_path._interleaved(sides, 4, after=checked.append)
    assert calls[:3] == ["a", "b", "c"]                    # one untimed call each, first
    rounds = [calls[3 + 3 * r: 6 + 3 * r] for r in range(4)]
    assert rounds == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert checked == calls                                # the check follows every call
    assert set(medians) == {"a", "b", "c"} and all(v >= 0.0 for v in medians.values())


def test_interleaved_times_each_side_by_itself():
    sides = {"slow": lambda: time.sleep(0.05), "fast": lambda: None}
    medians = local_path._interleaved(sides, 3)
    assert medians["slow"] >= 0.05 > medians["fast"]


def test_router_decision_branch_points_make_every_pooled_decision_predict_twice(monkeypatch):
    """``bench/router_decision.py --branch-points`` measures ``predict_placement``'s worst case:
    every decision whose prefix is on a device and in the pool (the chains the bench's pool node
    holds) meets a branch point and predicts twice; without the flag none does."""
    calls = []
    real = policies.predict_ttft
    monkeypatch.setattr(policies, "predict_ttft", lambda *a, **k: calls.append(1) or real(*a, **k))
    r, chains = router_decision.build(128 * 64, 8, 0)
    for flag in (False, True):
        calls.clear()
        out = router_decision.measure(r, chains, 200, "quillcache", 1, flag)
        assert len(out) == 200 and (out > 0).all()
        twice = len(calls) - 200
        if flag:
            assert 25 <= twice <= 75             # a quarter of the chains are in the pool
        else:
            assert twice == 0


def test_router_predict_says_when_it_compared_nothing(capsys):
    """``bench/router_predict.py`` compares at every Nth arrival: with fewer arrivals than N it
    says so and exits 2 (it used to fail on an empty array); with enough it prints its table."""
    from bench import router_predict
    args = ["--trace", "agent", "--speedup", "5", "--limit", "12"]
    assert router_predict.main(args + ["--every", "13"]) == 2
    assert "no prediction compared: --every 13 is more than the 12 arrivals" in capsys.readouterr().err
    assert router_predict.main(args + ["--every", "6"]) == 0
    out = capsys.readouterr().out
    assert "16 predictions (every 6th arrival x 8 workers)" in out and "  all " in out


@pytest.mark.parametrize("script,option,extra", [
    ("router_replay", "--json-out", ["--trace", "agent"]),
    ("router_replay", "--png-out", ["--trace", "agent"]),
    ("router_sweep", "--out", []),
    ("gateway_replay", "--json-out", ["--trace", "agent"]),
    ("gateway_load", "--json-out", []),
    ("storage_study", "--json-out", []),
    ("vs_peers", "--json-out", []),
])
def test_a_bench_refuses_an_output_it_cannot_write_before_it_runs(script, option, extra, tmp_path, capsys):
    """Each bench that writes its results at the end checks the path when it parses its
    arguments: a directory that does not exist, or a directory given as the file, is a usage
    error (exit 2, naming the path) before any replay or server starts; a writable path passes."""
    import importlib
    main = importlib.import_module(f"bench.{script}").main
    missing = tmp_path / "no-such-dir" / "out.json"
    with pytest.raises(SystemExit) as exc:
        main(extra + [option, str(missing)])
    assert exc.value.code == 2
    assert f"no directory {missing.parent}; create it first" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(extra + [option, str(tmp_path)])
    assert exc.value.code == 2
    assert f"{tmp_path}: is a directory" in capsys.readouterr().err
    from bench._outpath import out_path
    assert out_path(str(tmp_path / "out.json")) == str(tmp_path / "out.json")
