"""Crash-injection harness for the SSD tier: the writer process, the fault injector, the checker.

    python -m tests.crash.harness writer DIR --seed S [--gen G] [--ops N] ...
        Runs the real SsdTier under load (random puts/overwrites/removes of random-sized blocks
        whose bytes derive from key + version) and prints, flushed, one line per event:
          READY                         the tier is open (recovered)
          I P <k> <ver> <len>           put issued          A P <k> <ver> <offset> <len>   acknowledged
          I R <k>                       remove issued       A R <k> <0|1>                  acknowledged
          E <k> <errclass>              the op failed: it may or may not have happened
          X <k>                         CapacityError: it did not happen
          RO                            the tier went read-only; the writer stops
          DONE                          all ops finished and the tier closed cleanly
    python -m tests.crash.harness recover DIR --capacity C
        Opens (recovers) and closes the tier; used with QUILLCACHE_KILLPOINT=mid_recovery.

``run_cycle`` (used by tests/crash/test_crash.py) starts a writer, kills it (kill point, fault or
SIGKILL after a random delay), damages the files as the mode asks, recovers in this process and
checks every invariant; it returns counters and raises AssertionError on a violation.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from quillcache.errors import CapacityError, NotFound, ReadOnlyError
from quillcache.model import KvBlockKey

REPO = Path(__file__).resolve().parents[2]
CAPACITY = 4 << 20            # bytes: the writer's tier
KEYS = 48                     # distinct keys the writer touches
MIN_BLOCK = 16                # bytes: the content header
MAX_BLOCK = 48 << 10          # bytes
_HEAD = struct.Struct("<4sIII")   # magic, key id, version, length
_MAGIC = b"QCHK"

KILLPOINT_MODES = ("before_data_write", "after_data_write", "after_data_fsync", "after_wal_append",
                   "after_wal_fsync", "mid_checkpoint")
FAULT_MODES = ("wal_fsync_eio", "wal_enospc", "data_enospc", "data_fsync_eio")
DAMAGE_MODES = ("powerloss", "torn_data", "zero_tail", "bitflip_data", "bitflip_wal")
ALL_MODES = KILLPOINT_MODES + FAULT_MODES + DAMAGE_MODES + ("sigkill", "sigkill2", "mid_recovery")


def block_key(k: int) -> KvBlockKey:
    return KvBlockKey("crash-model", "tok", None, "tenant", "prefix", f"blk{k}", k)


def content(k: int, ver: int, n: int) -> bytes:
    """The bytes of version ``ver`` of key ``k``: any byte can be checked."""
    body = random.Random(k * 1_000_003 + ver).randbytes(n - _HEAD.size)
    return _HEAD.pack(_MAGIC, k, ver, n) + body


def identify(buf: bytes):
    """(k, ver) if ``buf`` is exactly some content(k, ver, len(buf)), else None."""
    if len(buf) < _HEAD.size:
        return None
    magic, k, ver, n = _HEAD.unpack_from(buf, 0)
    if magic != _MAGIC or n != len(buf) or buf != content(k, ver, n):
        return None
    return k, ver


# ---------------------------------------------------------------------------- the writer process
async def _writer(args) -> int:
    from quillcache.store.ssd import SsdTier
    out = sys.stdout

    def emit(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    tier = await SsdTier.open(args.dir, args.capacity, verify=args.verify,
                              checkpoint_records=args.checkpoint_records, segment_bytes=args.segment_bytes)
    emit("READY")
    rng = random.Random(args.seed)
    busy: set[int] = set()
    sem = asyncio.Semaphore(args.concurrency)
    counter = 0
    stop = False

    async def one(k: int) -> None:
        nonlocal counter, stop
        key = block_key(k)
        try:
            if tier.contains(key) and rng.random() < 0.25:
                emit(f"I R {k}")
                removed = await tier.remove(key)
                emit(f"A R {k} {int(removed)}")
            else:
                counter += 1
                ver = args.gen * 1_000_000 + counter
                n = rng.randint(MIN_BLOCK, MAX_BLOCK)
                emit(f"I P {k} {ver} {n}")
                await tier.put(key, content(k, ver, n))
                fd_off = tier.extent_of(key)
                emit(f"A P {k} {ver} {fd_off[1]} {n}")
        except CapacityError:
            emit(f"X {k}")
        except ReadOnlyError:
            emit(f"E {k} ReadOnlyError")
            emit("RO")
            stop = True
        except OSError as exc:
            emit(f"E {k} {type(exc).__name__}")
        finally:
            busy.discard(k)
            sem.release()

    tasks = set()
    for _ in range(args.ops):
        await sem.acquire()
        if stop:
            sem.release()
            break
        free = [k for k in range(args.keys) if k not in busy]
        k = rng.choice(free)
        busy.add(k)
        t = asyncio.ensure_future(one(k))
        tasks.add(t)
        t.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
    if stop:
        os._exit(3)                          # read-only: leave the files as they are
    await tier.close()
    emit("DONE")
    return 0


def _recover_main(args) -> int:
    from quillcache.store.ssd import SsdTier
    tier = SsdTier(args.dir, args.capacity, verify=args.verify, segment_bytes=args.segment_bytes)
    n = len(tier)
    tier.close_sync()
    print(f"RECOVERED {n}", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.crash.harness")
    p.add_argument("role", choices=("writer", "recover"))
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gen", type=int, default=1)
    p.add_argument("--ops", type=int, default=400)
    p.add_argument("--keys", type=int, default=KEYS)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--capacity", type=int, default=CAPACITY)
    p.add_argument("--verify", default="lazy")
    p.add_argument("--checkpoint-records", type=int, default=40)
    p.add_argument("--segment-bytes", type=int, default=64 << 10)
    args = p.parse_args(argv)
    if args.role == "writer":
        return asyncio.run(_writer(args))
    return _recover_main(args)


# ---------------------------------------------------------------------------- the parent side
@dataclass
class CycleResult:
    mode: str
    acked_checked: int = 0
    lost: int = 0
    corrupted_served: int = 0
    detected_misses: int = 0
    unreferenced_writes: int = 0   # extents written but not live after recovery (orphans, freed)
    blocks: int = 0
    killed: bool = False
    problems: list = field(default_factory=list)


def _spawn(args: list, env_extra: dict) -> subprocess.Popen:
    env = dict(os.environ)
    for name in ("QUILLCACHE_KILLPOINT", "QUILLCACHE_FAULTS", "QUILLCACHE_IO_JOURNAL"):
        env.pop(name, None)
    env.update(env_extra)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen([sys.executable, "-m", "tests.crash.harness", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run_writer(d: Path, seed: int, gen: int, env_extra: dict, kill_after: float | None,
                ops: int, timeout: float = 60.0) -> tuple[list[str], bool]:
    """Run one writer generation; SIGKILL it ``kill_after`` seconds after READY. -> (lines, killed)."""
    proc = _spawn(["writer", str(d), "--seed", str(seed), "--gen", str(gen), "--ops", str(ops)], env_extra)
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("READY"):
                ready.set()
        ready.set()

    th = threading.Thread(target=pump, daemon=True)
    th.start()
    if kill_after is not None:
        ready.wait(timeout)
        time.sleep(kill_after)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    th.join(5)
    err = proc.stderr.read()
    proc.stderr.close()
    killed = proc.returncode == -signal.SIGKILL
    if proc.returncode not in (0, 3, -signal.SIGKILL):
        raise AssertionError(f"writer exited with {proc.returncode}:\n{err[-3000:]}")
    if not lines or lines[0] != "READY":
        raise AssertionError(f"writer never became ready (rc {proc.returncode}):\n{err[-3000:]}")
    return lines, killed


def expectations(lines: list[str]) -> dict:
    """key -> {"acked": state, "allowed": {states}, "extent": (off, len) | None, "versions": {...}}.

    A state is None (absent) or (ver, len).  Allowed: the state after the last acknowledged op
    plus the result of every op issued after it that was never acknowledged."""
    keys: dict[int, dict] = {}
    pending: dict[int, object] = {}
    for line in lines:
        f = line.split()
        if not f or f[0] in ("READY", "RO", "DONE"):
            continue
        k = int(f[2]) if f[0] in ("I", "A") else int(f[1])
        st = keys.setdefault(k, {"acked": None, "allowed": {None}, "extent": None, "versions": set()})
        if f[0] == "I":
            pending[k] = ("P", int(f[3]), int(f[4])) if f[1] == "P" else ("R",)
            if f[1] == "P":
                st["versions"].add(int(f[3]))
                st["allowed"].add((int(f[3]), int(f[4])))
            else:
                st["allowed"].add(None)
        elif f[0] == "A":
            pending.pop(k, None)
            if f[1] == "P":
                st["acked"] = (int(f[3]), int(f[5]))
                st["extent"] = (int(f[4]), int(f[5]))
            else:
                st["acked"] = None
                st["extent"] = None
            st["allowed"] = {st["acked"]}
        elif f[0] == "X":
            op = pending.pop(k, None)           # certainly not applied
            if op is not None and op[0] == "P":
                st["allowed"].discard((op[1], op[2]))
                st["allowed"].add(st["acked"])
        elif f[0] == "E":
            pending.pop(k, None)                # uncertain: stays allowed
    return keys


# -- damage --------------------------------------------------------------------------------------
def _journal(path: Path):
    writes, synced, lsn = [], 0, None
    if path.exists():
        for line in path.read_text().splitlines():
            f = line.split()
            if len(f) == 4 and f[0] == "W":
                writes.append((int(f[1]), int(f[2]), int(f[3])))
            elif len(f) == 2 and f[0] == "S":
                synced = max(synced, int(f[1]))
            elif len(f) == 2 and f[0] == "L":
                lsn = int(f[1])
    return writes, synced, lsn


def _wal_segments(d: Path) -> list[Path]:
    return sorted(p for p in (d / "wal").glob("*.log"))


def _damage(mode: str, d: Path, journal: Path, exp: dict, rng: random.Random) -> list:
    """Apply the mode's damage to the files; return damaged data ranges [(off, len)]."""
    data = d / "data.qc"
    damaged = []
    if mode == "powerloss":
        writes, synced, lsn = _journal(journal)
        with open(data, "r+b") as f:
            for wid, off, n in writes:
                if wid > synced:                # written, never synced: the power loss ate it
                    f.seek(off)
                    f.write(rng.randbytes(n))
                    damaged.append((off, n))
        if lsn is not None:
            seq, off = lsn >> 32, lsn & 0xFFFFFFFF
            for seg in _wal_segments(d):
                s = int(seg.stem)
                if s > seq:
                    seg.unlink()
                elif s == seq and seg.stat().st_size > off:
                    os.truncate(seg, off)
    elif mode == "torn_data":
        writes, _, _ = _journal(journal)
        if writes:
            _, off, n = writes[-1]
            a = off + min(n - 1, 100)
            b = min(off + n, off + 400)
            with open(data, "r+b") as f:
                f.seek(a)
                f.write(rng.randbytes(max(1, b - a)))
            damaged.append((off, n))
    elif mode == "zero_tail":
        segs = _wal_segments(d)
        if segs:
            with open(segs[-1], "ab") as f:
                f.write(bytes(rng.randint(1, 40000)))
    elif mode == "bitflip_data":
        live = [(k, st) for k, st in exp.items() if st["extent"] and st["allowed"] == {st["acked"]}]
        if live:
            k, st = rng.choice(live)
            off, n = st["extent"]
            at = off + rng.randrange(n)
            with open(data, "r+b") as f:
                f.seek(at)
                b = f.read(1)[0]
                f.seek(at)
                f.write(bytes([b ^ (1 << rng.randrange(8))]))
            damaged.append((off, n))
    elif mode == "bitflip_wal":
        segs = [s for s in _wal_segments(d) if s.stat().st_size > 0]
        if segs:
            seg = rng.choice(segs)
            blob = bytearray(seg.read_bytes())
            at = rng.randrange(len(blob))
            blob[at] ^= 1 << rng.randrange(8)
            seg.write_bytes(bytes(blob))
    return damaged


# -- the checker ---------------------------------------------------------------------------------
def tier_state(tier) -> dict:
    return {k: (off, n, crc) for k, off, n, crc in tier.entries()}


def check_allocator(tier) -> None:
    ext = tier.allocator.extents()
    end = 0
    total = 0
    for off, size, _ in ext:
        assert off >= end, f"allocator extents overlap at offset {off}"
        end = off + size
        total += size
    assert total == tier.allocator.used, f"extents sum to {total}, allocator says used={tier.allocator.used}"
    live = {off: size for off, size, _ in ext}
    unit = tier.unit
    for _, off, n, _ in tier.entries():
        assert live.get(off) == -(-n // unit) * unit, f"index entry at {off} ({n} bytes) is not a live extent"
    assert len(ext) == len(tier), f"{len(ext)} live extents for {len(tier)} blocks: leaked or orphaned extents"


def check_dir(d: Path, exp: dict, damaged: list, relaxed: bool, res: CycleResult,
              verify: str = "lazy", journal: Path | None = None) -> dict:
    from quillcache.store.ssd import SsdTier

    def hit_damage(extent) -> bool:
        return extent is not None and any(a < extent[0] + extent[1] and extent[0] < a + n for a, n in damaged)

    def damaged_in_flight(st) -> bool:
        # an unacknowledged put whose record became durable, then its (synced) bytes were torn:
        # the damaged write has that put's length (padded to the unit with O_DIRECT)
        lengths = {n for _, n in damaged}
        return any(s is not None and s != st["acked"] and (s[1] in lengths or -(-s[1] // 4096) * 4096 in lengths)
                   for s in st["allowed"])

    tier = SsdTier(str(d), CAPACITY, verify=verify, segment_bytes=64 << 10)
    try:
        check_allocator(tier)
        buf = bytearray(MAX_BLOCK)
        for k in range(max(KEYS, max(exp, default=0) + 1)):
            key = block_key(k)
            st = exp.get(k, {"acked": None, "allowed": {None}, "extent": None, "versions": set()})
            try:
                n = tier.read_into(key, buf)
                got = identify(bytes(buf[:n]))
            except NotFound:
                got = "miss"
            if st["acked"] is not None:
                res.acked_checked += 1
            if got is None:
                res.corrupted_served += 1
                res.problems.append(f"key {k}: served bytes that are no version of it")
                continue
            if got == "miss":
                state = None
            else:
                if got[0] != k:
                    res.corrupted_served += 1
                    res.problems.append(f"key {k}: served key {got[0]}'s bytes")
                    continue
                state = (got[1], n)
            if state in st["allowed"]:
                continue
            if relaxed and (state is None or state[0] in st["versions"]):
                continue                         # a WAL record was destroyed on purpose
            if state is None and (hit_damage(st["extent"]) or damaged_in_flight(st)):
                res.detected_misses += 1         # its bytes were damaged on purpose: a miss
                continue
            if state is None:
                res.lost += 1
                res.problems.append(f"key {k}: acknowledged {st['acked']} lost")
            else:
                res.corrupted_served += 1
                res.problems.append(f"key {k}: served version {state} not in {sorted(map(str, st['allowed']))}")
        check_allocator(tier)
        state1 = tier_state(tier)
        res.blocks = len(state1)
        if journal is not None:
            writes, _, _ = _journal(journal)
            live = {off for _, off, _ in state1.values()}
            res.unreferenced_writes = len({off for _, off, _ in writes} - live)
    finally:
        tier.close_sync()
    # recovery twice gives the same state
    again = SsdTier(str(d), CAPACITY, verify=verify, segment_bytes=64 << 10)
    try:
        check_allocator(again)
        assert tier_state(again) == state1, "a second recovery gave a different state"
    finally:
        again.close_sync()
    return state1


def run_cycle(base: Path, mode: str, seed: int, verify: str = "lazy") -> CycleResult:
    """One kill cycle in ``base/<mode>-<seed>``; AssertionError when an invariant breaks."""
    assert mode in ALL_MODES, mode
    rng = random.Random(seed)
    d = base / f"{mode}-{seed}"
    journal = base / f"{mode}-{seed}.journal"
    res = CycleResult(mode)
    env = {"QUILLCACHE_IO_JOURNAL": str(journal)}
    kill_after = None
    if mode in KILLPOINT_MODES:
        n = rng.randint(1, 3) if mode == "mid_checkpoint" else rng.randint(1, 25)
        env["QUILLCACHE_KILLPOINT"] = f"{mode}:{n}"
    elif mode in FAULT_MODES:
        env["QUILLCACHE_FAULTS"] = f"{mode}:{rng.randint(2, 25)}"
    else:
        kill_after = rng.uniform(0.02, 0.3)
    # kill points and faults stop the writer themselves; a timed kill needs a writer still busy
    ops = 400 if kill_after is None else 5000
    lines: list[str] = []
    gens = 2 if mode == "sigkill2" else 1
    for gen in range(1, gens + 1):
        if gen == gens and journal.exists():
            journal.unlink()                     # power-loss emulation covers the last run only
        out, killed = _run_writer(d, seed * 7 + gen, gen, env, kill_after, ops)
        lines += out
        res.killed = res.killed or killed
    (base / f"{mode}-{seed}.log").write_text("\n".join(lines) + "\n")   # kept for post-mortems
    exp = expectations(lines)
    damaged = _damage(mode, d, journal, exp, rng)
    if mode == "mid_recovery":
        clean = base / f"{mode}-{seed}-clean"
        shutil.copytree(d, clean)
        proc = _spawn(["recover", str(d)], {"QUILLCACHE_KILLPOINT": "mid_recovery"})
        proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL, f"recover did not die at mid_recovery ({proc.returncode})"
        from quillcache.store.ssd import SsdTier
        states = []
        for where in (clean, d):
            t = SsdTier(str(where), CAPACITY, verify=verify, segment_bytes=64 << 10)
            states.append(tier_state(t))
            t.close_sync()
        assert states[0] == states[1], "recovery after a crash mid-recovery differs from a clean recovery"
    check_dir(d, exp, damaged, mode == "bitflip_wal", res, verify, journal)
    return res


if __name__ == "__main__":
    sys.exit(main())
