"""``bench/local_path.py`` times the sides it compares under the same conditions: each is
called once untimed before any is timed (the first writer of fresh arena pages pays their
faults), and the rounds rotate the order, so no side always follows the same one."""
from __future__ import annotations

import time

from bench import local_path


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

