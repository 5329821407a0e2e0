"""Memory per resident block beyond its bytes: a real quillcached against redis-server, the
same N values put into each over loopback, in one run.

    python bench/node_memory.py [--blocks 1000000] [--size 1024] [--batch 500]

For each server: its memory before (after one warm-up put) and after N puts of ``--size``
bytes (``put_many``/pipelined SETs of ``--batch``).  QuillCache's node is DRAM only (like
the peers in bench/vs_peers.py); its memory is RssAnon (the Python heap: the key objects,
the residency index, the eviction order, the per-block records) plus RssShmem (the arena's
touched pages: the values and the allocator's rounding to its unit).  Redis's is RSS (and
INFO's used_memory, its own count); its keys are loaded with redis-py pipelines, or where
redis-py is not installed with ``redis-cli --pipe`` (the memory does not depend on the
client that sent them; the sets/s then are redis-cli's, not comparable with redis-py's).
Per block beyond its bytes = (growth - N * size) / N.
Target: <= 512 B at 1 M blocks.  Also prints what the node's INFO says about its store.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests._support.ports
from tests._support.ports import free_port as _free_port

HERE = Path(__file__).resolve().parent
VENV_BIN = Path(sys.executable).parent
START_TIMEOUT = 30.0        # seconds


def _wait_port(port, proc):
    import socket
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def _status(pid):
    """RssAnon, RssFile, RssShmem of ``pid`` in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("RssAnon", "RssFile", "RssShmem", "VmRSS"):
                out[name] = int(rest.split()[0]) * 1024
    return out


def _values(n, size):
    """``n`` distinct values of ``size`` bytes, made lazily from one random block."""
    base = os.urandom(size)
    for i in range(n):
        yield i.to_bytes(8, "little") + base[8:]


def quillcache(args, workdir):
    from quillcache.client import Client
    from quillcache.model import KvBlockKey
    port, mport = _free_port(), _free_port()
    dram = max(1 << 30, int(args.blocks * args.size * 1.5))        # under the high watermark
    cfg = Path(workdir) / "qc.toml"
    cfg.write_text(f'[node]\nlisten = "127.0.0.1:{port}"\ndata_dir = "{workdir}/qc"\n'
                   f'[store]\ndram = {dram}\n[metrics]\nlisten = "127.0.0.1:{mport}"\n[ssd]\nenabled = false\n')
    proc = subprocess.Popen([str(VENV_BIN / "quillcached"), "--config", str(cfg)], stdout=subprocess.DEVNULL,
                            stderr=open(Path(workdir) / "qc.log", "wb"))
    try:
        if not _wait_port(port, proc):
            raise RuntimeError(f"quillcached did not start (see {workdir}/qc.log)")
        with Client(f"127.0.0.1:{port}", timeout=120) as c:
            tenant = c.tenant or "default"

            def key(i):
                return KvBlockKey("llama-3-8b", "tok-a", None, tenant, "p%07d" % (i // 100), "b%09d" % i, i % 100)

            c.put(key(args.blocks), b"w" * args.size)     # warm-up: everything lazily made exists
            before = _status(proc.pid)
            t0 = time.perf_counter()
            batch = []
            for i, v in enumerate(_values(args.blocks, args.size)):
                batch.append((key(i), v))
                if len(batch) == args.batch:
                    c.put_many(batch)
                    batch = []
            if batch:
                c.put_many(batch)
            dt = time.perf_counter() - t0
            after = _status(proc.pid)
            info = c.info("Store").get("Store", {})
        anon = after["RssAnon"] - before["RssAnon"]
        shm = after["RssShmem"] - before["RssShmem"]
        return {"puts_s": args.blocks / dt, "anon": anon, "shmem": shm, "total": anon + shm, "info": info}
    finally:
        proc.terminate()
        proc.wait(30)


def _redis_key(i):
    return "llama-3-8b:tok-a:acme:p%07d:b%09d" % (i // 100, i)


def _redis_cli(port, *cmd):
    out = subprocess.run([shutil.which("redis-cli"), "-p", str(port), *cmd], check=True, capture_output=True)
    return out.stdout.decode()


def _used_memory(port):
    for line in _redis_cli(port, "info", "memory").splitlines():
        if line.startswith("used_memory:"):
            return int(line.split(":")[1])
    raise RuntimeError("redis INFO memory has no used_memory")


def _load_pipe(args, port):
    """The same SETs without redis-py: RESP commands streamed to ``redis-cli --pipe`` (Redis's
    mass-insertion tool).  Memory does not depend on the client that sent the keys."""
    proc = subprocess.Popen([shutil.which("redis-cli"), "-p", str(port), "--pipe"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    head = b"*3\r\n$3\r\nSET\r\n"
    chunk = []
    for i, v in enumerate(_values(args.blocks, args.size)):
        k = _redis_key(i).encode()
        chunk.append(b"%s$%d\r\n%s\r\n$%d\r\n%s\r\n" % (head, len(k), k, len(v), v))
        if len(chunk) == args.batch:
            proc.stdin.write(b"".join(chunk))
            chunk = []
    proc.stdin.write(b"".join(chunk))
    proc.stdin.close()
    out = proc.stdout.read().decode(errors="replace")
    if proc.wait() != 0 or "errors: 0" not in out:
        raise RuntimeError(f"redis-cli --pipe failed: {out.strip()}")


def redis(args, workdir):
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed")
    try:
        import redis as redis_py
    except ImportError:
        redis_py = None
        if shutil.which("redis-cli") is None:
            raise RuntimeError("neither redis-py nor redis-cli is installed") from None
    port = _free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if not _wait_port(port, proc):
            raise RuntimeError("redis-server did not start")
        if redis_py is None:
            _redis_cli(port, "set", "warm", "w" * args.size)
            before, used0 = _status(proc.pid), _used_memory(port)
            t0 = time.perf_counter()
            _load_pipe(args, port)
            dt = time.perf_counter() - t0
            after, used1 = _status(proc.pid), _used_memory(port)
            loader = "redis-cli --pipe"
        else:
            r = redis_py.Redis(port=port)
            r.set("warm", b"w" * args.size)
            before, used0 = _status(proc.pid), r.info("memory")["used_memory"]
            t0 = time.perf_counter()
            p = r.pipeline(transaction=False)
            for i, v in enumerate(_values(args.blocks, args.size)):
                p.set(_redis_key(i), v)
                if (i + 1) % args.batch == 0:
                    p.execute()
            p.execute()
            dt = time.perf_counter() - t0
            after, used1 = _status(proc.pid), r.info("memory")["used_memory"]
            r.close()
            loader = "redis-py pipelines"
        rss = after["VmRSS"] - before["VmRSS"]
        return {"puts_s": args.blocks / dt, "total": rss, "used_memory": used1 - used0, "loader": loader}
    finally:
        proc.terminate()
        proc.wait(30)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--size", type=int, default=1024, help="bytes per value")
    ap.add_argument("--batch", type=int, default=500, help="values per put_many / pipeline")
    ap.add_argument("--no-redis", dest="redis", action="store_false")
    args = ap.parse_args(argv)
    n, size = args.blocks, args.size
    workdir = tempfile.mkdtemp(prefix="qc-node-memory-")
    try:
        q = quillcache(args, workdir)
        print(f"quillcache: {n} blocks of {size} B, {q['puts_s']:.0f} puts/s; growth RssAnon {q['anon'] / 2**20:.0f} MiB "
              f"+ RssShmem {q['shmem'] / 2**20:.0f} MiB; beyond the bytes: "
              f"{(q['total'] - n * size) / n:.0f} B per block (heap {q['anon'] / n:.0f} B, arena rounding "
              f"{(q['shmem'] - n * size) / n:.0f} B)", flush=True)
        print("  node INFO Store: " + ", ".join(f"{k}:{v}" for k, v in q["info"].items()), flush=True)
        if args.redis:
            r = redis(args, workdir)
            print(f"redis:      {n} keys of {size} B ({r['loader']}), {r['puts_s']:.0f} sets/s; RSS growth {r['total'] / 2**20:.0f} MiB, "
                  f"beyond the bytes {(r['total'] - n * size) / n:.0f} B per key (used_memory: "
                  f"{(r['used_memory'] - n * size) / n:.0f} B per key)", flush=True)
            print(f"ratio (quillcache / redis, bytes beyond the value per block): "
                  f"{(q['total'] - n * size) / max(1, r['total'] - n * size):.2f}", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
