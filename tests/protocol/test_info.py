"""The INFO text format: what the node renders, the client parses back (protocol/info.py)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.protocol.info import parse_info, render_info

def numeric(s: str) -> bool:
    """A string the text format reads back as a number ("12", "-1.5", but also "inf", "nan")."""
    try:
        float(s)
    except ValueError:
        return False
    return True


names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_0123456789", min_size=1, max_size=12)
values = st.one_of(st.integers(-(1 << 62), 1 << 62), st.booleans(),
                   st.text(alphabet="abcdefghijklmnopqrstuvwxyz-./ ", min_size=1, max_size=20)
                   .filter(lambda s: s.strip() == s and not numeric(s)))


def test_sections_render_as_redis_style_text():
    text = render_info({"Server": {"node_id": "n1", "draining": False, "uptime_s": 1.5}, "Store": {"blocks": 3}})
    assert text == "# Server\r\nnode_id:n1\r\ndraining:0\r\nuptime_s:1.5\r\n\r\n# Store\r\nblocks:3\r\n"


@settings(max_examples=200, deadline=None)
@given(sections=st.dictionaries(names.map(str.capitalize), st.dictionaries(names, values, max_size=8),
                                min_size=1, max_size=4))
def test_what_is_rendered_parses_back(sections):
    expected = {s: {k: int(v) if isinstance(v, bool) else v for k, v in kv.items()} for s, kv in sections.items()}
    assert parse_info(render_info(sections)) == expected


def test_floats_keep_six_significant_digits():
    assert parse_info(render_info({"S": {"x": 1 / 3}})) == {"S": {"x": 0.333333}}
