"""Every bench command the README and `docs/` show parses as written: a newcomer who copies one
gets the run it describes, not a usage error from an option renamed since.  Each command's
arguments go through its bench's own parser (``main``'s); nothing is run."""
from __future__ import annotations

import argparse
import importlib
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"(?:\.venv/bin/)?python3? (bench/([a-z_]+)\.py(?: [^`\n]*)?)")


def _commands() -> list[tuple[str, str, list[str]]]:
    """(where, bench, argv) for each bench command shown: in a fenced or an indented block, its
    lines joined where they end in a backslash; in prose, up to the code span's closing backtick, the span's
    line breaks read as spaces.  A ``#`` comment and prose after the command (say "(and 8)")
    are not its arguments."""
    found: dict = {}
    for doc in DOCS:
        text = doc.read_text()
        fence = r"^[ \t]*```[a-z]*\n(.*?)^[ \t]*```"
        chunks = [re.sub(r"\\\n[ \t]*", " ", b) for b in re.findall(fence, text, re.S | re.M)]
        prose = re.sub(r"\\\n[ \t]*", " ", re.sub(fence, "", text, flags=re.S | re.M))
        indented = r"^(?:    |\t)\$? ?(.*)$"              # an indented block: one command a line
        chunks += re.findall(indented, prose, re.M)
        prose = re.sub(indented, "", prose, flags=re.M)
        chunks.append(re.sub(r"\n(?!\n)[ \t]*", " ", prose))   # a code span may break a line; it ends at its backtick
        for chunk in chunks:
            for line in chunk.splitlines():
                for m in COMMAND.finditer(line):
                    cmd = re.split(r"\s+#|\s+\(and |\s{3,}", m.group(1))[0].strip()
                    found.setdefault((m.group(2), cmd), doc.relative_to(ROOT).as_posix())
    return [(where, bench, shlex.split(cmd)[1:]) for (bench, cmd), where in sorted(found.items())]


COMMANDS = _commands()


class _Parsed(Exception):
    pass


def test_the_docs_show_bench_commands():
    benches = {b for _, b, _ in COMMANDS}
    assert len(COMMANDS) >= 40 and {"router_sweep", "router_replay", "vs_peers", "gpu_reload"} <= benches


@pytest.mark.parametrize("where,bench,argv", COMMANDS, ids=[f"{b}:{' '.join(a)}"[:80] for _, b, a in COMMANDS])
def test_a_documented_bench_command_parses(where, bench, argv, monkeypatch):
    parse = argparse.ArgumentParser.parse_args

    def parsed(self, args=None, namespace=None):
        parse(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parsed)
    monkeypatch.setattr(sys, "argv", [f"bench/{bench}.py", *argv])
    monkeypatch.chdir(ROOT)                         # as the docs run them: from the repository's root
    main = importlib.import_module(f"bench.{bench}").main
    try:
        with pytest.raises(_Parsed):
            main(argv) if main.__code__.co_argcount else main()
    except SystemExit as exc:       # a usage error: argparse has printed it
        pytest.fail(f"{where}: `python bench/{bench}.py {' '.join(argv)}` exits {exc.code} while parsing")
