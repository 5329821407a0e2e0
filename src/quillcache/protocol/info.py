"""The INFO text format (redis-style), rendered by the node and parsed by the client here,
in one place::

    # Server\r\n
    key:value\r\n
    ...
    \r\n
    # Store\r\n
    ...

Booleans are written 0/1 and floats with 6 significant digits; the parser turns what reads
as an int or a float back into one and keeps everything else a string.
"""
from __future__ import annotations

from typing import Any, Optional

__all__ = ["render_info", "parse_info"]

SECTION_MARK = "#"
SEPARATOR = ":"
LINE_END = "\r\n"


def render_info(sections: dict[str, dict[str, Any]]) -> str:
    """``{section: {key: value}}`` -> INFO text: ``# Section`` then ``key:value`` lines, a blank line between."""
    out = []
    for name, values in sections.items():
        out.append(f"{SECTION_MARK} {name}")
        for k, v in values.items():
            if isinstance(v, bool):
                v = int(v)
            elif isinstance(v, float):
                v = f"{v:.6g}"
            out.append(f"{k}{SEPARATOR}{v}")
        out.append("")
    return LINE_END.join(out)


def _coerce(value: str) -> Any:
    try:
        return int(value)
    except ValueError:
        pass
    try:
        return float(value)
    except ValueError:
        return value


def parse_info(text: str) -> dict[str, dict[str, Any]]:
    """INFO text -> ``{section: {key: value}}`` (numbers converted)."""
    out: dict[str, dict[str, Any]] = {}
    current: Optional[dict] = None
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith(SECTION_MARK):
            current = out.setdefault(line.lstrip(SECTION_MARK).strip(), {})
            continue
        k, sep, v = line.partition(SEPARATOR)
        if sep and current is not None:
            current[k] = _coerce(v)
    return out
