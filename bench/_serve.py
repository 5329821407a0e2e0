"""Processes a bench starts on this machine (simulated engines, a gateway): each one's output
in a log under one scratch folder, a wait for its HTTP port that notices it dying, and a stop
that removes the folder unless asked to keep it (or the run failed), saying where it is.
``scratch`` is the same rule for a bench's folder alone (the cluster benches' etcd and nodes)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import aiohttp

START_TIMEOUT_S = 60.0          # seconds each process has to come up
STOP_TIMEOUT_S = 15.0           # seconds each has to exit on SIGTERM before it is killed


@contextlib.contextmanager
def scratch(prefix: str, what: str) -> Iterator[Path]:
    """A scratch folder for one run: removed when the run ends well, kept (and named on stderr)
    when it raises, so that its logs can be read."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield tmp
    except BaseException:
        print(f"{what}: logs are in {tmp}", file=sys.stderr, flush=True)
        raise
    shutil.rmtree(tmp, ignore_errors=True)


class Processes:
    """The processes of one run, their logs in ``tmp`` (``prefix`` names the folder)."""

    def __init__(self, prefix: str, what: str) -> None:
        self.what = what                              # the run, in messages
        self.tmp = Path(tempfile.mkdtemp(prefix=prefix))
        self.procs: list[subprocess.Popen] = []
        self.logs: list = []

    def spawn(self, argv: list[str], name: str) -> subprocess.Popen:
        """Start ``argv`` with stdout and stderr in ``tmp/NAME.log``."""
        log = open(self.tmp / f"{name}.log", "wb")
        self.logs.append(log)
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.procs.append(p)
        return p

    async def wait_http(self, session: aiohttp.ClientSession, url: str, proc: subprocess.Popen, name: str,
                        timeout_s: float = START_TIMEOUT_S) -> None:
        """Until ``url`` answers 200; a clear error if ``proc`` exits first or it takes too long."""
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"{self.what}: {name} exited with {proc.returncode} (log: {self.tmp / name}.log)")
            try:
                async with session.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{self.what}: {name} did not answer {url} in {timeout_s:.0f}s "
                                 f"(log: {self.tmp / name}.log)")
            await asyncio.sleep(0.1)

    def stop(self, keep: bool) -> None:
        """Stop the processes; keep their logs only when asked, or when the run went wrong."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in self.logs:
            log.close()
        if keep:
            print(f"{self.what}: logs are in {self.tmp}", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)
