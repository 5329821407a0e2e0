"""Crash injection on the SSD tier: kill points, faults, power loss, damaged files.

The default run covers every kill point and every fault once plus random SIGKILL cycles
(>= 20 kill cycles); ``make crash N=500`` (--crash-long) runs N cycles of random modes and
prints a summary line.
"""
import random
import shutil
import time

import pytest

from tests.crash.harness import ALL_MODES, run_cycle

RANDOM_KILL_CYCLES = 4      # extra SIGKILL-after-a-random-delay cycles in the short run


def _assert_clean(res):
    assert res.lost == 0 and res.corrupted_served == 0, res.problems


@pytest.mark.parametrize("mode", ALL_MODES)
def test_acknowledged_puts_survive_and_nothing_wrong_is_served(tmp_path, mode):
    res = run_cycle(tmp_path, mode, seed=1000 + ALL_MODES.index(mode))
    _assert_clean(res)
    if mode in ("bitflip_data",):
        assert res.detected_misses == 1      # the flipped block is a miss, never bytes


@pytest.mark.parametrize("seed", range(RANDOM_KILL_CYCLES))
def test_random_sigkill_loses_no_acknowledged_put(tmp_path, seed):
    _assert_clean(run_cycle(tmp_path, "sigkill", seed=2000 + seed))


def test_eager_verification_recovers_the_same_guarantees(tmp_path):
    _assert_clean(run_cycle(tmp_path, "bitflip_data", seed=3000, verify="eager"))


def test_long_crash_campaign(tmp_path, crash_cycles, capsys):
    rng = random.Random(int(time.time()))
    totals = {"cycles": 0, "acked": 0, "lost": 0, "corrupted": 0, "detected": 0}
    failures = []
    t0 = time.time()
    for _i in range(crash_cycles):
        mode = rng.choice(ALL_MODES)
        seed = rng.randrange(1 << 30)
        try:
            res = run_cycle(tmp_path, mode, seed, verify=rng.choice(("lazy", "eager")))
        except AssertionError as exc:
            failures.append(f"{mode} seed={seed}: {exc}")
            continue
        totals["cycles"] += 1
        totals["acked"] += res.acked_checked
        totals["lost"] += res.lost
        totals["corrupted"] += res.corrupted_served
        totals["detected"] += res.detected_misses
        if res.lost or res.corrupted_served:
            failures.append(f"{mode} seed={seed}: {res.problems}")
        for p in tmp_path.iterdir():        # keep the disk footprint of a long run flat
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
    with capsys.disabled():
        print(f"\ncrash campaign: cycles={totals['cycles']} acknowledged_puts_checked={totals['acked']} "
              f"lost={totals['lost']} corrupted_served={totals['corrupted']} "
              f"detected_corruption_misses={totals['detected']} failed_cycles={len(failures)} "
              f"seconds={time.time() - t0:.0f}")
    assert not failures, failures[:10]
