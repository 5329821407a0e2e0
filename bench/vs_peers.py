"""QuillCache against Redis 7 and Mooncake Store: one client, one server process, loopback TCP.

The same workload for each system, run in turn in one invocation: PUT then GET of 256 KiB and
4 MiB values, one value per request (single) and 16 per request (batch), reporting MB/s and
the p50/p99 latency of one request.  Every GET is checked byte for byte, outside the timed call.

    .venv/bin/python bench/vs_peers.py [--systems quillcache,redis,mooncake,mooncake-zc]
        [--rounds 6] [--json-out results.json] [--plot docs/benchmarks.png]

Servers, each started here on free loopback ports and stopped at the end:
  quillcache   quillcached (the real daemon, DRAM tier) + quillcache.client.Client;
               single GET lands in a preallocated buffer (get_into); batch GET in slices of
               one preallocated buffer (get_many_into)
  redis        redis-server --save '' --appendonly no; redis-py with hiredis (pipelines for batch)
  mooncake     mooncake_master (with its HTTP metadata server) + a separate process lending a
               segment, MC_TCP_BIND_ADDRESS=127.0.0.1, protocol tcp; put/get_batch (bytes API)
  mooncake-zc  the same servers, zero-copy API: put_from/batch_put_from and get_into/
               batch_get_into on registered buffers
A system that cannot start is skipped with a message.

CPU placement: with two or more CPUs, every server process (and its threads) runs on the first
half of the CPUs this process may use and the client on the other half (``--no-pin`` leaves it
to the scheduler).  Without it, the kernel's wake-affine placement on a small machine often
moves the client onto the server's CPU after a reply, and the two then take turns on one core:
on the 2-CPU development machine this alone swings a 256 KiB GET between 1200 and 2500 MB/s from
run to run, for every system alike.  The same placement applies to each system.  MB/s = bytes moved / time inside the
request calls (MiB = 2^20 bytes; "MB/s" here is MiB/s).

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

KiB = 1 << 10
MiB = 1 << 20
SIZES = (256 * KiB, 4 * MiB)
BATCH = 16                     # values per request in the batch runs
WORKING_SET = 64 * MiB         # bytes: distinct values per size (keys = WORKING_SET // size, >= BATCH)
FLOOR_SIZE = 64               # bytes: the value of the round-trip floor measurement
FLOOR_REQUESTS = 3000          # timed single GETs of it per system
START_TIMEOUT = 30.0           # seconds: a server that does not answer by then is skipped
HERE = Path(__file__).resolve().parent
VENV_BIN = Path(sys.executable).parent
SERVER_CPUS = None             # set by main(): the CPUs server processes are started on (None: any)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class Recorder:
    """Latency of each request, bytes moved, and the CPU both sides spent meanwhile: the CPU
    split says where the time goes on a machine too busy for wall-clock figures."""

    def __init__(self, server_pids=()):
        self.lat = []
        self.nbytes = 0
        self.server_pids = server_pids
        self.client_cpu = 0.0
        self.server_cpu = 0.0

    def timed(self, fn, nbytes):
        c0 = time.process_time()          # the client's CPU inside the call only (not staging
        t0 = time.perf_counter()          # or checking)
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

    def summary(self):
        import numpy as np
        lat = np.array(self.lat)
        total = float(lat.sum())
        n = len(lat)
        return {"mb_s": self.nbytes / MiB / total if total else 0.0,
                "p50_ms": float(np.percentile(lat, 50) * 1e3), "p99_ms": float(np.percentile(lat, 99) * 1e3),
                "requests": n, "bytes": self.nbytes,
                "client_cpu_us": self.client_cpu / n * 1e6, "server_cpu_us": self.server_cpu / n * 1e6}


def run_case(adapter, keys, values, size, mode, op, rounds):
    """``rounds`` timed passes (after one untimed) of one (size, mode, op) over the working set."""
    step = 1 if mode == "single" else BATCH
    groups = [list(range(i, i + step)) for i in range(0, len(keys) - step + 1, step)]
    rec = Recorder(adapter.server_pids)
    for r in range(rounds + 1):          # round 0 warms up and is not recorded
        target = rec if r else Recorder()
        if op == "put":
            # every PUT stores a new key (Mooncake objects are immutable: a put of an existing
            # key is refused without moving the bytes); untimed
            adapter.clear(keys)
        with target.cpu():
            _pass(adapter, target, groups, keys, values, size, step, op)
    return rec.summary()


def _pass(adapter, target, groups, keys, values, size, step, op):
    for g in groups:
        ks = [keys[i] for i in g]
        if op == "put":
            vs = [values[i] for i in g]
            adapter.stage(vs)       # untimed (only zero-copy APIs need it)
            if step == 1:
                target.timed(lambda: adapter.put(ks[0], vs[0]), size)
            else:
                target.timed(lambda: adapter.put_many(ks, vs), size * step)
        elif step == 1:
            got = target.timed(lambda: adapter.get(ks[0]), size)
            _check(got, values[g[0]], adapter.name, ks[0])
        else:
            got = target.timed(lambda: adapter.get_many(ks), size * step)
            for i, v in zip(g, got):
                _check(v, values[i], adapter.name, keys[i])


def run_workload(adapters, rounds, log):
    """Every case on every system, the systems interleaved case by case (so that machine noise
    spreads over all of them); returns {name: {(size, mode, op): summary}}."""
    results = {a.name: {} for a in adapters}
    for size in SIZES:
        count = max(BATCH, WORKING_SET // size)
        values = _values(size, count)
        keys = [f"bench:{size}:{i}" for i in range(count)]
        for a in adapters:
            a.prepare(size, count)
        for mode in ("single", "batch"):
            for op in ("put", "get"):
                for a in adapters:
                    s = results[a.name][(size, mode, op)] = run_case(a, keys, values, size, mode, op, rounds)
                    log(f"  {a.name:12s} {op.upper():3s} {size // KiB:5d} KiB {mode:6s} "
                        f"{s['mb_s']:8.0f} MB/s  p50 {s['p50_ms']:7.3f} ms  p99 {s['p99_ms']:7.3f} ms  "
                        f"cpu/req client {s['client_cpu_us']:6.0f} us server {s['server_cpu_us']:6.0f} us")
        for a in adapters:
            a.clear(keys)
    return results


def run_floor(adapters, log):
    """The round-trip floor: single GETs of a 64-byte value, where the bytes cost nothing and
    what is left is the request's trip through both processes and the kernel (on a VM, mostly
    the wake-up of an idle CPU).  It says how much of a 256 KiB GET's latency any system here
    could win back.  Returns {name: summary}."""
    out = {}
    count = BATCH
    values = _values(FLOOR_SIZE, count)
    keys = [f"floor:{i}" for i in range(count)]
    for a in adapters:
        a.prepare(FLOOR_SIZE, count)
        a.clear(keys)
        for k, v in zip(keys, values):
            a.stage([v])
            a.put(k, v)
        rec = Recorder(a.server_pids)
        for r in range(2):                       # the first pass warms up
            target = rec if r else Recorder()
            with target.cpu():
                for i in range(FLOOR_REQUESTS):
                    got = target.timed(lambda: a.get(keys[i % count]), FLOOR_SIZE)
                    _check(got, values[i % count], a.name, keys[i % count])
        a.clear(keys)
        s = out[a.name] = rec.summary()
        log(f"  {a.name:12s} GET  {FLOOR_SIZE:4d} B  single  p50 {s['p50_ms']:7.3f} ms  p99 {s['p99_ms']:7.3f} ms  "
            f"cpu/req client {s['client_cpu_us']:6.0f} us server {s['server_cpu_us']:6.0f} us")
    return out


def _check(got, want, name, key):
    # One vectorised compare for every system: ``memoryview == bytes`` compares item by item
    # (~1 GB/s, 0.3 ms a 256 KiB value) while ``bytes == bytes`` is a memcmp, so the plain
    # compare gave the systems that return views (quillcache, mooncake-zc) a long idle gap
    # before each next request, which a VM's CPU pays for in wake-up latency.
    import numpy as np
    if len(got) != len(want) or not np.array_equal(np.frombuffer(got, np.uint8), np.frombuffer(want, np.uint8)):
        raise AssertionError(f"{name}: {key}: read back {len(got)} bytes that differ from what was put")


# --------------------------------------------------------------------------- QuillCache

class QuillCacheAdapter:
    name = "quillcache"

    def __init__(self, workdir):
        port, mport = _free_port(), _free_port()
        cfg = Path(workdir) / "quillcache.toml"
        cfg.write_text(f'[node]\nlisten = "127.0.0.1:{port}"\ndata_dir = "{workdir}/qc"\n'
                       f'[store]\ndram = "2GiB"\n[metrics]\nlisten = "127.0.0.1:{mport}"\n'
                       f'[ssd]\nenabled = false\n')   # DRAM only, like the peers
        self.proc = _server_popen([str(VENV_BIN / "quillcached"), "--config", str(cfg)],
                                     stdout=subprocess.DEVNULL, stderr=open(Path(workdir) / "qc.log", "wb"))
        if not _wait_port(port, self.proc):
            _stop(self.proc)
            raise RuntimeError(f"quillcached did not start (see {workdir}/qc.log)")
        from quillcache.client import Client
        from quillcache.model import KvBlockKey
        self._Key = KvBlockKey
        self.client = Client(f"127.0.0.1:{port}", timeout=60.0, client_name="vs_peers")
        self._keys = {}
        self.server_pids = [self.proc.pid]

    def _key(self, name):
        k = self._keys.get(name)
        if k is None:
            k = self._keys[name] = self._Key("bench-model", "bench-tok", None, self.client.tenant or "default",
                                             "root", name, 0, 64)
        return k

    def stage(self, vs):
        pass

    def prepare(self, size, count):
        self.buf = bytearray(size * BATCH)
        self.mv = memoryview(self.buf)
        self.size = size

    def put(self, k, v):
        self.client.put(self._key(k), v)

    def put_many(self, ks, vs):
        self.client.put_many([(self._key(k), v) for k, v in zip(ks, vs)])

    def get(self, k):
        n = self.client.get_into(self._key(k), self.mv[:self.size])
        return self.mv[:n]

    def get_many(self, ks):
        # GET_MANY straight into slices of one preallocated buffer, as Mooncake's batch_get_into
        size = self.size
        views = [self.mv[i * size:(i + 1) * size] for i in range(len(ks))]
        ns = self.client.get_many_into([self._key(k) for k in ks], views)
        return [v[:n] for v, n in zip(views, ns)]

    def clear(self, keys):
        for k in keys:
            self.client.remove(self._key(k))

    def close(self):
        with contextlib.suppress(Exception):
            self.client.close()
        _stop(self.proc)


# --------------------------------------------------------------------------- Redis

class RedisAdapter:
    name = "redis"

    def __init__(self, workdir):
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        import redis
        port = _free_port()
        self.proc = _server_popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", workdir, "--protected-mode", "yes"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not _wait_port(port, self.proc):
            _stop(self.proc)
            raise RuntimeError("redis-server did not start")
        self.server_pids = [self.proc.pid]
        self.r = redis.Redis(host="127.0.0.1", port=port)
        self.r.ping()
        from redis.utils import HIREDIS_AVAILABLE
        if not HIREDIS_AVAILABLE:
            print("redis: hiredis is not installed: the pure-Python parser is slower "
                  "(pip install hiredis)", flush=True)

    def prepare(self, size, count):
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
        return self.r.mget(ks)

    def clear(self, keys):
        self.r.delete(*keys)

    def close(self):
        with contextlib.suppress(Exception):
            self.r.close()
        _stop(self.proc)


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

    def client(self):
        from mooncake.store import MooncakeDistributedStore
        store = MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", self.metadata, 0, self.LOCAL_BUFFER, "tcp", "", self.master_addr)
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

    def __init__(self, cluster):
        self.s = cluster.client()
        self.server_pids = [cluster.master.pid, cluster.lender.pid]

    def prepare(self, size, count):
        pass

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

    def __init__(self, cluster):
        super().__init__(cluster)
        self.src = None
        self.dst = None

    def prepare(self, size, count):
        import numpy as np
        for arr in (self.src, self.dst):
            if arr is not None:
                self.s.unregister_buffer(arr.ctypes.data)
        self.size = size
        self.src = np.empty(size * BATCH, dtype=np.uint8)
        self.dst = np.empty(size * BATCH, dtype=np.uint8)
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


# --------------------------------------------------------------------------- report

def render_markdown(results, order):
    lines = ["| system | op | size | mode | MB/s | p50 ms | p99 ms | client CPU us/req | server CPU us/req |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for size in SIZES:
        for mode in ("single", "batch"):
            for op in ("get", "put"):
                for name in order:
                    s = results.get(name, {}).get((size, mode, op))
                    if s is None:
                        continue
                    lines.append(f"| {name} | {op.upper()} | {_size(size)} | {mode} | {s['mb_s']:.0f} | "
                                 f"{s['p50_ms']:.3f} | {s['p99_ms']:.3f} | {s['client_cpu_us']:.0f} | "
                                 f"{s['server_cpu_us']:.0f} |")
    return "\n".join(lines)


def render_floor(floor, order):
    lines = [f"| system | round-trip floor: {FLOOR_SIZE} B GET p50 ms | p99 ms | client CPU us/req | "
             "server CPU us/req |", "|---|---:|---:|---:|---:|"]
    for name in order:
        s = floor.get(name)
        if s is not None:
            lines.append(f"| {name} | {s['p50_ms']:.3f} | {s['p99_ms']:.3f} | {s['client_cpu_us']:.0f} | "
                         f"{s['server_cpu_us']:.0f} |")
    return "\n".join(lines)


def render_ratios(results):
    qc = results.get("quillcache")
    if not qc:
        return ""
    peers = [n for n in results if n != "quillcache"]
    lines = ["| op | size | mode | " + " | ".join(f"vs {p} (MB/s ratio)" for p in peers) + " |",
             "|---|---:|---|" + "---:|" * len(peers)]
    for size in SIZES:
        for mode in ("single", "batch"):
            for op in ("get", "put"):
                mine = qc.get((size, mode, op))
                if mine is None:
                    continue
                cells = []
                for p in peers:
                    other = results[p].get((size, mode, op))
                    cells.append(f"{mine['mb_s'] / other['mb_s']:.2f}x" if other and other["mb_s"] else "-")
                lines.append(f"| {op.upper()} | {_size(size)} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _size(n):
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def plot(results, order, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    cases = [(size, mode, op) for size in SIZES for op in ("get", "put") for mode in ("single", "batch")]
    labels = [f"{op.upper()} {_size(size)}\n{mode}" for size, mode, op in cases]
    names = [n for n in order if n in results]
    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.8 / max(1, len(names))
    x = np.arange(len(cases))
    for j, name in enumerate(names):
        vals = [results[name].get(c, {}).get("mb_s", 0.0) for c in cases]
        ax.bar(x + (j - (len(names) - 1) / 2) * width, vals, width, label=name)
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("MB/s (higher is better)")
    ax.set_title("One client, one server process, loopback TCP (bench/vs_peers.py)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --------------------------------------------------------------------------- main

SYSTEMS = ("quillcache", "redis", "mooncake", "mooncake-zc")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"comma-separated, from {', '.join(SYSTEMS)}")
    ap.add_argument("--rounds", type=int, default=6, help="timed passes over the working set per case")
    ap.add_argument("--json-out", help="write the results as JSON here")
    ap.add_argument("--plot", help="write a PNG bar chart here (matplotlib)")
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="let the scheduler place server and client (default: separate CPUs)")
    ap.add_argument("--mooncake-lend", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.mooncake_lend:
        _mooncake_lend(*args.mooncake_lend)
        return 0
    if not 1 <= args.rounds <= 1000:
        ap.error("--rounds must be in 1..1000")
    wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SYSTEMS]
    if unknown:
        ap.error(f"unknown system(s): {', '.join(unknown)}")

    def log(msg):
        print(msg, flush=True)

    global SERVER_CPUS
    SERVER_CPUS, client_cpus = _placement(args.pin)
    if client_cpus is not None:
        os.sched_setaffinity(0, client_cpus)
        log(f"placement: servers on CPUs {sorted(SERVER_CPUS)}, client on CPUs {sorted(client_cpus)}")
    else:
        log("placement: left to the scheduler")

    workdir = tempfile.mkdtemp(prefix="qc-vs-peers-")
    cluster = None
    adapters = []
    try:
        for name in wanted:
            try:
                if name == "quillcache":
                    adapters.append(QuillCacheAdapter(workdir))
                elif name == "redis":
                    adapters.append(RedisAdapter(workdir))
                else:
                    if cluster is None:
                        cluster = MooncakeCluster(workdir)
                    adapters.append((MooncakeAdapter if name == "mooncake" else MooncakeZeroCopyAdapter)(cluster))
            except Exception as exc:  # a peer that cannot start is skipped, not fatal
                log(f"skipping {name}: {exc}")
        log(f"running: {', '.join(a.name for a in adapters)}; load average {os.getloadavg()[0]:.2f} "
            f"on {os.cpu_count()} CPUs")
        floor = run_floor(adapters, log)
        results = run_workload(adapters, args.rounds, log)
        log(f"load average at the end: {os.getloadavg()[0]:.2f}")
    finally:
        for a in adapters:
            with contextlib.suppress(Exception):
                a.close()
        if cluster is not None:
            cluster.close()
        shutil.rmtree(workdir, ignore_errors=True)

    log("")
    log(render_floor(floor, wanted))
    log("")
    log(render_markdown(results, wanted))
    ratios = render_ratios(results)
    if ratios:
        log("")
        log(ratios)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            {name: [{"size": k[0], "mode": k[1], "op": k[2], **v} for k, v in r.items()]
             + ([{"size": FLOOR_SIZE, "mode": "floor", "op": "get", **floor[name]}] if name in floor else [])
             for name, r in results.items()}, indent=2))
    if args.plot and results:
        plot(results, wanted, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
