"""Reading the daemon's Prometheus endpoint."""
from __future__ import annotations

import urllib.request


def metric_value(text: str, name: str, labels: str = "") -> float:
    """The sum of every sample of ``name`` whose label text contains ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + ("{" if labels or "{" in line[len(name):len(name) + 1] else " ")) \
                and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def has_metric(text: str, name: str, labels: str = "") -> bool:
    """Whether ``text`` has a sample of ``name`` (with ``labels`` in its label text)."""
    return any(line.startswith(name + ("{" if labels else "")) and labels in line
               and line[len(name)] in "{ " for line in text.splitlines())


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()
