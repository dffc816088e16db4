"""HeldSignals: SIGINT/SIGTERM are recorded while held and delivered to the previous handler after."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from hybridmem.switch.transaction import HeldSignals


@pytest.fixture
def default_sigint():
    """Python's own SIGINT handler for the test, the previous one restored after.

    Python installs ``default_int_handler`` only where SIGINT was not ignored at startup; a test run
    started as a background job of a non-interactive shell inherits SIGINT ignored, and a SIGINT sent
    there raises nothing.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def sigterm_calls():
    calls: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    yield calls
    signal.signal(signal.SIGTERM, previous)


def test_a_signal_is_held_then_delivered_once_to_the_previous_handler(sigterm_calls):
    with HeldSignals() as held:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert held.pending == [signal.SIGTERM] and sigterm_calls == []
    assert sigterm_calls == [signal.SIGTERM]


def test_sigint_becomes_keyboard_interrupt_after_the_hold(default_sigint):
    with pytest.raises(KeyboardInterrupt):
        with HeldSignals():
            os.kill(os.getpid(), signal.SIGINT)
            reached = True  # the interrupt did not stop the held block
    assert reached
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_nested_holds_hand_the_signal_outwards(sigterm_calls):
    with HeldSignals() as outer:
        with HeldSignals():
            os.kill(os.getpid(), signal.SIGTERM)
        assert outer.pending == [signal.SIGTERM] and sigterm_calls == []
    assert sigterm_calls == [signal.SIGTERM]


def test_an_ignored_signal_stays_ignored():
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with HeldSignals() as held:
            os.kill(os.getpid(), signal.SIGTERM)
        assert held.pending == [] and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_outside_the_main_thread_nothing_is_installed():
    seen = {}

    def body():
        with HeldSignals() as held:
            seen["active"] = held.active

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == {"active": False}
