"""The coverage-guided protocol fuzzer (bench/fuzz_codec.py) finds nothing in a short run."""
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris", reason="atheris is in the bench extra (pip install atheris)")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "fuzz_codec.py"


@pytest.mark.slow
def test_atheris_fuzz_of_parser_and_decoders_finds_no_crash():
    r = subprocess.run([sys.executable, str(SCRIPT), "-runs=50000", "-seed=1"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Done 50000 runs" in r.stderr
