"""Client.get_into against a live daemon: this tree's client against the client of another
revision (default ``main``), in the same process run, interleaved round by round.

    .venv/bin/python bench/get_into_paths.py [--before main] [--n 2000] [--rounds 7]

The other revision's ``client.py`` is loaded from git and runs on this tree's protocol
package, so the ratio is the client's own code path (both talk to the same daemon).  Also
times the server's GET body parse: the codec's ``decode_key_body`` against the hand-written
slice it replaced.  Prints microseconds per call and the ratio after/before (< 1 is faster).
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
import types
from pathlib import Path

import numpy as np

from quillcache import KvBlockKey
from quillcache import client as client_now
from quillcache._native.codec import decode_key_body
from quillcache.model import encode_key

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests._support.ports
from tests._support.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
SIZES = (4 << 10, 256 << 10)


def start_daemon(tmp: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    conf = tmp / "quillcache.toml"
    conf.write_text(f"""
[node]
listen = "127.0.0.1:{port}"
data_dir = "{tmp / 'data'}"
log_level = "warning"
[store]
dram = "64MiB"
[ssd]
enabled = false
[metrics]
listen = "127.0.0.1:{free_port()}"
""")
    exe = str(Path(sys.executable).with_name("quillcached"))
    proc = subprocess.Popen([exe, "--config", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"quillcached exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("quillcached did not listen within 30 s")


def load_client(rev: str) -> types.ModuleType:
    src = subprocess.check_output(["git", "show", f"{rev}:src/quillcache/client.py"], cwd=ROOT)
    mod = types.ModuleType(f"quillcache_client_{rev}")
    mod.__file__ = f"<{rev}:src/quillcache/client.py>"
    sys.modules[mod.__name__] = mod
    exec(compile(src, mod.__file__, "exec"), mod.__dict__)
    return mod


def time_get_into(mod, addr: str, key: KvBlockKey, buf: np.ndarray, n: int) -> tuple[float, float]:
    """(wall, client CPU) microseconds per get_into over ``n`` calls on a fresh connection
    (after 200 warm-ups).  The client's CPU time is the part its code path decides; the wall
    time also holds the daemon and the scheduler of a shared machine."""
    with mod.Client(addr) as c:
        get_into = c.get_into
        for _ in range(200):
            get_into(key, buf)
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(n):
            get_into(key, buf)
        return (time.perf_counter() - t0) / n * 1e6, (time.thread_time() - c0) / n * 1e6


def server_parse(raw_key: bytes, max_key: int, n: int) -> tuple[float, float]:
    """ns per GET body parse: the old hand-written slice, the codec call."""
    body = len(raw_key).to_bytes(2, "little") + raw_key

    def by_hand():
        hdr = body
        k = len(hdr) - 2
        if 0 < k <= max_key and hdr[0] | hdr[1] << 8 == k:
            return hdr[2:]
        raise ValueError

    def by_codec():
        return decode_key_body(body, max_key)

    assert by_hand() == by_codec() == raw_key
    hand = min(timeit.repeat(by_hand, number=n, repeat=5)) / n * 1e9
    codec = min(timeit.repeat(by_codec, number=n, repeat=5)) / n * 1e9
    return hand, codec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="main", help="git revision of the baseline client.py")
    ap.add_argument("--n", type=int, default=2000, help="get_into calls per measurement")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median reported)")
    args = ap.parse_args()
    before = load_client(args.before)
    key = KvBlockKey("m", "tok", None, "t0", "p", "b1", block_index=1)
    with tempfile.TemporaryDirectory() as tmp:
        proc, addr = start_daemon(Path(tmp))
        try:
            print(f"get_into, {args.n} calls x {args.rounds} rounds, this tree vs {args.before} "
                  f"(load {os.getloadavg()[0]:.1f})")
            print(f"{'size':>8} {'wall ' + args.before:>14} {'wall now':>9} {'now/before':>10}"
                  f" {'cpu ' + args.before:>13} {'cpu now':>8} {'now/before':>10}   (us per call)")
            for size in SIZES:
                data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
                buf = np.empty(size, dtype=np.uint8)
                with client_now.Client(addr) as c:
                    c.put(key, data)
                old, new = [], []
                for r in range(args.rounds):
                    pair = ((before, old), (client_now, new)) if r % 2 == 0 else ((client_now, new), (before, old))
                    for mod, out in pair:
                        out.append(time_get_into(mod, addr, key, buf, args.n))
                assert np.array_equal(buf, data)
                wo, wn = (statistics.median(w for w, _ in xs) for xs in (old, new))
                co, cn = (statistics.median(c for _, c in xs) for xs in (old, new))
                print(f"{size >> 10:>6}Ki {wo:>14.2f} {wn:>9.2f} {wn / wo:>10.3f} {co:>13.2f} {cn:>8.2f} {cn / co:>10.3f}")
        finally:
            proc.terminate()
            proc.wait(30)
    hand, codec = server_parse(encode_key(key), 4096, 200_000)
    print(f"server GET body parse: by hand {hand:.0f} ns, codec decode_key_body {codec:.0f} ns, "
          f"codec/hand {codec / hand:.3f}")


if __name__ == "__main__":
    main()
