"""The KV-event codec (both encodings), the publisher's replay ring, and the SUB consumer's
gap detection and replay, over real ZMQ sockets on loopback."""
import time

import msgpack
import pytest
import zmq
from hypothesis import given, settings, strategies as st

from quillcache.control.events import (
    AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, EventConsumer, EventDecodeError,
    EventLimits, EventPublisher, decode_batch, encode_batch, encode_seq,
)
from tests._support.net import free_port


def tcp():
    return f"tcp://127.0.0.1:{free_port()}"


STORED = BlockStored(block_hashes=(b"\x01" * 32, 7), parent_block_hash=b"\x00" * 32,
                     token_ids=tuple(range(32)), block_size=16, lora_id=3, medium="GPU",
                     lora_name="ad1")


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_batch_round_trips_in_both_encodings(encoding):
    batch = EventBatch(12.5, (STORED, BlockRemoved((7,), "CPU"), AllBlocksCleared()), 2)
    assert decode_batch(encode_batch(batch, encoding)) == batch


def test_map_tagged_events_select_fields_by_name_and_ignore_unknown_ones():
    payload = msgpack.packb({"ts": 1.0, "data_parallel_rank": 0, "future": [1, 2], "events": [
        {"type": "BlockStored", "token_ids": [1, 2], "block_size": 2, "block_hashes": [5],
         "parent_block_hash": None, "extra_keys": [["x"]], "group_idx": 0},
        {"type": "SomethingNew", "x": 1},
        {"block_hashes": [5], "type": "BlockRemoved"},
    ]}, use_bin_type=True)
    batch = decode_batch(payload)
    assert batch.events == (BlockStored((5,), None, (1, 2), 2), BlockRemoved((5,)))
    assert batch.data_parallel_rank == 0


def test_sglang_array_events_without_medium_decode():
    # SGLang: EventBatch [ts, events], events tagged arrays ending at lora_id.
    payload = msgpack.packb([3.0, [["BlockStored", [1, 2], None, [9] * 8, 4, None],
                                   ["BlockRemoved", [1]], ["AllBlocksCleared"]]])
    batch = decode_batch(payload)
    assert batch.events == (BlockStored((1, 2), None, (9,) * 8, 4), BlockRemoved((1,)),
                            AllBlocksCleared())
    assert batch.data_parallel_rank is None


@pytest.mark.parametrize("payload, message", [
    (b"\xc1", "not msgpack"),
    (msgpack.packb(5), "neither"),
    (msgpack.packb([1.0, {"a": 1}]), "events must be an array"),
    (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1.5]}]]), "int or bytes"),
    (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [-1]}]]),
     "0..2\\*\\*32-1"),
    (msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [b"x" * 65]}]]), "65-byte"),
    (msgpack.packb([1.0, [["AllBlocksCleared"]] * 5]), "5 events"),
])
def test_bad_payloads_get_a_clear_error(payload, message):
    with pytest.raises(EventDecodeError, match=message):
        decode_batch(payload, EventLimits(max_events=4))


hash_st = st.one_of(st.integers(-(1 << 63), (1 << 64) - 1), st.binary(min_size=1, max_size=32))
event_st = st.one_of(
    st.builds(BlockStored, st.lists(hash_st, max_size=5).map(tuple), st.none() | hash_st,
              st.lists(st.integers(0, 1 << 31), max_size=20).map(tuple), st.integers(0, 64),
              st.none() | st.integers(0, 100), st.none() | st.sampled_from(["GPU", "cpu", "disk"]),
              st.none() | st.text(max_size=8)),
    st.builds(BlockRemoved, st.lists(hash_st, max_size=5).map(tuple),
              st.none() | st.sampled_from(["GPU", "cpu"])),
    st.builds(AllBlocksCleared),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(event_st, max_size=6), st.sampled_from(["map", "array"]))
def test_codec_round_trip_property(events, encoding):
    batch = EventBatch(1.0, tuple(events), None)
    assert decode_batch(encode_batch(batch, encoding)) == batch


# --------------------------------------------------------------------------- sockets


def _collect(consumer, want, deadline=5.0):
    end = time.monotonic() + deadline
    while time.monotonic() < end and len(want) < want.target:
        consumer.poll(0.05)


class Seen(list):
    target = 0


def _joined(pub, consumer, seen):
    """Defeat the slow-joiner race: publish probes until the SUB receives one."""
    end = time.monotonic() + 5
    while time.monotonic() < end:
        pub.publish([AllBlocksCleared("probe")])
        if consumer.poll(0.05):
            break
    assert consumer.last_seq is not None, "subscriber never joined"
    seen.clear()


def test_consumer_receives_batches_in_order_over_tcp():
    seen = Seen()
    with EventPublisher(tcp(), tcp(), topic="w0") as pub, \
            EventConsumer(pub.endpoint, lambda s, b: seen.append((s, b)),
                          replay_endpoint=pub.replay_endpoint) as con:
        _joined(pub, con, seen)
        for i in range(20):
            pub.publish([STORED], ts=float(i))
        seen.target = 20
        _collect(con, seen)
        assert [b.ts for _, b in seen] == [float(i) for i in range(20)]
        assert [s for s, _ in seen] == list(range(seen[0][0], seen[0][0] + 20))
        assert con.stats.gaps == 0 and con.stats.lost == 0


def test_sequence_gap_is_filled_by_replay():
    seen = Seen()
    with EventPublisher(tcp(), tcp()) as pub, \
            EventConsumer(pub.endpoint, lambda s, b: seen.append(s),
                          replay_endpoint=pub.replay_endpoint) as con:
        _joined(pub, con, seen)
        first = pub.next_seq
        # Three batches the SUB never sees: numbered and kept for replay, not sent.
        for i in range(3):
            with pub._lock:     # test-only: simulate a PUB drop
                seq = pub._seq
                pub._seq += 1
                pub._buffer.append((seq, encode_batch(EventBatch(float(i), (STORED,)))))
        pub.publish([BlockRemoved((1,))])
        seen.target = 4
        _collect(con, seen)
        assert seen == [first, first + 1, first + 2, first + 3]
        # the replay also brings the batch that revealed the gap; it is applied once
        assert con.stats.gaps == 1 and con.stats.replayed == 4 and con.stats.lost == 0


def test_gap_older_than_the_ring_is_counted_lost_and_resets_the_source():
    seen, resets = Seen(), []
    with EventPublisher(tcp(), tcp(), buffer_steps=2) as pub, \
            EventConsumer(pub.endpoint, lambda s, b: seen.append(s), replay_endpoint=pub.replay_endpoint,
                          on_reset=lambda: resets.append(1), replay_timeout=0.5) as con:
        _joined(pub, con, seen)
        with pub._lock:
            for _ in range(5):
                pub._buffer.append((pub._seq, encode_batch(EventBatch(0.0))))
                pub._seq += 1
        pub.publish([BlockRemoved((1,))])
        seen.target = 1
        _collect(con, seen)
        assert seen[-1] == pub.next_seq - 1
        assert con.stats.lost > 0 and resets


def test_dropped_replay_replies_are_re_requested_from_the_last_seq_seen():
    """A fake publisher ROUTER that answers the first replay request with one batch and then
    goes silent; the consumer must ask again from the batch after it."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:0")
    rep_ep = router.getsockopt(zmq.LAST_ENDPOINT).decode()
    seen = []
    con = EventConsumer("tcp://127.0.0.1:1", lambda s, b: seen.append(s), replay_endpoint=rep_ep,
                        replay_timeout=0.3)
    con.stats.last_seq = 9
    requests = []
    import threading

    def serve():
        for attempt in range(2):
            if not router.poll(3000):
                return
            ident, _, start = router.recv_multipart()
            requests.append(int.from_bytes(start, "big", signed=True))
            payload = encode_batch(EventBatch(0.0))
            if attempt == 0:
                router.send_multipart([ident, b"", b"t", encode_seq(10), payload])  # then silence
            else:
                for s in (11, 12):
                    router.send_multipart([ident, b"", b"t", encode_seq(s), payload])
                router.send_multipart([ident, b"", b"t", encode_seq(-1), b""])

    t = threading.Thread(target=serve)
    t.start()
    try:
        con.replay(10, 13)
    finally:
        t.join(5)
        router.close(0)
        con.close()
    assert requests == [10, 11]
    assert seen == [10, 11, 12]
