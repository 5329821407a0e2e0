"""quillcache._native.sockio: a receive that polls for a bounded time, then blocks.

Driven over real socket pairs (AF_UNIX) and a real TCP pair on loopback: what the poll
catches, when it gives up and pauses, and that it behaves as ``socket.recv_into`` at the
edges (EOF, a receive timeout, a closed descriptor, a signal, a read-only buffer).
"""
import os
import signal
import socket
import threading
import time

import pytest

from quillcache._native.sockio import MAX_SPIN_NS, SpinReceiver
from quillcache.client.calls import timeval

MISS_LIMIT = 8                  # the extension's constants (sockio.pyx), as the tests rely on them
SKIP_AFTER_MISSES = 64


@pytest.fixture()
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def _rcvtimeo(sock, seconds):
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(seconds))     # as the client sets it


def test_data_already_there_is_received_without_polling_or_blocking(pair):
    a, b = pair
    rx = SpinReceiver(1_000_000)
    b.sendall(b"hello")
    buf = bytearray(16)
    assert rx.recv_into(a.fileno(), buf) == 5
    assert bytes(buf[:5]) == b"hello"
    assert (rx.caught, rx.missed, rx.skipped) == (1, 0, 0)


def test_a_reply_that_comes_while_polling_is_caught_and_the_receive_does_not_sleep(pair):
    a, b = pair
    rx = SpinReceiver(MAX_SPIN_NS)             # 10 ms: far longer than the writer's delay
    t = threading.Timer(0.001, b.sendall, args=(b"x" * 100,))
    t.start()
    buf = bytearray(4096)
    t0 = time.monotonic()
    n = rx.recv_into(a.fileno(), buf)
    elapsed = time.monotonic() - t0
    t.join()
    assert n == 100 and bytes(buf[:n]) == b"x" * 100
    # caught; or the writer's thread was kept off a CPU for the whole 10 ms (a loaded machine)
    assert (rx.caught, rx.missed) == (1, 0) or elapsed >= 0.01


def test_a_reply_later_than_the_poll_is_received_after_the_receive_sleeps(pair):
    a, b = pair
    rx = SpinReceiver(20_000)                  # 20 us
    t = threading.Timer(0.05, b.sendall, args=(b"late",))
    t.start()
    buf = bytearray(8)
    t0 = time.monotonic()
    assert rx.recv_into(a.fileno(), buf) == 4
    assert time.monotonic() - t0 >= 0.04
    t.join()
    assert bytes(buf[:4]) == b"late"
    assert (rx.caught, rx.missed) == (0, 1)


def test_polls_that_keep_missing_pause_polling_then_it_is_tried_again(pair):
    a, b = pair
    rx = SpinReceiver(10_000)                  # 10 us; the writer answers each after 5 ms
    buf = bytearray(8)

    def one_late():
        t = threading.Timer(0.005, b.sendall, args=(b"z",))
        t.start()
        assert rx.recv_into(a.fileno(), buf) == 1
        t.join()

    for _ in range(MISS_LIMIT):
        one_late()
    assert (rx.missed, rx.skipped) == (MISS_LIMIT, 0)
    for _ in range(SKIP_AFTER_MISSES):         # these sleep at once
        one_late()
    assert (rx.missed, rx.skipped) == (MISS_LIMIT, SKIP_AFTER_MISSES)
    one_late()                                 # polled again (and missed again)
    assert (rx.missed, rx.skipped) == (MISS_LIMIT + 1, SKIP_AFTER_MISSES)


def test_a_caught_reply_resets_the_run_of_misses(pair):
    a, b = pair
    rx = SpinReceiver(10_000)
    buf = bytearray(8)
    for _ in range(MISS_LIMIT - 1):
        t = threading.Timer(0.005, b.sendall, args=(b"z",))
        t.start()
        rx.recv_into(a.fileno(), buf)
        t.join()
    b.sendall(b"now")
    rx.recv_into(a.fileno(), buf)              # caught: the run of misses starts over
    for _ in range(MISS_LIMIT - 1):
        t = threading.Timer(0.005, b.sendall, args=(b"z",))
        t.start()
        rx.recv_into(a.fileno(), buf)
        t.join()
    assert rx.skipped == 0 and rx.missed == 2 * (MISS_LIMIT - 1)


def test_zero_spin_blocks_at_once_and_counts_nothing(pair):
    a, b = pair
    rx = SpinReceiver(0)
    t = threading.Timer(0.01, b.sendall, args=(b"abc",))
    t.start()
    buf = bytearray(8)
    assert rx.recv_into(a.fileno(), buf) == 3
    t.join()
    assert (rx.caught, rx.missed, rx.skipped) == (0, 0, 0)


@pytest.mark.parametrize("spin_ns", [0, 50_000])
def test_the_peer_closing_reads_as_zero_bytes(pair, spin_ns):
    a, b = pair
    b.close()
    assert SpinReceiver(spin_ns).recv_into(a.fileno(), bytearray(8)) == 0


@pytest.mark.parametrize("spin_ns", [0, 50_000])
def test_the_receive_timeout_raises_blocking_io_error(pair, spin_ns):
    a, _b = pair
    _rcvtimeo(a, 0.02)
    with pytest.raises(BlockingIOError):
        SpinReceiver(spin_ns).recv_into(a.fileno(), bytearray(8))


def test_a_closed_descriptor_raises_oserror_with_its_errno():
    a, b = socket.socketpair()
    fd = a.fileno()
    a.close()
    b.close()
    with pytest.raises(OSError) as info:
        SpinReceiver(50_000).recv_into(fd, bytearray(8))
    assert info.value.errno == 9           # EBADF


def test_a_signal_runs_its_handler_and_the_receive_goes_on(pair):
    a, b = pair
    seen = []
    old = signal.signal(signal.SIGALRM, lambda *_: seen.append(1))
    t = threading.Timer(0.05, b.sendall, args=(b"after",))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.01)
        t.start()
        buf = bytearray(8)
        assert SpinReceiver(10_000).recv_into(a.fileno(), buf) == 5
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        t.join()
    assert seen and bytes(buf[:5]) == b"after"


def test_an_exception_from_a_signal_handler_ends_the_receive(pair):
    a, _b = pair

    def handler(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.01)
        with pytest.raises(KeyboardInterrupt):
            SpinReceiver(10_000).recv_into(a.fileno(), bytearray(8))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_the_gil_is_released_while_polling_and_while_blocked(pair):
    a, _b = pair
    _rcvtimeo(a, 0.2)
    counted = []
    stop = threading.Event()

    def count():
        n = 0
        while not stop.is_set():
            n += 1
        counted.append(n)

    th = threading.Thread(target=count)
    th.start()
    try:
        with pytest.raises(BlockingIOError):       # 10 ms of polling, then asleep until the timeout
            SpinReceiver(MAX_SPIN_NS).recv_into(a.fileno(), bytearray(8))
    finally:
        stop.set()
        th.join()
    assert counted[0] > 10_000                     # the other thread ran meanwhile


def test_receives_into_any_writable_contiguous_buffer_over_tcp():
    import numpy as np
    srv = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(srv.getsockname())
    b, _ = srv.accept()
    try:
        rx = SpinReceiver(100_000)
        data = os.urandom(1 << 16)
        for dst in (bytearray(len(data)), np.empty(len(data), np.uint8), memoryview(bytearray(len(data) + 3))[3:]):
            b.sendall(data)
            got = 0
            view = memoryview(dst).cast("B")
            while got < len(data):
                got += rx.recv_into(a.fileno(), view[got:])
            assert bytes(view[:len(data)]) == data
        assert rx.caught >= 3
    finally:
        a.close()
        b.close()
        srv.close()


def test_bad_arguments_are_refused_before_any_receive(pair):
    a, b = pair
    b.sendall(b"kept")
    with pytest.raises(ValueError, match="spin_ns"):
        SpinReceiver(-1)
    with pytest.raises(ValueError, match="spin_ns"):
        SpinReceiver(MAX_SPIN_NS + 1)
    with pytest.raises((BufferError, TypeError)):
        SpinReceiver(0).recv_into(a.fileno(), b"read-only")
    with pytest.raises((BufferError, TypeError)):
        SpinReceiver(0).recv_into(a.fileno(), memoryview(bytearray(8)).toreadonly())
    buf = bytearray(8)
    assert SpinReceiver(0).recv_into(a.fileno(), buf) == 4 and bytes(buf[:4]) == b"kept"   # nothing lost
