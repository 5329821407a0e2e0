"""The offset allocator (quillcache._native.alloc) against an interval oracle."""
import random
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from quillcache._native.alloc import (MAX_UNITS, Allocation, OffsetAllocator, bin_round_down,
                                      bin_round_up, bin_size)
from quillcache.errors import CapacityError

KiB, MiB = 1024, 1024 * 1024


def snapshot(a):
    return (a.extents(), a.free_extents(), a.report(), a.used, a.live)


def gaps(capacity, live):
    """Maximal free (offset, size) gaps around the live (offset, size) extents."""
    out, pos = [], 0
    for off, size in sorted(live):
        if off > pos:
            out.append((pos, off - pos))
        pos = off + size
    if pos < capacity:
        out.append((pos, capacity - pos))
    return out


# ---- the small-float bins -------------------------------------------------------------

@given(st.integers(1, 2**32 - 1))
def test_round_down_bin_is_the_largest_bin_not_above_the_size(v):
    b = bin_round_down(v)
    assert bin_size(b) <= v
    assert b == 255 or bin_size(b + 1) > v


@given(st.integers(1, 2**32 - 1))
def test_round_up_bin_is_the_smallest_bin_not_below_the_size(v):
    b = bin_round_up(v)
    assert b <= 240
    assert bin_size(b) >= v
    assert bin_size(b - 1) < v


def test_bins_are_exact_below_sixteen_units_and_use_three_mantissa_bits_above():
    assert [bin_round_down(v) for v in range(1, 16)] == list(range(1, 16))
    assert bin_round_down(16) == bin_round_down(17) == 16
    assert bin_size(16) == 16 and bin_size(17) == 18 and bin_size(24) == 32
    assert bin_round_up(17) == 17 and bin_round_down(2**32 - 1) == 239


# ---- construction limits --------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    ({"capacity": 0}, "capacity"),
    ({"capacity": 1000}, "multiple of unit"),
    ({"capacity": 4096, "unit": 3}, "power of two"),
    ({"capacity": 4096, "unit": 0}, "power of two"),
    ({"capacity": 4096, "unit": 2**31}, "power of two"),
    ({"capacity": -4096}, "capacity"),
    ({"capacity": 4096, "max_allocs": 0}, "max_allocs"),
    ({"capacity": 4096, "max_allocs": 2**31}, "max_allocs"),
    ({"capacity": (MAX_UNITS + 1) * 256}, "units"),
])
def test_bad_constructor_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OffsetAllocator(**kwargs)


def test_capacity_of_max_units_is_accepted_and_allocatable_at_once():
    a = OffsetAllocator(MAX_UNITS * 4096, unit=4096, max_allocs=4)
    assert a.capacity == MAX_UNITS * 4096
    x = a.allocate(a.capacity)
    assert (x.offset, x.size) == (0, a.capacity)
    a.free(x.handle)
    assert a.report() == (a.capacity, a.capacity)


def test_node_pool_is_two_per_allocation_plus_one():
    assert OffsetAllocator(1 << 30, unit=256, max_allocs=1000).node_pool == 2001
    # never more allocations than units
    assert OffsetAllocator(10 * 256, unit=256, max_allocs=1000).node_pool == 21


# ---- whole capacity, exact fit, slots ------------------------------------------------

@pytest.mark.parametrize("units", [1, 7, 17, 1000, 1023, 12345, 2**20 + 3])
def test_fresh_allocator_hands_out_its_whole_capacity(units):
    a = OffsetAllocator(units * 256, unit=256)
    x = a.allocate(units * 256)
    assert (x.offset, x.size) == (0, units * 256)
    assert a.report() == (0, 0)
    with pytest.raises(CapacityError):
        a.allocate(1)


def test_unit_sized_allocations_fill_exactly_the_capacity():
    a = OffsetAllocator(1000 * 4096, unit=4096, max_allocs=1000)
    got = [a.allocate(1) for _ in range(1000)]
    assert sorted(x.offset for x in got) == [i * 4096 for i in range(1000)]
    assert a.used == a.capacity and a.report() == (0, 0)
    with pytest.raises(CapacityError):
        a.allocate(1)
    a.free_many([x.handle for x in got])
    assert a.free_extents() == [(0, a.capacity)]


def test_largest_free_is_exact_when_the_top_bin_holds_several_sizes():
    # free regions of 65 and 70 units share bin 64..71; allocate(70 units) must find the 70
    a = OffsetAllocator(200, unit=1)
    a.reserve(65, 1)
    a.reserve(65 + 1 + 70, 200 - 136)
    assert a.free_extents() == [(0, 65), (66, 70)]
    assert a.report() == (135, 70)
    x = a.allocate(70)
    assert (x.offset, x.size) == (66, 70)
    with pytest.raises(CapacityError) as e:
        a.allocate(66)
    assert (e.value.requested, e.value.free, e.value.largest_free) == (66, 65, 65)


def test_exactly_max_allocs_live_allocations_fit_when_fully_fragmented():
    n = 100
    a = OffsetAllocator((2 * n + 1) * 256, unit=256, max_allocs=n)
    # every allocation isolated by a free unit: n used + n + 1 free nodes
    handles = [a.reserve((2 * i + 1) * 256, 256) for i in range(n)]
    assert a.live == n and len(a.free_extents()) == n + 1
    with pytest.raises(CapacityError, match="allocation slots") as e:
        a.allocate(256)
    assert e.value.free == (n + 1) * 256
    with pytest.raises(CapacityError, match="allocation slots"):
        a.reserve(0, 256)
    a.free(handles[0])
    a.allocate(512)  # the first two free units merged back
    assert a.live == n


def test_max_allocs_allocations_fit_through_allocate_with_churn():
    n = 64
    a = OffsetAllocator(4 * n * 256, unit=256, max_allocs=n)
    live = [a.allocate(256 * (1 + i % 3)) for i in range(n)]
    with pytest.raises(CapacityError, match="allocation slots"):
        a.allocate(1)
    for x in live[::2]:
        a.free(x.handle)
    for _ in range(n // 2):
        a.allocate(256)
    assert a.live == n


def test_out_of_space_error_says_requested_free_and_largest_free():
    a = OffsetAllocator(16 * KiB, unit=1 * KiB)
    a.allocate(10 * KiB)
    with pytest.raises(CapacityError) as e:
        a.allocate(7 * KiB)
    assert (e.value.requested, e.value.free, e.value.largest_free) == (7 * KiB, 6 * KiB, 6 * KiB)
    assert "7168" in str(e.value) and isinstance(e.value, MemoryError)
    with pytest.raises(CapacityError):
        a.allocate(2**64 - 1)


# ---- handles ----------------------------------------------------------------------------

def test_stale_handle_cannot_free_the_allocation_that_reused_its_node():
    a = OffsetAllocator(64 * KiB, unit=1 * KiB)
    x = a.allocate(4 * KiB)
    a.free(x.handle)
    y = a.allocate(4 * KiB)
    assert y.handle & 0xFFFFFFFF == x.handle & 0xFFFFFFFF and y.handle != x.handle
    with pytest.raises(ValueError, match=str(x.handle)):
        a.free(x.handle)
    assert a.extent(y.handle) == (y.offset, y.size)
    a.free(y.handle)


@pytest.mark.parametrize("bad", [-1, 2**64, 12345, 2**40 + 3, "7", 1.0])
def test_unknown_handles_raise_value_error_and_change_nothing(bad):
    a = OffsetAllocator(64 * KiB, unit=1 * KiB)
    a.allocate(1)
    before = snapshot(a)
    with pytest.raises(ValueError, match="handle"):
        a.free(bad)
    with pytest.raises(ValueError, match="handle"):
        a.extent(bad)
    assert snapshot(a) == before


def test_double_free_raises_value_error_naming_the_handle():
    a = OffsetAllocator(64 * KiB)
    x = a.allocate(100)
    a.free(x.handle)
    with pytest.raises(ValueError, match=f"handle {x.handle}"):
        a.free(x.handle)


@pytest.mark.parametrize("size", [0, -1, -(2**70)])
def test_size_below_one_byte_is_refused_and_changes_nothing(size):
    a = OffsetAllocator(64 * KiB)
    a.allocate(1)
    before = snapshot(a)
    with pytest.raises(ValueError):
        a.allocate(size)
    with pytest.raises(ValueError):
        a.allocate_many([256, size])
    with pytest.raises(ValueError):
        a.reserve(4096, size)
    assert snapshot(a) == before


def test_non_integer_size_is_a_type_error():
    with pytest.raises(TypeError):
        OffsetAllocator(64 * KiB).allocate(1.5)


def test_allocation_reports_reserved_size_rounded_up_to_unit():
    a = OffsetAllocator(64 * KiB, unit=4 * KiB)
    x = a.allocate(5000)
    assert isinstance(x, Allocation)
    offset, size, handle = x
    assert (offset, size) == (0, 8 * KiB) and a.used == 8 * KiB
    assert a.extent(handle) == (0, 8 * KiB)


# ---- reserve ------------------------------------------------------------------------------

def test_reserve_refuses_bad_extents_and_changes_nothing():
    a = OffsetAllocator(64 * KiB, unit=1 * KiB)
    a.reserve(8 * KiB, 4 * KiB)
    before = snapshot(a)
    for off, size, match in [
        (8 * KiB, 1, "overlaps"), (11 * KiB, 1 * KiB, "overlaps"), (7 * KiB, 2 * KiB, "overlaps"),
        (0, 9 * KiB, "overlaps"), (100, 1, "multiple of unit"), (64 * KiB, 1, "capacity"),
        (63 * KiB, 2 * KiB, "capacity"), (0, 2**64 - 1, "capacity"), (-1024, 1, "offset"),
    ]:
        with pytest.raises(ValueError, match=match):
            a.reserve(off, size)
        assert snapshot(a) == before


def test_reserve_rebuilds_the_same_layout_from_live_extents():
    rng = random.Random(7)
    a = OffsetAllocator(4 * MiB, unit=256, max_allocs=4096)
    live = []
    for _ in range(3000):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))).handle)
        else:
            try:
                live.append(a.allocate(rng.randint(1, 16 * KiB)))
            except CapacityError:
                pass
    extents = a.extents()
    b = OffsetAllocator(4 * MiB, unit=256, max_allocs=4096)
    order = list(extents)
    rng.shuffle(order)
    for off, size, _ in order:
        b.reserve(off, size)
    assert [e[:2] for e in b.extents()] == [e[:2] for e in extents]
    assert b.free_extents() == a.free_extents() and b.report() == a.report()


# ---- batches ------------------------------------------------------------------------------

def test_allocate_many_is_all_or_nothing():
    a = OffsetAllocator(64 * KiB, unit=1 * KiB, max_allocs=32)
    a.allocate(10 * KiB)
    before = snapshot(a)
    with pytest.raises(CapacityError) as e:
        a.allocate_many([1 * KiB] * 10 + [50 * KiB])
    assert e.value.requested == 50 * KiB
    assert snapshot(a) == before
    with pytest.raises(CapacityError, match="allocation slots"):
        a.allocate_many([1] * 32)
    assert snapshot(a) == before
    got = a.allocate_many([1 * KiB] * 30)
    assert len({x.offset for x in got}) == 30 and a.live == 31


def test_free_many_with_a_stale_or_repeated_handle_frees_nothing():
    a = OffsetAllocator(64 * KiB, unit=1 * KiB)
    xs = a.allocate_many([1 * KiB] * 8)
    gone = a.allocate(1)
    a.free(gone.handle)
    before = snapshot(a)
    with pytest.raises(ValueError, match=str(gone.handle)):
        a.free_many([xs[0].handle, xs[1].handle, gone.handle])
    assert snapshot(a) == before
    with pytest.raises(ValueError, match="twice"):
        a.free_many([xs[2].handle, xs[3].handle, xs[2].handle])
    assert snapshot(a) == before
    a.free_many([x.handle for x in xs])
    assert a.report() == (64 * KiB, 64 * KiB) and a.live == 0


def test_clear_frees_everything_and_invalidates_handles():
    a = OffsetAllocator(64 * KiB, unit=1 * KiB)
    xs = a.allocate_many([3 * KiB] * 5)
    a.clear()
    assert a.live == 0 and a.report() == (64 * KiB, 64 * KiB)
    with pytest.raises(ValueError):
        a.free(xs[0].handle)
    assert a.allocate(64 * KiB).size == 64 * KiB


def test_bench_pairs_runs_the_cdef_path_and_leaves_the_allocator_empty():
    sizes = np.array([256, 4096, 65536, 1 * MiB], dtype=np.uint64)
    a = OffsetAllocator(1 << 34, unit=256, max_allocs=2048)
    for batch in (1, 64):
        ns = a.bench_pairs(20000, sizes, 1000, batch=batch)
        assert ns > 0
        assert a.live == 0 and a.report() == (a.capacity, a.capacity)
    with pytest.raises(CapacityError):
        OffsetAllocator(1 * MiB, unit=256).bench_pairs(10, sizes, 100)


def test_python_calls_during_a_nogil_batch_get_an_error_not_a_race():
    a = OffsetAllocator(1 << 36, unit=256, max_allocs=1 << 16)
    sizes = np.array([256, 4096, 1 * MiB], dtype=np.uint64)
    running, done, errors = threading.Event(), threading.Event(), []

    def hammer():
        running.set()
        while not done.is_set():
            try:
                a.report()
            except RuntimeError as e:
                errors.append(str(e))

    t = threading.Thread(target=hammer)
    t.start()
    running.wait()
    try:
        ns = a.bench_pairs(1_000_000, sizes, 30000)
    finally:
        done.set()
        t.join()
    assert ns > 0 and errors and "batch call" in errors[0]
    assert a.report() == (a.capacity, a.capacity) and a.live == 0


# ---- the property test: an interval oracle ---------------------------------------------

class AllocatorMachine(RuleBasedStateMachine):
    @initialize(units=st.integers(1, 300), unit=st.sampled_from([1, 256, 4096]),
                max_allocs=st.one_of(st.none(), st.integers(1, 40)))
    def setup(self, units, unit, max_allocs):
        self.a = OffsetAllocator(units * unit, unit=unit, max_allocs=max_allocs)
        self.unit = unit
        self.cap = units * unit
        self.max = min(units, 1 << 20) if max_allocs is None else max_allocs
        self.live = {}          # handle -> (offset, size)
        self.stale = []

    def largest_gap(self):
        return max((s for _, s in gaps(self.cap, self.live.values())), default=0)

    def rounded(self, size):
        return -(-size // self.unit) * self.unit

    def check_new(self, handle, offset, size, requested):
        assert offset % self.unit == 0 and size % self.unit == 0
        assert size == self.rounded(requested)
        assert 0 <= offset and offset + size <= self.cap
        for o, s in self.live.values():
            assert offset + size <= o or o + s <= offset, "overlapping extents"
        assert handle not in self.live
        self.live[handle] = (offset, size)

    @rule(data=st.data())
    def allocate(self, data):
        size = data.draw(st.integers(1, self.cap + 2 * self.unit))
        if size > self.cap:
            with pytest.raises(CapacityError, match="out of capacity"):
                self.a.allocate(size)
        elif len(self.live) >= self.max:
            with pytest.raises(CapacityError, match="allocation slots"):
                self.a.allocate(size)
        elif self.rounded(size) > self.largest_gap():
            with pytest.raises(CapacityError, match="out of capacity") as e:
                self.a.allocate(size)
            assert e.value.largest_free == self.largest_gap()
        else:
            x = self.a.allocate(size)
            self.check_new(x.handle, x.offset, x.size, size)

    @rule()
    def allocate_largest_free(self):
        largest = self.a.report()[1]
        if largest and len(self.live) < self.max:
            x = self.a.allocate(largest)
            self.check_new(x.handle, x.offset, x.size, largest)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        h = data.draw(st.sampled_from(sorted(self.live)))
        self.a.free(h)
        del self.live[h]
        self.stale.append(h)

    @precondition(lambda self: self.stale)
    @rule(data=st.data())
    def free_stale_handle_is_an_error(self, data):
        h = data.draw(st.sampled_from(self.stale))
        if h in self.live:      # the same node came back with the same generation: impossible
            raise AssertionError(f"handle {h} was handed out twice")
        with pytest.raises(ValueError, match=str(h)):
            self.a.free(h)

    @rule(data=st.data())
    def reserve(self, data):
        units = self.cap // self.unit
        off = data.draw(st.integers(0, units - 1)) * self.unit
        size = data.draw(st.integers(1, (units * self.unit) - off))
        end = off + self.rounded(size)
        overlaps = any(off < o + s and o < end for o, s in self.live.values())
        if overlaps:
            with pytest.raises(ValueError, match="overlaps"):
                self.a.reserve(off, size)
        elif len(self.live) >= self.max:
            with pytest.raises(CapacityError, match="allocation slots"):
                self.a.reserve(off, size)
        else:
            h = self.a.reserve(off, size)
            self.check_new(h, off, self.rounded(size), size)

    @rule(data=st.data())
    def allocate_many(self, data):
        sizes = data.draw(st.lists(st.integers(1, max(1, self.cap // 4)), max_size=6))
        before = sorted(self.live.values())
        try:
            got = self.a.allocate_many(sizes)
        except CapacityError:
            assert [e[:2] for e in self.a.extents()] == before
            return
        for x, s in zip(got, sizes):
            self.check_new(x.handle, x.offset, x.size, s)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), poison=st.booleans())
    def free_many(self, data, poison):
        hs = data.draw(st.lists(st.sampled_from(sorted(self.live)), unique=True, min_size=1))
        if poison and self.stale:
            hs.insert(data.draw(st.integers(0, len(hs))), data.draw(st.sampled_from(self.stale)))
            with pytest.raises(ValueError, match="handle"):
                self.a.free_many(hs)
            return
        self.a.free_many(hs)
        for h in hs:
            del self.live[h]
            self.stale.append(h)

    @rule()
    def free_everything_merges_back_to_one_region(self):
        self.a.free_many(list(self.live))
        self.stale.extend(self.live)
        self.live.clear()
        assert self.a.report() == (self.cap, self.cap)
        assert self.a.free_extents() == [(0, self.cap)]

    @invariant()
    def extents_match_the_oracle(self):
        assert self.a.extents() == sorted((o, s, h) for h, (o, s) in self.live.items())
        assert self.a.free_extents() == gaps(self.cap, self.live.values())

    @invariant()
    def free_bytes_and_largest_free_are_exact(self):
        used = sum(s for _, s in self.live.values())
        assert self.a.report() == (self.cap - used, self.largest_gap())
        assert self.a.used == used and self.a.live == len(self.live)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=200, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.slow
def test_allocator_machine_long_run():
    run_state_machine_as_test(AllocatorMachine, settings=settings(
        max_examples=10_000, stateful_step_count=50, deadline=None,
        suppress_health_check=list(HealthCheck)))


def test_reserve_many_matches_reserve_one_by_one_and_names_the_first_failure():
    a = OffsetAllocator(64 * KiB, unit=1 * KiB)
    b = OffsetAllocator(64 * KiB, unit=1 * KiB)
    offs = np.array([0, 2 * KiB, 3 * KiB, 10 * KiB], np.uint64)
    sizes = np.array([1, 1 * KiB, 5 * KiB, 7], np.uint64)
    handles = np.zeros(4, np.uint64)
    assert a.reserve_many(offs, sizes, handles) == 4
    assert [b.reserve(int(o), int(s)) for o, s in zip(offs, sizes)] == handles.tolist()
    assert snapshot(a) == snapshot(b)
    with pytest.raises(ValueError, match=r"reserve_many\[1\]: .*overlaps"):
        a.reserve_many(np.array([20 * KiB, 4 * KiB], np.uint64), np.array([1, 1], np.uint64),
                       np.zeros(2, np.uint64))
    assert a.extent(a.extents()[-1][2]) == (20 * KiB, 1 * KiB)     # the one before it stays
    with pytest.raises(ValueError, match="offsets"):
        a.reserve_many(offs, sizes[:2], handles)
