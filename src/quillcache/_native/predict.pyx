# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The per-worker arithmetic of the ``quillcache`` routing policy (``control/policies.py``,
``predict_ttft``, which documents every term and computes the scalars), in one pass over the
candidates instead of ~40 numpy calls on arrays of a few dozen entries: at 64 workers those
cost ~60 µs of a ~110 µs decision in call overhead alone.

The operations and their order are numpy's, term by term, in IEEE double: the results are
the same bits (``tests/control/test_predict_native.py`` holds it against the numpy form).
It allocates the four result arrays and nothing else; nothing in it grows with the blocks
indexed.
"""
from libc.math cimport ceil
from libc.stdint cimport int64_t

import numpy as np

__all__ = ["predict", "demand_excess"]


def predict(const int64_t[:] device, const int64_t[:] host, const int64_t[:] disk, const int64_t[:] pool_in,
            const int64_t[:] prefill_tokens, const int64_t[:] prefill_requests, const int64_t[:] requests,
            const double[:] memory_wait, const int64_t[:] free_pages, int64_t n_tokens, int64_t block_size,
            int64_t limit, int64_t n_blocks, bint use_pool, double per_token, double decode_us_per_token,
            double running_penalty_us, double batch_tokens, double host_us, double disk_us, double pool_us,
            double refill, double device_share, double stretch=1.0, const double[:] excess=None,
            const double[:] saved=None):
    """(score, ttft, pool, wait): the ``Prediction`` fields, per worker.  ``memory_wait`` and
    ``free_pages`` may be None (the router does not know the engines' pages).  ``limit``: the
    blocks a request may reuse (it computes at least one token); ``n_blocks``: its blocks,
    rounded up; ``refill``: what finding an evicted block again costs, us; ``stretch``: how much
    longer a queue lasts per microsecond added to it (``BusyShare.stretch``); ``excess`` and
    ``saved`` (both or neither): per worker, the arrivals that queue there past an even spread
    for their cache, against the mean, and what each saves there over its next-best worker, us
    (``DemandShare.excess``)."""
    cdef Py_ssize_t k = device.shape[0], i, h = 0
    if (host.shape[0] != k or disk.shape[0] != k or pool_in.shape[0] != k or prefill_tokens.shape[0] != k
            or prefill_requests.shape[0] != k or requests.shape[0] != k):
        raise ValueError(f"predict: the arrays do not all have {k} workers")
    cdef bint waits = memory_wait is not None, pages = free_pages is not None, weighed = excess is not None
    if (waits and memory_wait.shape[0] != k) or (pages and free_pages.shape[0] != k):
        raise ValueError(f"predict: page arrays do not have {k} workers")
    if weighed != (saved is not None):
        raise ValueError("predict: excess and saved go together")
    if weighed and (excess.shape[0] != k or saved.shape[0] != k):
        raise ValueError(f"predict: excess or saved does not have {k} workers")
    score_a = np.empty(k)
    ttft_a = np.empty(k)
    wait_a = np.empty(k)
    pool_a = np.zeros(k, np.int64)
    cdef double[::1] score = score_a, ttft = ttft_a, wait = wait_a
    cdef int64_t[::1] pool = pool_a
    cdef int64_t local, reuse, own, work, need, strand, d
    cdef double decodes, per_iter, room, load, busy, stall, imposed, cut, total = 0.0, behind = 0.0, q
    # The cluster's running decodes, the mean prefill queue and the worker holding the deepest
    # device prefix: what every worker's terms below are weighed against.
    for i in range(k):
        d = requests[i] - prefill_requests[i]
        total += <double>(d if d > 0 else 0)
        behind += <double>prefill_requests[i]
        if device[i] > device[h]:
            h = i                               # np.argmax: the first of the deepest
    if k:
        behind = behind / <double>k * stretch
    for i in range(k):
        d = requests[i] - prefill_requests[i]
        decodes = <double>(d if d > 0 else 0)
        # Its own uncached tokens after what it reuses (the pool only where loading a block
        # costs less than recomputing it), behind the prefill work already admitted there, with
        # the decode iterations that interleave with that work (chunked prefill) and its loads.
        local = device[i] + host[i] + disk[i]
        if use_pool:
            reuse = limit - local
            if reuse < 0:
                reuse = 0
            pool[i] = pool_in[i] if pool_in[i] < reuse else reuse
        reuse = local + pool[i]
        if reuse > limit:
            reuse = limit
        own = n_tokens - reuse * block_size
        work = prefill_tokens[i] + own
        per_iter = decode_us_per_token + running_penalty_us * decodes if decodes > 0 else 0.0
        room = batch_tokens - decodes
        if room < 1.0:
            room = 1.0
        load = <double>host[i] * host_us + <double>disk[i] * disk_us + <double>pool[i] * pool_us
        ttft[i] = per_token * <double>work + ceil(<double>work / room) * per_iter + load
        q = <double>prefill_tokens[i]
        wait[i] = per_token * q + ceil(q / room) * per_iter
        stall = 0.0
        if waits:
            stall = memory_wait[i] - wait[i]
            if stall < 0.0:
                stall = 0.0
            ttft[i] = ttft[i] + stall
            wait[i] = wait[i] + stall
        busy = per_token * <double>own + load
        # The slowdown its compute and loads impose on the decodes running there: that
        # worker's share of the cluster's running decodes.
        imposed = busy * (decodes / total) if total else 0.0
        # Each microsecond of compute or loading it adds is one more of waiting for the requests
        # that will queue behind it; the mean prefill queue over the workers says how many, and
        # the stretch how much longer the queue lasts with it (1 / (1 - rho)).  So
        # is each microsecond it waits for KV pages past the compute queue: the engine admits in
        # order, so those behind it wait too while its compute idles.
        imposed = imposed + (busy + stall) * behind
        # A worker holding the prefix many arrivals share has more of them queue behind it than
        # the mean: those past an even spread come for their cache, and each waits behind this
        # one or goes elsewhere and recomputes what it saves here, whichever is less.
        if weighed:
            cut = busy + stall
            if cut > saved[i]:
                cut = saved[i]
            imposed = imposed + cut * (behind * excess[i])
        # What it evicts: each page it takes (its blocks not on that device) beyond the pages
        # free there pushes one cached block out, which later requests would have found there at
        # the rate blocks are found on the device (``device_share``) and now load from the pool
        # or recompute (``refill``).  A long context moved to a worker that lacks it costs its
        # new worker that much of its cache; on its holder it takes only its new blocks; on a
        # worker with free pages, nothing.
        need = n_blocks - device[i]
        if pages:
            need = need - free_pages[i]
            if need < 0:
                need = 0
        # Sent elsewhere, it strands the holder's copy (the worker with its deepest device
        # prefix): the next request of this context goes where it goes, and that copy, the
        # freshest in the holder's cache, pushes out that many blocks there (past the pages free
        # there).
        strand = device[h] - device[i]
        if strand < 0:
            strand = 0
        if pages:
            strand = strand - free_pages[h]
            if strand < 0:
                strand = 0
        need = need + strand
        score[i] = ttft[i] + (imposed + device_share * refill * <double>need)
    return score_a, ttft_a, pool_a, wait_a


def demand_excess(const double[:] pref, const double[:] saved, const int64_t[:] slots, double even,
                  double noise):
    """``DemandShare.excess``'s arithmetic (``control/policies.py`` documents it): per candidate
    slot, ``max(0, demand x k / total - 1 - noise)`` with ``demand = pref + even / k`` (slots
    past ``pref``'s end count 0), and ``saved / pref`` where ``pref > 0``.  The same operations
    in the same order as the numpy form it replaced (the total by numpy's own sum), so the same
    bits, in one call instead of ~10 on arrays of a few dozen entries."""
    cdef Py_ssize_t k = slots.shape[0], n = pref.shape[0], i
    cdef int64_t s
    if saved.shape[0] != n:
        raise ValueError(f"demand_excess: pref has {n} slots, saved {saved.shape[0]}")
    demand_a = np.empty(k)
    excess_a = np.zeros(k)
    per_a = np.zeros(k)
    cdef double[::1] demand = demand_a, excess = excess_a, per = per_a
    cdef double share = even / <double>k if k else 0.0, total, scale, e, p
    for i in range(k):
        s = slots[i]
        p = pref[s] if 0 <= s < n else 0.0
        demand[i] = p + share
        if p > 0.0:
            per[i] = saved[s] / p
    total = float(demand_a.sum())
    if not total > 0.0:
        return np.zeros(k), np.zeros(k)
    scale = <double>k / total
    for i in range(k):
        e = demand[i] * scale - 1.0 - noise
        excess[i] = e if e > 0.0 else 0.0
    return excess_a, per_a
