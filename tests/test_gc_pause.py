"""The collector's pause changes nothing anyone else sets, under threads and signals.

Trainers disable the collector on purpose and collect by hand; a pause running in another
thread must keep whatever they set, and an interrupt at any point of a pause must leave the
collector as it was."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time

import pytest

from dsdmerge import _gc
from dsdmerge._gc import gc_paused


@pytest.fixture(autouse=True)
def collector_as_it_was():
    enabled, thresholds = gc.isenabled(), gc.get_threshold()
    yield
    assert gc.get_threshold() == thresholds
    assert not _gc._pausers
    (gc.enable if enabled else gc.disable)()


def in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn)
    t.start()
    return t


def test_a_disable_another_thread_makes_during_a_pause_is_kept():
    gc.enable()
    inside, done = threading.Event(), threading.Event()

    def pause():
        with gc_paused():
            inside.set()
            assert done.wait(10)

    t = in_thread(pause)
    assert inside.wait(10)
    gc.disable()  # the trainer, meanwhile: collect by hand from now on
    done.set()
    t.join()
    assert not gc.isenabled()
    # and the other way round
    inside.clear()
    done.clear()
    t = in_thread(pause)
    assert inside.wait(10)
    gc.enable()
    done.set()
    t.join()
    assert gc.isenabled()


def test_overlapping_pauses_in_two_threads_end_as_one():
    before = gc.get_threshold()
    a_in, b_in, a_out, b_out = (threading.Event() for _ in range(4))

    def a():
        with gc_paused():
            a_in.set()
            assert a_out.wait(10)

    def b():
        assert a_in.wait(10)
        with gc_paused():
            b_in.set()
            assert b_out.wait(10)

    ta, tb = in_thread(a), in_thread(b)
    assert b_in.wait(10)
    a_out.set()
    ta.join()
    assert gc.get_threshold()[0] == 0  # b still builds: still paused
    b_out.set()
    tb.join()
    assert gc.get_threshold() == before


def test_thresholds_another_thread_sets_during_a_pause_are_kept():
    before = gc.get_threshold()
    with gc_paused():
        gc.set_threshold(1234, 5, 6)
    assert gc.get_threshold() == (1234, 5, 6)
    gc.set_threshold(*before)
    gc.set_threshold(0, *before[1:])  # collections off by thresholds already: left off
    with gc_paused():
        pass
    assert gc.get_threshold() == (0, *before[1:])
    gc.set_threshold(*before)
    gc.disable()
    with gc_paused():
        assert gc.collect() >= 0  # collecting by hand still works
    assert not gc.isenabled()


def _interrupt_at(n: int) -> bool:
    """Run a pause with a KeyboardInterrupt raised at the ``n``-th start of a function (or
    resumption of a generator) in the pause's code, contextlib's and the ``with`` around
    it: where CPython raises a signal's exception (its RESUME check); whether it was
    raised. The points after each call (the other check) are hit by the test below, with
    real signals."""
    count = 0
    raised = False
    here = {_gc.__file__, __file__, _gc.contextlib.__file__}

    def tracer(frame, event, arg):
        nonlocal count, raised
        if frame.f_code.co_filename not in here:
            return None
        if event == "call":
            count += 1
            if count == n and not raised:
                raised = True
                raise KeyboardInterrupt
        return tracer

    def run():
        with gc_paused():
            x = [1, 2]
            del x

    sys.settrace(tracer)
    try:
        run()
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    return raised


def test_an_interrupt_at_any_point_of_a_pause_leaves_the_collector_as_it_was():
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        before = gc.get_threshold()
        n = 0
        while True:
            n += 1
            if not _interrupt_at(n):
                break
            assert gc.get_threshold() == before, n
            assert gc.isenabled() == enabled, n
            assert not _gc._pausers, n
        assert n > 8  # every start of the functions starting and ending the pause was tried


@pytest.mark.skipif(sys.platform == "win32", reason="signals")
def test_real_sigints_during_pauses_leave_the_collector_as_it_was():
    """SIGINT from another thread, at whatever point the main thread's pauses are: one at a
    time, the next once the last was handled; raised as KeyboardInterrupt while pausing.
    Once the interrupt is handled, the collector is as it was: at once when it lands in
    the pause's own code, else when the exception is released (it holds contextlib's
    frame around the pause, whose generator then ends the pause)."""
    before = gc.get_threshold()
    handled = threading.Event()
    sent = 300
    armed = False

    def on_sigint(signum, frame):
        if armed:
            raise KeyboardInterrupt
        handled.set()  # it came between two tries: on to the next

    finished = threading.Event()

    def ctrl_c():
        try:
            for i in range(sent):
                time.sleep(0.00005 * (i % 11))
                handled.clear()
                os.kill(os.getpid(), signal.SIGINT)
                assert handled.wait(10)
        finally:
            finished.set()

    old = signal.signal(signal.SIGINT, on_sigint)
    interrupted = 0
    try:
        t = in_thread(ctrl_c)
        while not finished.is_set():
            try:
                armed = True
                while not finished.is_set():
                    with gc_paused():
                        sum(range(50))
            except KeyboardInterrupt:
                armed = False
                interrupted += 1
            # the exception handled (released): the collector is as it was
            assert gc.get_threshold() == before
            assert not _gc._pausers
            handled.set()
        t.join()
    finally:
        signal.signal(signal.SIGINT, old)
    assert interrupted > sent // 2
    assert gc.get_threshold() == before
