"""`quillctl bench`: a built-in load generator against one node.

One connection (the asyncio client, requests pipelined), --concurrency requests in flight,
for --duration; each request is a PUT with probability --mix, else a GET of a key that was
put.  Every block carries a 16-byte header (key number, version) and a body taken from one
random buffer at an offset derived from (key, version), so every byte a GET returns is
checked against what was put.  Prints ops/s, MB/s and p50/p99 latency; exits 70 (SOFTWARE)
if any byte read back was wrong.
"""
import asyncio
import json
import random
import struct
import sys
import time

import click

from quillcache.net import DEFAULT_ADDRESS, ConversionError
from quillcache.settings.convert import parse_byte_size
from quillcache.errors import NotFound, QuillCacheError

from quillcache_cli import exitcodes
from quillcache_cli.ctl_data import exit_code_for, fail
from quillcache_cli.params import cli_duration

MIN_BLOCK = 16                  # bytes: the (key, version) header every block carries
MAX_BLOCK = 64 << 20            # bytes: largest --block-size (the node's default max_block)
MAX_WORKING_SET = 1 << 30       # bytes: --keys x --block-size (what the node must hold)
MAX_DURATION = 3600.0           # seconds
MAX_CONCURRENCY = 256           # requests in flight (the protocol's default max_in_flight)
SHIFT_SPAN = 4096               # bytes: bodies start at one of this many offsets of the pattern
TICK = 0.1                      # seconds between progress bar updates
_HDR = struct.Struct("<QQ")     # key number, version


def _size(_ctx, _param, value):
    try:
        n = parse_byte_size(value)
    except ConversionError as exc:
        raise click.BadParameter(str(exc)) from None
    if not MIN_BLOCK <= n <= MAX_BLOCK:
        raise click.BadParameter(f"must be {MIN_BLOCK} bytes .. {MAX_BLOCK >> 20} MiB")
    return n


def _duration(_ctx, _param, value):
    s = cli_duration(value)
    if not 0 < s <= MAX_DURATION:
        raise click.BadParameter("must be more than 0 and at most 1h")
    return s


class Pattern:
    """What block (key, version) must hold: header + a slice of one random buffer."""

    def __init__(self, size: int, seed: int):
        import numpy as np
        self.np = np
        self.size = size
        rng = np.random.default_rng(seed)
        self.base = rng.integers(0, 256, size + SHIFT_SPAN, dtype=np.uint8)

    def offset(self, key: int, version: int) -> int:
        return (key * 7919 + version * 104729) % SHIFT_SPAN

    def fill(self, buf, key: int, version: int) -> None:
        _HDR.pack_into(buf, 0, key, version)
        off = self.offset(key, version)
        memoryview(buf)[_HDR.size:] = self.base[off:off + self.size - _HDR.size]

    def check(self, buf, key: int, max_version: int) -> bool:
        got_key, version = _HDR.unpack_from(buf, 0)
        if got_key != key or version > max_version:
            return False
        off = self.offset(key, version)
        body = self.np.frombuffer(buf, dtype=self.np.uint8, offset=_HDR.size)
        return bool(self.np.array_equal(body, self.base[off:off + self.size - _HDR.size]))


class Stats:
    def __init__(self):
        self.lat = {"put": [], "get": []}
        self.misses = 0
        self.bad = 0
        self.errors = {}

    def error(self, exc: BaseException) -> None:
        name = type(exc).__name__
        self.errors[name] = self.errors.get(name, 0) + 1


async def _run(addr, token, timeout, size, concurrency, duration, mix, durable, nkeys, seed, show_bar):
    from quillcache.client import AsyncClient
    from quillcache.model import KvBlockKey

    pattern = Pattern(size, seed)
    stats = Stats()
    client = AsyncClient(addr, token=token, timeout=timeout, client_name="quillctl-bench")
    await client.connect()
    try:
        tenant = client.tenant or "default"
        run = f"{seed:08x}"
        keys = [KvBlockKey("quillctl-bench", "quillctl-bench", None, tenant, f"bench-{run}", f"k{i}", i)
                for i in range(nkeys)]
        versions = [0] * nkeys          # last version acknowledged per key (0: never put)
        issued = [0] * nkeys            # last version sent per key
        rng = random.Random(seed)

        # every key is put once first, so that GETs find something (not timed)
        if mix < 1.0:
            buf = bytearray(size)
            for i in range(nkeys):
                issued[i] = 1
                pattern.fill(buf, i, 1)
                await client.put(keys[i], buf, durable=durable)
                versions[i] = 1

        deadline = time.perf_counter() + duration
        moved = [0]

        async def worker():
            pbuf = bytearray(size)
            gbuf = bytearray(size)
            while time.perf_counter() < deadline:
                i = rng.randrange(nkeys)
                if rng.random() < mix:
                    issued[i] += 1
                    v = issued[i]
                    pattern.fill(pbuf, i, v)
                    t0 = time.perf_counter()
                    try:
                        await client.put(keys[i], pbuf, durable=durable)
                    except QuillCacheError as exc:
                        stats.error(exc)
                        continue
                    stats.lat["put"].append(time.perf_counter() - t0)
                    versions[i] = max(versions[i], v)
                    moved[0] += size
                else:
                    t0 = time.perf_counter()
                    try:
                        n = await client.get_into(keys[i], gbuf)
                    except NotFound:
                        stats.misses += 1
                        continue
                    except QuillCacheError as exc:
                        stats.error(exc)
                        continue
                    stats.lat["get"].append(time.perf_counter() - t0)
                    moved[0] += n
                    # a PUT of this key may be in flight: any version sent so far is valid
                    if n != size or not pattern.check(gbuf, i, issued[i]):
                        stats.bad += 1

        async def ticker(bar):
            last = 0
            while True:
                await asyncio.sleep(TICK)
                done = min(int((duration - max(0.0, deadline - time.perf_counter())) / TICK), bar.length)
                bar.update(done - last)
                last = done

        t_start = time.perf_counter()
        if show_bar:
            with click.progressbar(length=int(duration / TICK), label="bench", file=sys.stderr) as bar:
                tick = asyncio.ensure_future(ticker(bar))
                try:
                    await asyncio.gather(*(worker() for _ in range(concurrency)))
                finally:
                    tick.cancel()
        else:
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t_start

        # leave the node as it was: the bench's keys are removed (not timed)
        for k in keys:
            try:
                await client.remove(k)
            except QuillCacheError:
                pass
    finally:
        await client.close()
    return stats, elapsed, moved[0]


def _summary(stats, elapsed, moved, args):
    import numpy as np
    out = {**args, "elapsed_s": round(elapsed, 3), "misses": stats.misses, "verify_failures": stats.bad,
           "errors": stats.errors}
    all_lat = stats.lat["put"] + stats.lat["get"]
    ops = len(all_lat)
    out["ops"] = ops
    out["ops_per_s"] = round(ops / elapsed, 1) if elapsed else 0.0
    out["mb_per_s"] = round(moved / (1 << 20) / elapsed, 1) if elapsed else 0.0
    for name, lat in (("all", all_lat), ("put", stats.lat["put"]), ("get", stats.lat["get"])):
        if lat:
            a = np.array(lat) * 1e3
            out[f"{name}_ops"] = len(lat)
            out[f"{name}_p50_ms"] = round(float(np.percentile(a, 50)), 4)
            out[f"{name}_p99_ms"] = round(float(np.percentile(a, 99)), 4)
    return out


@click.command("bench")
@click.option("--block-size", default="256KiB", show_default=True, callback=_size,
              help="Bytes per block, e.g. 4KiB, 256KiB, 4MiB (16 B .. 64 MiB).")
@click.option("--concurrency", "-c", type=click.IntRange(1, MAX_CONCURRENCY), default=8, show_default=True,
              help="Requests in flight at once (on one pipelined connection).")
@click.option("--duration", "-d", default="10s", show_default=True, callback=_duration,
              help="How long to run, e.g. 5s, 1m (at most 1h).")
@click.option("--mix", type=click.FloatRange(0.0, 1.0), default=0.5, show_default=True,
              help="Fraction of requests that are PUTs (the rest are GETs).")
@click.option("--durable", is_flag=True, help="PUTs wait for the SSD tier's durable publish.")
@click.option("--keys", "nkeys", type=click.IntRange(1, 1_000_000), default=None,
              help="Distinct keys (default: as many as fit in 64 MiB, at least --concurrency).")
@click.option("--seed", type=int, default=None, help="Seed of the data and the key choice (default: random).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.pass_context
def bench_command(ctx, block_size, concurrency, duration, mix, durable, nkeys, seed, as_json):
    """Load the node for --duration with a mix of PUTs and GETs and report ops/s, MB/s and the
    p50/p99 latency of one request.  Every byte read is checked against what was put; a wrong
    byte exits 70.  The bench's keys (model "quillctl-bench") are removed at the end.  A
    progress bar shows on a terminal (not with --json)."""
    obj = ctx.find_root().obj or {}
    as_json = as_json or bool(obj.get("json"))
    if nkeys is None:
        nkeys = max(concurrency, min(1024, (64 << 20) // block_size))
    if nkeys * block_size > MAX_WORKING_SET:
        raise click.UsageError(f"--keys x --block-size is {nkeys * block_size} bytes: at most "
                               f"{MAX_WORKING_SET >> 20} MiB")
    if seed is None:
        seed = random.getrandbits(32)
    show_bar = not as_json and sys.stderr.isatty()
    addr = obj.get("addr", DEFAULT_ADDRESS)
    try:
        import uvloop  # the daemon's loop; the client's protocol is faster on it
        stats, elapsed, moved = uvloop.run(_run(addr, obj.get("token"), obj.get("timeout", 10.0), block_size,
                                                concurrency, duration, mix, durable, nkeys, seed, show_bar))
    except (QuillCacheError, OSError) as exc:
        fail(exit_code_for(exc), f"{addr}: {exc}")
    args = {"block_size": block_size, "concurrency": concurrency, "duration_s": duration, "mix": mix,
            "durable": durable, "keys": nkeys, "seed": seed}
    out = _summary(stats, elapsed, moved, args)
    if as_json:
        click.echo(json.dumps(out, indent=2))
    else:
        click.echo(f"{out['ops']} requests in {out['elapsed_s']:.2f} s: {out['ops_per_s']:.0f} ops/s, "
                   f"{out['mb_per_s']:.1f} MB/s ({block_size} B blocks, mix {mix:.2f} put, "
                   f"concurrency {concurrency}{', durable' if durable else ''})")
        for name in ("all", "put", "get"):
            if f"{name}_ops" in out:
                click.echo(f"  {name:3s} {out[name + '_ops']:8d} ops  p50 {out[name + '_p50_ms']:.3f} ms  "
                           f"p99 {out[name + '_p99_ms']:.3f} ms")
        click.echo(f"  verified every byte read: {out['verify_failures']} wrong; {out['misses']} miss(es)"
                   + (f"; errors: {out['errors']}" if out["errors"] else ""))
    if stats.bad:
        click.echo(f"quillctl: {stats.bad} read(s) returned wrong bytes", err=True)
        sys.exit(exitcodes.SOFTWARE)
    if out["ops"] == 0:
        fail(exitcodes.FAILURE, "no request succeeded" + (f" (errors: {stats.errors})" if stats.errors else ""))
