"""The man pages are generated from the click commands and the registry; stale pages fail."""
from pathlib import Path

import pytest

from quillcache.node.settings import SETTINGS
from quillcache_cli.manpages import PAGES

MAN = Path(__file__).resolve().parents[2] / "man"


@pytest.mark.parametrize("name", sorted(PAGES))
def test_committed_man_page_is_current(name):
    assert (MAN / name).read_text() == PAGES[name](), f"man/{name} is stale: run `make man`"


def test_toml_page_documents_every_setting():
    page = PAGES["quillcache.toml.5"]()
    for s in SETTINGS:
        assert f"\\fB{s.name}\\fR" in page and f".SS [{s.section}]" in page
