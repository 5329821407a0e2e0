"""QuillCache against Redis 7 and Mooncake Store, API class against API class: one client, one
server process, loopback.

Two API classes, each system compared only within its class:

* **bytes API**: the call hands back a new value (``bytes``, or a view of a buffer the call
  allocated) and takes any buffer to store.  QuillCache ``get``/``put``/``get_many``/``put_many``;
  Redis ``GET``/``SET`` and non-transactional pipelines of them (redis-py with hiredis);
  Mooncake ``get``/``put``/``get_batch``/``put_batch``.
* **zero-copy API**: the value lands in a buffer the caller allocated once (and a PUT reads one).
  QuillCache ``get_into``/``get_many_into``/``put``/``put_many`` of a preallocated buffer over TCP
  (``quillcache-zc``), the same calls over the node's Unix socket with the arena mapped, where
  they copy out of and into the located extents (``quillcache-shm``); Mooncake ``get_into``/
  ``batch_get_into``/``put_from``/``batch_put_from`` on registered buffers (``mooncake-zc``).
  Redis has no zero-copy API: it has no row in this class.

Sizes 1 KiB, 16 KiB, 64 KiB, 256 KiB and 4 MiB; single (one value per request) and batch
(``batch_for(size)`` values per request: 500 of 1 KiB, 256 of 16 KiB, 64 of 64 KiB, 16 of
256 KiB and of 4 MiB, about 4 MiB a request); PUT then GET.  Every GET is checked byte for
byte outside the timed call.

* **warm**: the benchmark's long-lived client, one untimed pass over the working set, then
  ``--rounds`` timed passes, the systems taking turns pass by pass: the best pass (MB/s =
  bytes / time inside the request calls).  Also "p50 MB/s" = one request's bytes / the
  median request latency over the timed passes: on a machine shared with busy neighbours
  the sum of latencies is mostly their preemptions, the median much less so.
* **cold**: a fresh client process per (system, size, mode, op) connects (untimed) and makes one
  timed pass: what a short-lived worker pays (its allocator's first touch of fresh pages,
  its first encoding of each key).  ``--cold-runs`` such processes, the systems taking turns
  run by run, the best of each.

    python bench/vs_peers.py [--systems quillcache,redis,mooncake,quillcache-zc,quillcache-shm,mooncake-zc]
        [--sizes 1K,16K,64K,256K,4M] [--rounds 5] [--no-cold] [--floor] [--qc-spin-us US]
        [--json-out results.json]

Servers, each started here on free loopback ports and stopped at the end:
  quillcache   quillcached (the real daemon, DRAM tier only) + quillcache.client.Client, as shipped:
               its receives poll for spin_us (100 us) before they sleep; ``--qc-spin-us 0``
               runs it sleeping at once, as redis-py's and Mooncake's clients do
  redis        redis-server --save '' --appendonly no; redis-py with hiredis
  mooncake     mooncake_master (with its HTTP metadata server) + a separate process lending a
               segment, MC_TCP_BIND_ADDRESS=127.0.0.1, protocol tcp
A system that cannot start is skipped with a message.  The versions of redis-server, redis-py,
hiredis and Mooncake are printed first.

CPU placement: with two or more CPUs, every server process (and its threads) runs on the first
half of the CPUs this process may use and the clients on the other half (``--no-pin`` leaves it
to the scheduler): without it the kernel's wake-affine placement on a small machine often moves
the client onto the server's CPU after a reply and the two take turns on one core.  MiB = 2^20
bytes; "MB/s" here is MiB/s.

All work happens in main() (asv imports only bench/suites/).
"""
import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests._support.ports
from bench._outpath import out_path
from tests._support.ports import free_port as _free_port

KiB = 1 << 10
MiB = 1 << 20
SIZES = (1 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 4 * MiB)
BATCH_BYTES = 4 * MiB          # bytes a batch request aims at (values per request: batch_for)
BATCH_MIN, BATCH_MAX = 16, 500  # values per batch request
WORKING_SET = 64 * MiB         # bytes of distinct values per size ...
MAX_KEYS = 1024                # ... at most this many keys, at least two batches
FLOOR_SIZE = 64                # bytes: the value of the round-trip floor measurement
FLOOR_REQUESTS = 3000          # timed single GETs of it per system
START_TIMEOUT = 30.0           # seconds: a server that does not answer by then is skipped
COLD_TIMEOUT = 300.0           # seconds: one cold worker process
HERE = Path(__file__).resolve().parent
VENV_BIN = Path(sys.executable).parent
SERVER_CPUS = None             # set by main(): the CPUs server processes are started on (None: any)
QC_LOOPBACK_CONGESTION = None  # set by main(): quillcached's [node] loopback_congestion (None: its default)
QC_SPIN_US = None              # set by main(): the QuillCache clients' spin_us (None: the client's default)
CLASSES = {"bytes": ("quillcache", "redis", "mooncake"),
           "zero-copy": ("quillcache-zc", "quillcache-shm", "mooncake-zc")}
SYSTEMS = CLASSES["bytes"] + CLASSES["zero-copy"]
CASES = [(mode, op) for mode in ("single", "batch") for op in ("put", "get")]


def batch_for(size):
    return max(BATCH_MIN, min(BATCH_MAX, BATCH_BYTES // size))


def keys_for(size):
    return max(2 * batch_for(size), min(WORKING_SET // size, MAX_KEYS))


def _wait_port(port, proc, timeout=START_TIMEOUT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
        time.sleep(0.05)
    return False


def _stop(proc):
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _placement(pin):
    """(server CPUs, client CPUs), or (None, None) when not pinning or with a single CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2:
        return None, None
    half = len(cpus) // 2
    return set(cpus[:half]), set(cpus[half:])


def _server_popen(argv, **kwargs):
    """Popen for a server process, started on SERVER_CPUS (inherited by its threads)."""
    cpus = SERVER_CPUS
    if cpus is not None:
        kwargs["preexec_fn"] = lambda: os.sched_setaffinity(0, cpus)
    return subprocess.Popen(argv, **kwargs)


def _values(size, count):
    """``count`` distinct values of ``size`` bytes (random head, value index stamped)."""
    import numpy as np
    rng = np.random.default_rng(size)
    base = rng.integers(0, 256, size + 8 * count, dtype=np.uint8)
    out = []
    for i in range(count):
        v = bytearray(base[8 * i: 8 * i + size].tobytes())
        v[:8] = i.to_bytes(8, "little")
        out.append(bytes(v))
    return out


# --------------------------------------------------------------------------- measurement

def _cpu_seconds(pids):
    """User + system CPU seconds of the processes ``pids`` (their threads included)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


class Pass:
    """One pass over the working set: the time inside the request calls, the bytes moved,
    each request's latency, and the CPU both sides spent meanwhile."""

    def __init__(self, server_pids=()):
        self.lat = []
        self.nbytes = 0
        self.server_pids = server_pids
        self.client_cpu = 0.0
        self.server_cpu = 0.0

    def timed(self, fn, nbytes):
        c0 = time.process_time()          # the client's CPU inside the call only
        t0 = time.perf_counter()
        result = fn()
        self.lat.append(time.perf_counter() - t0)
        self.client_cpu += time.process_time() - c0
        self.nbytes += nbytes
        return result

    @contextlib.contextmanager
    def cpu(self):
        s0 = _cpu_seconds(self.server_pids)    # the server is idle between the timed calls
        yield
        self.server_cpu += _cpu_seconds(self.server_pids) - s0

    @property
    def mb_s(self):
        t = sum(self.lat)
        return self.nbytes / MiB / t if t else 0.0

    def summary(self):
        n = max(1, len(self.lat))
        return {"mb_s": self.mb_s, "items_s": 0.0, "requests": len(self.lat), "bytes": self.nbytes,
                "client_cpu_us": self.client_cpu / n * 1e6, "server_cpu_us": self.server_cpu / n * 1e6}


def _summary(passes, size):
    """The best pass (warm), with p50/p99 over all the timed passes."""
    import numpy as np
    best = max(passes, key=lambda p: p.mb_s)
    lat = np.array([x for p in passes for x in p.lat])
    out = best.summary()
    out.update(items_s=out["mb_s"] * MiB / size, p50_ms=float(np.percentile(lat, 50) * 1e3),
               p50_mb_s=best.nbytes / len(best.lat) / MiB / float(np.percentile(lat, 50)),
               p99_ms=float(np.percentile(lat, 99) * 1e3), passes=[p.mb_s for p in passes])
    return out


def one_pass(adapter, keys, values, size, mode, op, server_pids=()):
    """One timed pass of (mode, op) over the working set; for a PUT every key is new
    (removed before, untimed: Mooncake objects are immutable, a put of an existing key moves
    no bytes)."""
    step = 1 if mode == "single" else batch_for(size)
    if op == "put":
        adapter.clear(keys)
    p = Pass(server_pids)
    with p.cpu():
        for start in range(0, len(keys) - step + 1, step):
            ks = keys[start:start + step]
            if op == "put":
                vs = values[start:start + step]
                adapter.stage(vs)       # untimed (only zero-copy APIs need it)
                if step == 1:
                    p.timed(lambda: adapter.put(ks[0], vs[0]), size)
                else:
                    p.timed(lambda: adapter.put_many(ks, vs), size * step)
            elif step == 1:
                got = p.timed(lambda: adapter.get(ks[0]), size)
                _check(got, values[start], adapter.name, ks[0])
            else:
                got = p.timed(lambda: adapter.get_many(ks), size * step)
                for i, v in enumerate(got):
                    _check(v, values[start + i], adapter.name, ks[i])
    return p


def run_cases(adapters, keys, values, size, mode, op, rounds):
    """One untimed pass per system, then ``rounds`` timed ones, the systems taking turns pass
    by pass (a burst of the machine's neighbours falls on all of them): {name: warm summary}."""
    for a in adapters:
        one_pass(a, keys, values, size, mode, op)
    passes = {a.name: [] for a in adapters}
    for _ in range(rounds):
        for a in adapters:
            passes[a.name].append(one_pass(a, keys, values, size, mode, op, a.server_pids))
    return {name: _summary(ps, size) for name, ps in passes.items()}


def _check(got, want, name, key):
    # One vectorised compare for every system (``memoryview == bytes`` compares item by item).
    import numpy as np
    if got is None or len(got) != len(want) or \
            not np.array_equal(np.frombuffer(got, np.uint8), np.frombuffer(want, np.uint8)):
        raise AssertionError(f"{name}: {key}: read back something that differs from what was put")


def cold_case(name, info, size, mode, op):
    """The first pass in a fresh client process (this file with --cold-worker): its summary."""
    spec = json.dumps({"name": name, "info": info, "size": size, "mode": mode, "op": op})
    r = subprocess.run([sys.executable, __file__, "--cold-worker", spec], capture_output=True, text=True,
                       timeout=COLD_TIMEOUT, env=dict(os.environ))
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"cold worker {name} {size} {mode} {op} failed ({r.returncode}): "
                           f"{r.stderr.strip()[-2000:]}")
    return json.loads(lines[-1])


def _cold_worker(spec):
    spec = json.loads(spec)
    size = spec["size"]
    count = keys_for(size)
    values = _values(size, count)
    keys = [f"bench:{size}:{i}" for i in range(count)]
    adapter = ADAPTERS[spec["name"]](spec["info"])     # connecting is not timed
    try:
        adapter.prepare(size)
        p = one_pass(adapter, keys, values, size, spec["mode"], spec["op"])
    finally:
        adapter.close()
    out = p.summary()
    out["items_s"] = out["mb_s"] * MiB / size
    print(json.dumps(out), flush=True)


# --------------------------------------------------------------------------- QuillCache

class QuillCacheServer:
    """quillcached, DRAM tier only (like the peers)."""

    def __init__(self, workdir):
        port, mport = _free_port(), _free_port()
        cfg = Path(workdir) / "quillcache.toml"
        cc = "" if QC_LOOPBACK_CONGESTION is None else f'loopback_congestion = "{QC_LOOPBACK_CONGESTION}"\n'
        cfg.write_text(f'[node]\nlisten = "127.0.0.1:{port}"\ndata_dir = "{workdir}/qc"\n{cc}'
                       f'[store]\ndram = "3GiB"\n[metrics]\nlisten = "127.0.0.1:{mport}"\n'
                       f'[ssd]\nenabled = false\n')
        self.proc = _server_popen([str(VENV_BIN / "quillcached"), "--config", str(cfg)],
                                  stdout=subprocess.DEVNULL, stderr=open(Path(workdir) / "qc.log", "wb"))
        if not _wait_port(port, self.proc):
            _stop(self.proc)
            raise RuntimeError(f"quillcached did not start (see {workdir}/qc.log)")
        self.info = {"tcp": f"127.0.0.1:{port}", "unix": f"unix:{workdir}/qc/quillcached.sock",
                     "pids": [self.proc.pid]}
        if QC_SPIN_US is not None:
            self.info["spin_us"] = QC_SPIN_US

    def close(self):
        _stop(self.proc)


class QuillCacheAdapter:
    """The bytes API: ``get`` returns ``bytes``, ``get_many`` a view per value of buffers it
    allocated; ``put``/``put_many`` take the caller's bytes."""

    name = "quillcache"
    address_key = "tcp"

    def __init__(self, info):
        from quillcache.client import Client
        from quillcache.client.calls import DEFAULT_SPIN_US
        from quillcache.model import KvBlockKey
        self._Key = KvBlockKey
        self.client = Client(info[self.address_key], timeout=120.0, client_name="vs_peers",
                             spin_us=info.get("spin_us", DEFAULT_SPIN_US))
        self._keys = {}
        self.server_pids = info["pids"]
        self.size = 0

    def key(self, name):
        k = self._keys.get(name)
        if k is None:
            k = self._keys[name] = self._Key("bench-model", "bench-tok", None, self.client.tenant or "default",
                                             "root", name, 0, 64)
        return k

    def prepare(self, size):
        self.size = size

    def stage(self, vs):
        pass

    def put(self, k, v):
        self.client.put(self.key(k), v)

    def put_many(self, ks, vs):
        self.client.put_many([(self.key(k), v) for k, v in zip(ks, vs)])

    def get(self, k):
        return self.client.get(self.key(k))

    def get_many(self, ks):
        return self.client.get_many([self.key(k) for k in ks])

    def clear(self, keys):
        self.client.remove_many([self.key(k) for k in keys])

    def close(self):
        with contextlib.suppress(Exception):
            self.client.close()


class QuillCacheZeroCopyAdapter(QuillCacheAdapter):
    """The zero-copy API over TCP: a PUT reads a preallocated buffer, a GET lands in one
    (``get_into``, ``get_many_into`` slices of one buffer, as Mooncake's batch_get_into)."""

    name = "quillcache-zc"

    def prepare(self, size):
        import numpy as np
        self.size = size
        n = batch_for(size)
        self.src = np.empty(size * n, dtype=np.uint8)
        self.dst = np.empty(size * n, dtype=np.uint8)
        self.src_mv = memoryview(self.src)
        self.dst_mv = memoryview(self.dst)
        self.src_views = [self.src_mv[i * size:(i + 1) * size] for i in range(n)]
        self.dst_views = [self.dst_mv[i * size:(i + 1) * size] for i in range(n)]

    def stage(self, vs):
        for view, v in zip(self.src_views, vs):
            view[:] = v

    def put(self, k, v):
        self.client.put(self.key(k), self.src_views[0])

    def put_many(self, ks, vs):
        self.client.put_many([(self.key(k), v) for k, v in zip(ks, self.src_views)])

    def get(self, k):
        n = self.client.get_into(self.key(k), self.dst_views[0])
        return self.dst_views[0][:n]

    def get_many(self, ks):
        ns = self.client.get_many_into([self.key(k) for k in ks], self.dst_views[:len(ks)])
        return [v[:n] for v, n in zip(self.dst_views, ns)]


class QuillCacheShmAdapter(QuillCacheZeroCopyAdapter):
    """The zero-copy API over the node's Unix socket with its arena mapped: GETs copy out of
    the located extents, PUTs into reserved slots (one memcpy each, no socket payload)."""

    name = "quillcache-shm"
    address_key = "unix"

    def __init__(self, info):
        super().__init__(info)
        if not self.client.shm:
            raise RuntimeError(f"the arena is not mapped: {self.client.shm_refused or 'MAP not offered'}")


# --------------------------------------------------------------------------- Redis

class RedisServer:
    def __init__(self, workdir):
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        port = _free_port()
        self.proc = _server_popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no", "--dir", workdir, "--protected-mode", "yes"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not _wait_port(port, self.proc):
            _stop(self.proc)
            raise RuntimeError("redis-server did not start")
        self.info = {"port": port, "pids": [self.proc.pid]}

    def close(self):
        _stop(self.proc)


class RedisAdapter:
    """The bytes API: GET/SET; a batch is a non-transactional pipeline of GETs or SETs."""

    name = "redis"

    def __init__(self, info):
        import redis
        self.r = redis.Redis(host="127.0.0.1", port=info["port"])
        self.r.ping()
        self.server_pids = info["pids"]

    def prepare(self, size):
        pass

    def stage(self, vs):
        pass

    def put(self, k, v):
        self.r.set(k, v)

    def put_many(self, ks, vs):
        p = self.r.pipeline(transaction=False)
        for k, v in zip(ks, vs):
            p.set(k, v)
        p.execute()

    def get(self, k):
        return self.r.get(k)

    def get_many(self, ks):
        p = self.r.pipeline(transaction=False)
        for k in ks:
            p.get(k)
        return p.execute()

    def clear(self, keys):
        for i in range(0, len(keys), 1000):
            self.r.delete(*keys[i:i + 1000])

    def close(self):
        with contextlib.suppress(Exception):
            self.r.close()


# --------------------------------------------------------------------------- Mooncake

class MooncakeCluster:
    """mooncake_master with its HTTP metadata server, and a process lending a segment."""

    SEGMENT = 2 << 30          # bytes lent to the pool by the segment process
    LOCAL_BUFFER = 512 << 20   # bytes: the client's transfer buffer (bytes API)

    def __init__(self, workdir):
        master = VENV_BIN / "mooncake_master"
        if not master.exists():
            raise RuntimeError("mooncake_master not found (pip install mooncake-transfer-engine-non-cuda)")
        try:
            import mooncake.store  # noqa: F401
        except ImportError as exc:
            raise RuntimeError(f"mooncake.store does not import: {exc} (apt-get install libibverbs1?)") from exc
        os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
        self.rpc, self.http, self.metrics = _free_port(), _free_port(), _free_port()
        self.metadata = f"http://127.0.0.1:{self.http}/metadata"
        self.master_addr = f"127.0.0.1:{self.rpc}"
        self.log = open(Path(workdir) / "mooncake.log", "wb")
        self.master = _server_popen(
            [str(master), f"--rpc_port={self.rpc}", "--rpc_address=127.0.0.1",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={self.http}", "--metrics_host=127.0.0.1",
             f"--metrics_port={self.metrics}"], stdout=self.log, stderr=self.log)
        self.lender = None
        if not (_wait_port(self.rpc, self.master) and _wait_port(self.http, self.master)):
            self.close()
            raise RuntimeError(f"mooncake_master did not start (see {workdir}/mooncake.log)")
        self.lender = _server_popen(
            [sys.executable, __file__, "--mooncake-lend", self.metadata, self.master_addr, str(self.SEGMENT)],
            stdout=subprocess.PIPE, stderr=self.log, env=dict(os.environ))
        line = self.lender.stdout.readline()
        if b"READY" not in line:
            self.close()
            raise RuntimeError(f"the mooncake segment process did not start (see {workdir}/mooncake.log)")

        self.info = {"metadata": self.metadata, "master": self.master_addr,
                     "pids": [self.master.pid, self.lender.pid]}

    @classmethod
    def client_for(cls, info):
        from mooncake.store import MooncakeDistributedStore
        store = MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", info["metadata"], 0, cls.LOCAL_BUFFER, "tcp", "", info["master"])
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
        return store

    def close(self):
        if self.lender is not None:
            _stop(self.lender)
        _stop(self.master)


def _mooncake_lend(metadata, master_addr, segment):
    from mooncake.store import MooncakeDistributedStore
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", metadata, int(segment), 16 << 20, "tcp", "", master_addr)
    if rc != 0:
        print(f"setup failed: {rc}", flush=True)
        sys.exit(1)
    print("READY", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    store.close()


def _mc_check(rc, what):
    if rc != 0:
        raise RuntimeError(f"mooncake {what} returned {rc}")



class MooncakeAdapter:
    """The bytes API: put / put_batch / get / get_batch."""

    name = "mooncake"

    def __init__(self, info):
        os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
        self.s = MooncakeCluster.client_for(info)
        self.server_pids = info["pids"]

    def prepare(self, size):
        self.size = size

    def stage(self, vs):
        pass

    def put(self, k, v):
        _mc_check(self.s.put(k, v), "put")

    def put_many(self, ks, vs):
        _mc_check(self.s.put_batch(ks, vs), "put_batch")

    def get(self, k):
        return self.s.get(k)

    def get_many(self, ks):
        return self.s.get_batch(ks)

    def clear(self, keys):
        self.s.batch_remove(keys, True)

    def close(self):
        with contextlib.suppress(Exception):
            self.s.close()


class MooncakeZeroCopyAdapter(MooncakeAdapter):
    """The zero-copy API on registered buffers: put_from / get_into and their batch forms."""

    name = "mooncake-zc"

    def __init__(self, info):
        super().__init__(info)
        self.src = None
        self.dst = None

    def prepare(self, size):
        import numpy as np
        for arr in (self.src, self.dst):
            if arr is not None:
                self.s.unregister_buffer(arr.ctypes.data)
        self.size = size
        n = batch_for(size)
        self.src = np.empty(size * n, dtype=np.uint8)
        self.dst = np.empty(size * n, dtype=np.uint8)
        _mc_check(self.s.register_buffer(self.src.ctypes.data, self.src.nbytes), "register_buffer")
        _mc_check(self.s.register_buffer(self.dst.ctypes.data, self.dst.nbytes), "register_buffer")
        self.src_mv = memoryview(self.src)
        self.dst_mv = memoryview(self.dst)

    def stage(self, vs):
        # A zero-copy user produces values in the registered buffer; the copy there is untimed.
        for i, v in enumerate(vs):
            self.src_mv[i * self.size:(i + 1) * self.size] = v

    def put(self, k, v):
        _mc_check(self.s.put_from(k, self.src.ctypes.data, self.size), "put_from")

    def put_many(self, ks, vs):
        base = self.src.ctypes.data
        rcs = self.s.batch_put_from(ks, [base + i * self.size for i in range(len(ks))], [self.size] * len(ks))
        for rc in rcs:
            _mc_check(rc, "batch_put_from")

    def get(self, k):
        n = self.s.get_into(k, self.dst.ctypes.data, self.size)
        if n < 0:
            raise RuntimeError(f"mooncake get_into returned {n}")
        return self.dst_mv[:n]

    def get_many(self, ks):
        base = self.dst.ctypes.data
        ns = self.s.batch_get_into(ks, [base + i * self.size for i in range(len(ks))], [self.size] * len(ks))
        out = []
        for i, n in enumerate(ns):
            if n < 0:
                raise RuntimeError(f"mooncake batch_get_into returned {n}")
            out.append(self.dst_mv[i * self.size:i * self.size + n])
        return out

    def close(self):
        for arr in (self.src, self.dst):
            if arr is not None:
                with contextlib.suppress(Exception):
                    self.s.unregister_buffer(arr.ctypes.data)
        super().close()


ADAPTERS = {"quillcache": QuillCacheAdapter, "quillcache-zc": QuillCacheZeroCopyAdapter,
            "quillcache-shm": QuillCacheShmAdapter, "redis": RedisAdapter,
            "mooncake": MooncakeAdapter, "mooncake-zc": MooncakeZeroCopyAdapter}
SERVER_OF = {"quillcache": "quillcache", "quillcache-zc": "quillcache", "quillcache-shm": "quillcache",
             "redis": "redis", "mooncake": "mooncake", "mooncake-zc": "mooncake"}


# --------------------------------------------------------------------------- the run

def run_workload(adapters, sizes, rounds, cold, log, cold_runs=1):
    """Every case on every system, interleaved case by case (so that machine noise spreads over
    all of them); returns {name: {(size, mode, op): {"warm": summary, "cold": summary}}}."""
    results = {a.name: {} for a in adapters}
    for size in sizes:
        count = keys_for(size)
        values = _values(size, count)
        keys = [f"bench:{size}:{i}" for i in range(count)]
        for a in adapters:
            a.prepare(size)
        for mode, op in CASES:
            warm = run_cases(adapters, keys, values, size, mode, op, rounds)
            for a in adapters:
                s = warm[a.name]
                results[a.name][(size, mode, op)] = {"warm": s}
                log(f"  {a.name:14s} {op.upper():3s} {size_label(size):>7s} {mode:6s} warm {s['mb_s']:8.0f} MB/s "
                    f"{s['items_s']:9.0f} values/s  p50 {s['p50_ms']:7.3f} ms  cpu/req client "
                    f"{s['client_cpu_us']:6.0f} us server {s['server_cpu_us']:6.0f} us")
            if not cold:
                continue
            # the systems take turns run by run, as the warm passes do: a burst of the machine's
            # neighbours falls on one run of each, not on every run of one system
            got: dict = {a.name: [] for a in adapters}
            for _ in range(cold_runs):
                for a in adapters:
                    if got[a.name] is None:
                        continue                # it failed once: skipped from then on
                    try:
                        got[a.name].append(cold_case(a.name, a.info, size, mode, op))
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:
                        log(f"  {a.name:14s} cold: {exc}")
                        got[a.name] = None
            for a in adapters:
                if not got[a.name]:
                    continue
                c = max(got[a.name], key=lambda s: s["mb_s"])
                c["runs"] = [s["mb_s"] for s in got[a.name]]
                results[a.name][(size, mode, op)]["cold"] = c
                log(f"  {a.name:14s} {op.upper():3s} {size_label(size):>7s} {mode:6s} cold {c['mb_s']:8.0f} MB/s "
                    f"{c['items_s']:9.0f} values/s")
        for a in adapters:
            a.clear(keys)
    return results


def run_floor(adapters, log):
    """The round-trip floor: single GETs of a 64-byte value (what is left is the trip through
    both processes and the kernel).  Returns {name: summary}."""
    out = {}
    count = BATCH_MIN
    values = _values(FLOOR_SIZE, count)
    keys = [f"floor:{i}" for i in range(count)]
    for a in adapters:
        a.prepare(FLOOR_SIZE)
        a.clear(keys)
        for k, v in zip(keys, values):
            a.stage([v])
            a.put(k, v)
        passes = []
        for _ in range(2):                       # the first pass warms up
            p = Pass(a.server_pids)
            with p.cpu():
                for i in range(FLOOR_REQUESTS):
                    got = p.timed(lambda: a.get(keys[i % count]), FLOOR_SIZE)
                    _check(got, values[i % count], a.name, keys[i % count])
            passes.append(p)
        a.clear(keys)
        s = out[a.name] = _summary(passes[1:], FLOOR_SIZE)
        log(f"  {a.name:14s} GET  {FLOOR_SIZE:4d} B  single  p50 {s['p50_ms']:7.3f} ms  p99 {s['p99_ms']:7.3f} ms")
    return out


# --------------------------------------------------------------------------- report

def versions():
    """What ran: redis-server, redis-py, hiredis, Mooncake, Python, numpy."""
    from importlib import metadata
    out = {"python": sys.version.split()[0]}
    for dist in ("redis", "hiredis", "mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine", "numpy"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[dist] = metadata.version(dist)
    exe = shutil.which("redis-server")
    if exe:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out["redis-server"] = subprocess.run([exe, "--version"], capture_output=True, text=True,
                                                 timeout=10).stdout.split()[2].removeprefix("v=")
    from quillcache.net import LOOPBACK_CONGESTION, system_congestion
    out["tcp congestion"] = system_congestion() or "unknown"   # every connection's but quillcached's same-host ones
    qc = LOOPBACK_CONGESTION if QC_LOOPBACK_CONGESTION is None else QC_LOOPBACK_CONGESTION
    out["quillcache loopback congestion"] = qc or "the system's"
    from quillcache.client.calls import DEFAULT_SPIN_US
    out["quillcache client spin_us"] = f"{DEFAULT_SPIN_US if QC_SPIN_US is None else QC_SPIN_US:g}"
    with contextlib.suppress(ImportError):
        from redis.utils import HIREDIS_AVAILABLE
        out["redis-py parser"] = "hiredis" if HIREDIS_AVAILABLE else "pure Python (pip install hiredis)"
    return out


def size_label(n):
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def _fmt(s, key="mb_s"):
    return "-" if s is None else f"{s[key]:.0f}"


def render_table(results, names, sizes):
    lines = ["| system | op | size | mode | warm MB/s | warm values/s | p50 MB/s | cold MB/s | cold values/s | "
             "p50 ms | p99 ms | client CPU us/req | server CPU us/req |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for size in sizes:
        for mode, op in CASES:
            for name in names:
                r = results.get(name, {}).get((size, mode, op))
                if r is None:
                    continue
                w, c = r["warm"], r.get("cold")
                lines.append(f"| {name} | {op.upper()} | {size_label(size)} | {mode} | {_fmt(w)} | {_fmt(w, 'items_s')} | "
                             f"{_fmt(w, 'p50_mb_s')} | "
                             f"{_fmt(c)} | {_fmt(c, 'items_s')} | {w['p50_ms']:.3f} | {w['p99_ms']:.3f} | "
                             f"{w['client_cpu_us']:.0f} | {w['server_cpu_us']:.0f} |")
    return "\n".join(lines)


def _ratio(mine, other, key="mb_s"):
    if mine is None or other is None or not other.get(key):
        return "-"
    return f"{mine[key] / other[key]:.2f}x"


def render_ratios(results, ours, peers, sizes):
    """Each of ``ours`` against each of ``peers`` (one API class), warm and cold."""
    ours = [n for n in ours if n in results]
    peers = [n for n in peers if n in results]
    pairs = [(o, p) for o in ours for p in peers]
    if not pairs:
        return ""
    lines = ["| op | size | mode | " + " | ".join(f"{o} vs {p} warm | p50 | cold" for o, p in pairs) + " |",
             "|---|---:|---|" + "---:|---:|---:|" * len(pairs)]
    for size in sizes:
        for mode, op in CASES:
            cells = []
            for o, p in pairs:
                a, b = results[o].get((size, mode, op)), results[p].get((size, mode, op))
                cells.append(_ratio(a and a["warm"], b and b["warm"]))
                cells.append(_ratio(a and a["warm"], b and b["warm"], "p50_mb_s"))
                cells.append(_ratio(a and a.get("cold"), b and b.get("cold")))
            lines.append(f"| {op.upper()} | {size_label(size)} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_get_vs_get_into(results, sizes):
    """QuillCache's bytes ``get`` against its ``get_into`` (single GET, warm, same run)."""
    a, b = results.get("quillcache"), results.get("quillcache-zc")
    if not a or not b:
        return ""
    lines = ["| size | get() MB/s | get_into MB/s | get() / get_into | p50: get() / get_into |",
             "|---:|---:|---:|---:|---:|"]
    for size in sizes:
        x, y = a.get((size, "single", "get")), b.get((size, "single", "get"))
        if x and y:
            x, y = x["warm"], y["warm"]
            lines.append(f"| {size_label(size)} | {x['mb_s']:.0f} | {y['mb_s']:.0f} | {x['mb_s'] / y['mb_s']:.2f} | "
                         f"{x['p50_mb_s'] / y['p50_mb_s']:.2f} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main

def _start(kind, workdir, log, tries=3):
    """Start a server; on a loaded machine a start can miss its deadline: try again."""
    cls = {"quillcache": QuillCacheServer, "redis": RedisServer, "mooncake": MooncakeCluster}[kind]
    for attempt in range(1, tries + 1):
        try:
            return cls(workdir)
        except RuntimeError as exc:
            if attempt == tries:
                raise
            log(f"{kind}: {exc}; trying again")
    raise AssertionError("unreachable")


def parse_sizes(text):
    out = []
    for part in text.split(","):
        part = part.strip().upper()
        mult = MiB if part.endswith("M") else KiB if part.endswith("K") else 1
        out.append(int(part.rstrip("MK")) * mult)
    return tuple(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {', '.join(SYSTEMS)}")
    ap.add_argument("--sizes", default="1K,16K,64K,256K,4M", help="value sizes (K = KiB, M = MiB)")
    ap.add_argument("--rounds", type=int, default=5, help="timed warm passes per case (the best is reported)")
    ap.add_argument("--no-cold", dest="cold", action="store_false", help="skip the fresh-process passes")
    ap.add_argument("--cold-runs", type=int, default=3,
                    help="fresh client processes per cold case, one after another (the best is reported)")
    ap.add_argument("--floor", action="store_true", help="also measure the 64-byte GET round-trip floor")
    ap.add_argument("--qc-loopback-congestion", metavar="NAME",
                    help='quillcached\'s [node] loopback_congestion ("" = the system\'s; default: the node\'s, reno)')
    ap.add_argument("--qc-spin-us", type=float, metavar="US",
                    help="the QuillCache clients' spin_us (0 = sleep at once; default: the client's, "
                         "docs/protocol.md \"Busy-polling receives\")")
    ap.add_argument("--json-out", type=out_path, help="write the results as JSON here")
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="let the scheduler place server and client (default: separate CPUs)")
    ap.add_argument("--mooncake-lend", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--cold-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.mooncake_lend:
        _mooncake_lend(*args.mooncake_lend)
        return 0
    if args.cold_worker:
        _cold_worker(args.cold_worker)
        return 0
    if not 1 <= args.rounds <= 1000:
        ap.error("--rounds must be in 1..1000")
    wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SYSTEMS]
    if unknown:
        ap.error(f"unknown system(s): {', '.join(unknown)}")
    sizes = parse_sizes(args.sizes)

    def log(msg):
        print(msg, flush=True)

    global SERVER_CPUS, QC_LOOPBACK_CONGESTION, QC_SPIN_US
    QC_LOOPBACK_CONGESTION = args.qc_loopback_congestion
    QC_SPIN_US = args.qc_spin_us
    SERVER_CPUS, client_cpus = _placement(args.pin)
    if client_cpus is not None:
        os.sched_setaffinity(0, client_cpus)
        log(f"placement: servers on CPUs {sorted(SERVER_CPUS)}, clients on CPUs {sorted(client_cpus)}")
    else:
        log("placement: left to the scheduler")
    vers = versions()
    log("versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()))

    workdir = tempfile.mkdtemp(prefix="qc-vs-peers-")
    servers = {}
    adapters = []
    floor = {}
    try:
        for name in wanted:
            kind = SERVER_OF[name]
            try:
                if kind not in servers:
                    servers[kind] = _start(kind, workdir, log)
                a = ADAPTERS[name](servers[kind].info)
                a.info = servers[kind].info
                adapters.append(a)
            except Exception as exc:  # a peer that cannot start is skipped, not fatal
                log(f"skipping {name}: {exc}")
        log(f"running: {', '.join(a.name for a in adapters)}; load average {os.getloadavg()[0]:.2f} "
            f"on {os.cpu_count()} CPUs")
        if args.floor:
            floor = run_floor(adapters, log)
        results = run_workload(adapters, sizes, args.rounds, args.cold, log, args.cold_runs)
        log(f"load average at the end: {os.getloadavg()[0]:.2f}")
    finally:
        for a in adapters:
            with contextlib.suppress(Exception):
                a.close()
        for srv in servers.values():
            with contextlib.suppress(Exception):
                srv.close()
        shutil.rmtree(workdir, ignore_errors=True)

    ran = [a.name for a in adapters]
    for cls, names in CLASSES.items():
        names = [n for n in names if n in ran]
        if not names:
            continue
        log("")
        log(f"## {cls} API" + ("" if cls == "bytes" else " (Redis has no zero-copy API: no row)"))
        log("")
        log(render_table(results, names, sizes))
        ours = [n for n in names if n.startswith("quillcache")]
        ratios = render_ratios(results, ours, [n for n in names if n not in ours], sizes)
        if ratios:
            log("")
            log(ratios)
    g = render_get_vs_get_into(results, sizes)
    if g:
        log("")
        log("## QuillCache get() (bytes) against get_into (a preallocated buffer), single GET, warm")
        log("")
        log(g)
    if floor:
        log("")
        log("round-trip floor: " + ", ".join(f"{n} p50 {s['p50_ms']:.3f} ms" for n, s in floor.items()))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            {"versions": vers, "floor": floor,
             "results": {name: [{"size": k[0], "mode": k[1], "op": k[2], **v} for k, v in r.items()]
                         for name, r in results.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
