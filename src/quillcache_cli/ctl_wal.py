"""`quillctl wal verify DIR`: an offline check of a node's data directory.

Reads every write-ahead log under DIR with the native ``WalReader`` (which never raises on bad
data: it reports ``(bytes_dropped, reason)``).  For a log that belongs to an SSD tier it also
replays the tier's checkpoint + records read-only, as recovery would (opening ``SsdTier``
would recover, i.e. write), giving the blocks the node would serve; ``--deep`` reads each
block and checks its CRC32C.  Exit 0 when clean, ``CORRUPT`` when anything was dropped or
failed, NOT_FOUND when DIR holds no log, IOERR when a file cannot be read.
"""
import errno
import fcntl
import json
import os
import sys

import click

from quillcache._native.wal import WalReader, list_segments, lsn_offset, lsn_segment, segment_name

from quillcache_cli import exitcodes

# (asked for in the report); until it does, the sysexits value is used under the same name.
CORRUPT = exitcodes.DATAERR

MAX_DEPTH = 3          # directory levels under DIR searched for log directories
MAX_LOG_DIRS = 64      # log directories verified in one run (more: the rest are listed, not read)
MAX_LISTED = 20        # bad blocks listed by offset in a report (the count is always complete)
VERIFY_CHUNK = 8 << 20  # bytes: read size of --deep block verification
DAEMON_SSD_FILE = "blocks.dat"   # the daemon's default [ssd] path is <data_dir>/ssd/blocks.dat


def find_log_dirs(root: str) -> list[str]:
    """Directories at most MAX_DEPTH levels under ``root`` (itself included) holding segments."""
    found = []
    base_depth = root.rstrip(os.sep).count(os.sep)
    for dirpath, dirnames, _files in os.walk(root):
        if dirpath.count(os.sep) - base_depth >= MAX_DEPTH:
            dirnames[:] = []
        dirnames.sort()
        if list_segments(dirpath):
            found.append(dirpath)
    return found


def _writer_is_live(directory: str) -> bool:
    """True if a WalWriter holds its flock on ``directory`` (a daemon is running on it)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)              # closing drops the shared lock we may have taken
    return False


def verify_log(directory: str, progress=None, on_record=None) -> dict:
    """Read one log; return what was read and what was dropped (never raises on bad data)."""
    segments = list_segments(directory)
    reader = WalReader(directory)
    records = 0
    payload_bytes = 0
    last_seg = None
    for lsn, payload in reader:
        records += 1
        payload_bytes += len(payload)
        if on_record is not None:
            on_record(lsn, payload)
        seg = lsn_segment(lsn)
        if progress is not None and seg != last_seg:
            progress(seg)
            last_seg = seg
    dropped = []
    for (nbytes, reason), lsn in zip(reader.corruption, reader.corruption_lsns):
        seq = lsn_segment(lsn)
        dropped.append({"bytes": nbytes, "reason": reason, "lsn": lsn,
                        "segment": segment_name(seq) if seq else None, "offset": lsn_offset(lsn)})
    return {
        "path": directory,
        "segments": [{"name": os.path.basename(p), "bytes": os.path.getsize(p)} for _s, p in segments],
        "records": records,
        "payload_bytes": payload_bytes,
        "tail_bytes": reader.tail_bytes,
        "valid_end": reader.valid_end,
        "end_lsn": reader.end_lsn,
        "dropped": dropped,
        "dropped_bytes": sum(d["bytes"] for d in dropped),
        "writer_live": _writer_is_live(directory),
    }


# ---- the SSD tier's view (read-only: opening SsdTier would recover, i.e. write) ------------------

class SsdReplay:
    """The SSD tier's checkpoint + WAL records replayed read-only by the tier's own code
    (``ssd.read_checkpoint`` and ``ssd.Replay``), with what verify reports about them."""

    def __init__(self, data_path: str, checkpoint_path: str):
        from quillcache.store import ssd
        self.ssd = ssd
        self.data_path = data_path
        self.problem = None
        try:
            lsn, _unit, entries = ssd.read_checkpoint(checkpoint_path)
        except ssd.CorruptCheckpoint as exc:
            lsn, entries, self.problem = 0, {}, f"checkpoint {exc.problem}"
        self.checkpoint_blocks = len(entries)
        self.replay = ssd.Replay(lsn, entries)

    def __call__(self, lsn: int, payload: bytes) -> None:
        self.replay(lsn, payload)

    @property
    def entries(self) -> dict:
        return self.replay.entries

    def report(self, deep: bool, progress=None) -> dict:
        data = self.data_path
        size = os.path.getsize(data) if os.path.exists(data) else 0
        out = {"path": data, "blocks": len(self.entries),
               "bytes": sum(e[1] for e in self.entries.values()), "data_file_bytes": size,
               "checkpoint_blocks": self.checkpoint_blocks, "checkpoint_problem": self.problem,
               "wal_puts": self.replay.puts, "wal_removes": self.replay.removes,
               "malformed_records": len(self.replay.malformed),
               "out_of_range": sum(1 for e in self.entries.values() if e[0] + e[1] > size),
               "crc_failures": None, "crc_failed_offsets": []}
        if deep:
            out["crc_failures"] = 0
            fd = os.open(data, os.O_RDONLY | os.O_CLOEXEC)
            try:
                buf = bytearray(VERIFY_CHUNK)
                mv = memoryview(buf)
                for off, length, crc, _lsn in sorted(self.entries.values()):
                    got, done = 0, 0
                    while done < length:
                        n = os.preadv(fd, [mv[:min(VERIFY_CHUNK, length - done)]], off + done)
                        if n <= 0:
                            break
                        # a block over VERIFY_CHUNK extends the CRC chunk by chunk, without copies
                        got = self.ssd.crc32c(mv[:n], got)
                        done += n
                    if done != length or got != crc:
                        out["crc_failures"] += 1
                        if len(out["crc_failed_offsets"]) < MAX_LISTED:
                            out["crc_failed_offsets"].append(off)
                    if progress is not None:
                        progress(1)
            finally:
                os.close(fd)
        return out

    def is_clean(self, rep: dict) -> bool:
        return not (rep["checkpoint_problem"] or rep["malformed_records"] or rep["out_of_range"]
                    or rep["crc_failures"])


def ssd_tier_of(log_dir: str, root: str, ssd_path=None):
    """(data file, checkpoint) of the SSD tier a log belongs to, else None.  Two layouts:
    the daemon's (<data_dir>/wal with the data file at [ssd] path, default
    <data_dir>/ssd/blocks.dat, its checkpoint beside it as <file>.checkpoint) and an SsdTier
    directory (data.qc, checkpoint and wal/ together)."""
    from quillcache.store import ssd
    if os.path.basename(log_dir) != ssd.WAL_DIR_NAME:
        return None
    parent = os.path.dirname(log_dir)
    if ssd_path is not None and os.path.abspath(parent) == root:
        return ssd_path, ssd_path + ".checkpoint"
    daemon_data = os.path.join(parent, "ssd", DAEMON_SSD_FILE)
    if os.path.exists(daemon_data):
        return daemon_data, daemon_data + ".checkpoint"
    if os.path.exists(os.path.join(parent, ssd.DATA_NAME)):
        return os.path.join(parent, ssd.DATA_NAME), os.path.join(parent, ssd.CHECKPOINT_NAME)
    return None


def _human(report: dict) -> None:
    for log in report["logs"]:
        size = sum(seg["bytes"] for seg in log["segments"])
        click.echo(f"wal {log['path']}: {len(log['segments'])} segment(s), {size} bytes, "
                   f"{log['records']} record(s), {log['payload_bytes']} payload bytes")
        if log["writer_live"]:
            click.echo("  warning: a writer holds this log (is the daemon running?): "
                       "its tail may change while it is read")
        if log["tail_bytes"]:
            click.echo(f"  torn tail: {log['tail_bytes']} bytes after the last complete record "
                       f"(a writer died mid-write; not corruption: cut on reopen)")
        for d in log["dropped"]:
            where = f"{d['segment']} offset {d['offset']}" if d["segment"] else "between segments"
            click.echo(f"  dropped {d['bytes']} bytes at {where}: {d['reason']}")
    for t in report["ssd"]:
        crc = (f"{t['crc_failures']} CRC failure(s)" if t["crc_failures"] is not None
               else "block CRCs not read (--deep reads them)")
        click.echo(f"ssd {t['path']}: {t['blocks']} block(s), {t['bytes']} bytes "
                   f"({t['checkpoint_blocks']} from the checkpoint, {t['wal_puts']} put and "
                   f"{t['wal_removes']} remove record(s) after it); {crc}")
        if t["checkpoint_problem"]:
            click.echo(f"  checkpoint: {t['checkpoint_problem']} (the node refuses to start on it)")
        if t["malformed_records"]:
            click.echo(f"  {t['malformed_records']} WAL record(s) that are not SSD records")
        if t["out_of_range"]:
            click.echo(f"  {t['out_of_range']} block(s) end past the end of the data file")
        if t["crc_failed_offsets"]:
            click.echo("  CRC failed at offset(s): " + ", ".join(map(str, t["crc_failed_offsets"])))
    if report["clean"]:
        click.echo("clean")
    else:
        click.echo(f"CORRUPT: {report['dropped_bytes']} WAL bytes dropped in {report['dropped_regions']} "
                   f"region(s), {report['ssd_problems']} SSD tier problem(s)")


class _NoBar:
    def update(self, n):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _bar(show: bool, length: int, label: str):
    if not show:
        return _NoBar()
    return click.progressbar(length=length, label=label, file=sys.stderr)


@click.group("wal")
def wal_group():
    """Offline checks of the write-ahead log."""


@wal_group.command("verify")
@click.argument("directory", metavar="DIR", type=click.Path(exists=True, file_okay=False))
@click.option("--deep", is_flag=True, help="Also read every SSD block and check its CRC32C (slow).")
@click.option("--ssd-path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="The SSD data file when [ssd] path is not the default <DIR>/ssd/blocks.dat.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.pass_context
def wal_verify(ctx, directory, deep, ssd_path, as_json):
    """Check the data directory DIR offline: every WAL segment (records, bytes dropped and
    why, a torn tail), and the SSD tier's blocks where that is cheap.

    A torn tail (the end of the last segment cut mid-record) is where a writer died; it is
    reported but is not corruption.  Exit 0 when clean, 65 (EX_DATAERR) when bytes were
    dropped or SSD blocks failed their CRC, 3 when DIR holds no log, 74 when a file cannot
    be read.  Run it on a stopped node: a live daemon may be appending meanwhile.
    """
    as_json = as_json or bool((ctx.find_root().obj or {}).get("json"))
    root = os.path.abspath(directory)
    ssd_path = os.path.abspath(ssd_path) if ssd_path is not None else None
    try:
        dirs = find_log_dirs(root)
        if not dirs:
            click.echo(f"quillctl: no WAL segments (NNNNNNNNNNNN.log) under {root}", err=True)
            sys.exit(exitcodes.NOT_FOUND)
        skipped = dirs[MAX_LOG_DIRS:]
        dirs = dirs[:MAX_LOG_DIRS]
        total = sum(len(list_segments(d)) for d in dirs)
        replays = {d: SsdReplay(*t) for d in dirs if (t := ssd_tier_of(d, root, ssd_path)) is not None}
        show_bar = not as_json and sys.stderr.isatty()
        logs, tiers = [], []
        with _bar(show_bar and total > 1, total, "verifying WAL segments") as bar:
            for d in dirs:
                seen = []
                logs.append(verify_log(d, progress=lambda seg: (seen.append(seg), bar.update(1)),  # noqa: B023
                                       on_record=replays.get(d)))
                bar.update(len(logs[-1]["segments"]) - len(seen))   # segments without records
        for replay in replays.values():
            n = len(replay.entries) if deep else 0
            with _bar(show_bar and n > 1, n, "verifying SSD blocks") as bar:
                rep = replay.report(deep, progress=bar.update)
            rep["clean"] = replay.is_clean(rep)
            tiers.append(rep)
    except OSError as exc:
        click.echo(f"quillctl: cannot read {exc.filename or root}: {exc.strerror or exc}", err=True)
        sys.exit(exitcodes.IOERR)
    dropped_bytes = sum(log["dropped_bytes"] for log in logs)
    dropped_regions = sum(len(log["dropped"]) for log in logs)
    ssd_problems = sum(1 for t in tiers if not t["clean"])
    report = {
        "path": root, "logs": logs, "ssd": tiers, "deep": deep,
        "dropped_bytes": dropped_bytes, "dropped_regions": dropped_regions,
        "ssd_problems": ssd_problems, "not_verified": skipped,
        "clean": dropped_regions == 0 and ssd_problems == 0,
    }
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
    else:
        _human(report)
        if skipped:
            click.echo(f"not verified (more than {MAX_LOG_DIRS} log directories): {', '.join(skipped)}")
    sys.exit(exitcodes.OK if report["clean"] else CORRUPT)
