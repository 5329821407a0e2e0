"""errors.py: one status per class, one function from a status back to its exception."""
from __future__ import annotations

import pytest

from quillcache.errors import (
    STATUS_CLASSES, CapacityError, NotFound, QuillCacheError, UnsafeReuse, error_for_status,
)
from quillcache.protocol import messages
from quillcache.protocol.opcodes import Status


@pytest.mark.parametrize("status", sorted(STATUS_CLASSES))
def test_every_status_gives_its_class_directly_and_through_an_error_reply(status):
    cls = STATUS_CLASSES[status]
    err = error_for_status(status, "why")
    assert type(err) is cls and err.status == status == Status(status) and str(err) == "why"
    original = error_for_status(status, "over the wire")
    back = messages.decode_error(*messages.encode_error(original))
    assert type(back) is cls and str(back) == "over the wire"


def test_the_details_of_unsafe_reuse_and_capacity_are_kept():
    err = error_for_status(UnsafeReuse.status, "m", violation="tokenizer")
    assert err.violation == "tokenizer"
    back = messages.decode_error(*messages.encode_error(err))
    assert isinstance(back, UnsafeReuse) and back.violation == "tokenizer"
    cap = error_for_status(CapacityError.status, "full", capacity=(10, 2, 1))
    assert (cap.requested, cap.free, cap.largest_free) == (10, 2, 1)


def test_an_unknown_status_is_a_quillcache_error_carrying_it():
    err = error_for_status(999, "odd")
    assert type(err) is QuillCacheError and err.status == 999
    assert error_for_status(NotFound.status, "x").status == 3
