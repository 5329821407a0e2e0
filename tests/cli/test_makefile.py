"""The Makefile a newcomer meets: `make help` names every target they run, each one real."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_help_lists_every_public_target_and_only_real_ones():
    r = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    listed = set(re.findall(r"^\s+make ([\w-]+)", r.stdout, re.M)) | set(re.findall(r"; make ([\w-]+)", r.stdout))
    makefile = (ROOT / "Makefile").read_text()
    phony = set(re.search(r"^\.PHONY: (.*)$", makefile, re.M).group(1).split())
    public = {t for t in phony if not t.startswith("_")} - {"all", "help", "deps", "bench-deps"}
    assert listed == public, (listed ^ public)
    for target in listed:
        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), target
    assert "make help" in (ROOT / "README.md").read_text()
