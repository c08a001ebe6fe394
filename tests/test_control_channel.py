"""The control channel's bell: a local worker's messages wake the front end through an eventfd it
rings, not through the socket (runtime/control.py), and nothing is missed or left waiting."""

from __future__ import annotations

import threading
from multiprocessing import Pipe

import pytest

from afdserve.runtime.control import ControlChannel, new_bell, wait_any
from afdserve.runtime.messages import Heartbeat

pytestmark = pytest.mark.skipif(new_bell() is None, reason="no eventfd on this platform")


def _pair(bell: bool = True) -> tuple[ControlChannel, ControlChannel]:
    """(front end's side, worker's side) of a local socket pair, the worker ringing a bell."""
    front, worker = Pipe(duplex=True)
    fd = new_bell() if bell else None
    return ControlChannel(front, bell=fd), ControlChannel(worker, ring=fd)


def test_a_message_rings_the_bell_and_is_read_once():
    front, worker = _pair()
    try:
        assert wait_any([front], 0) == []
        worker.send(Heartbeat("w0"))
        assert wait_any([front], 5.0) == [front]
        assert front.recv() == Heartbeat("w0")
        assert wait_any([front], 0) == []  # the ring was taken with the message
    finally:
        front.close()
        worker.close()


def test_a_message_whose_ring_was_taken_unread_is_still_found():
    front, worker = _pair()
    other_front, other_worker = _pair()
    try:
        worker.send(Heartbeat("w0"))
        worker.send(Heartbeat("w0"))
        assert wait_any([front, other_front], 5.0) == [front]  # both rings taken
        assert front.recv() == Heartbeat("w0")  # one of the two messages read
        assert wait_any([front, other_front], 5.0) == [front]  # the other is found, not slept on
        assert front.recv() == Heartbeat("w0")
        assert wait_any([front, other_front], 0) == []
    finally:
        for c in (front, worker, other_front, other_worker):
            c.close()


def test_messages_from_another_thread_wake_the_waiter():
    front, worker = _pair()
    got: list[str] = []
    try:
        sender = threading.Thread(target=lambda: [worker.send(Heartbeat(f"w{i}")) for i in range(50)])
        sender.start()
        while len(got) < 50:
            assert wait_any([front], 10.0) == [front], "a sent message did not wake the wait"
            while front.conn.poll(0):
                got.append(front.recv().worker)
        sender.join()
        assert got == [f"w{i}" for i in range(50)]
    finally:
        front.close()
        worker.close()


def test_a_closed_worker_end_wakes_the_wait_without_a_ring():
    front, worker = _pair()
    try:
        worker.conn.close()  # the worker died: no ring, only the socket's hang-up
        assert wait_any([front], 10.0) == [front]
        with pytest.raises(EOFError):
            front.recv()
    finally:
        front.close()


def test_a_channel_without_a_bell_wakes_on_its_data():
    front, worker = _pair(bell=False)  # a Ray actor's TCP channel
    belled_front, belled_worker = _pair()
    try:
        assert wait_any([front, belled_front], 0) == []
        worker.send(Heartbeat("w0"))
        assert wait_any([front, belled_front], 5.0) == [front]
        assert front.recv() == Heartbeat("w0")
    finally:
        for c in (front, worker, belled_front, belled_worker):
            c.close()
