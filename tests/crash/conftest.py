"""Crash-campaign settings: QUILLCACHE_CRASH_CYCLES (cycles of the long run) and a summary."""
import os

import pytest

DEFAULT_LONG_CYCLES = 500


@pytest.fixture
def crash_cycles(request) -> int:
    """Cycles of the long campaign: --crash-long must be given; QUILLCACHE_CRASH_CYCLES or 500."""
    if not request.config.getoption("--crash-long"):
        pytest.skip("long crash campaign: run with --crash-long (make crash N=500)")
    raw = os.environ.get("QUILLCACHE_CRASH_CYCLES", "") or str(DEFAULT_LONG_CYCLES)
    try:
        n = int(raw)
    except ValueError:
        raise pytest.UsageError(f"QUILLCACHE_CRASH_CYCLES={raw!r}: not an integer") from None
    if n < 1:
        raise pytest.UsageError(f"QUILLCACHE_CRASH_CYCLES={n}: must be >= 1")
    return n
