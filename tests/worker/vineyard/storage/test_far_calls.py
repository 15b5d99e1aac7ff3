# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Calls made at once where the root is a round trip away
(:func:`calls_at_once_when_far`): results in order and lazily, one call at
a time while each is quick, then waves of at most :data:`CALLS_AT_ONCE`;
an error raised where its result would be, the threads serving on."""

from __future__ import annotations

import os
import threading
import time

import pytest

from vllm.worker.vineyard.storage import far_calls
from vllm.worker.vineyard.storage.far_calls import (
    CALLS_AT_ONCE,
    calls_at_once_when_far,
)


class Calls:
    """A call per item (its result: ten times the item) that takes a round
    trip from item ``slow_from`` on and raises at item ``fail_at``; records
    the items called and the most calls in flight at once."""

    def __init__(self, slow_from: int = 0, fail_at: int | None = None):
        self.slow_from, self.fail_at = slow_from, fail_at
        self.made: list[int] = []
        self.in_flight = self.most = 0
        self._lock = threading.Lock()

    def __call__(self, item: int) -> int:
        with self._lock:
            self.made.append(item)
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
        try:
            if item >= self.slow_from:
                time.sleep(0.002)  # a round trip: above FAR_CALL_S
            if item == self.fail_at:
                raise RuntimeError(f"call {item} failed")
            return 10 * item
        finally:
            with self._lock:
                self.in_flight -= 1


def test_quick_calls_go_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(far_calls, "FAR_CALL_S", 10.0)
    calls = Calls()
    assert list(calls_at_once_when_far(calls, range(40))) == list(range(0, 400, 10))
    assert calls.most == 1


@pytest.mark.parametrize("slow_from", [0, 1, 20])
def test_once_a_call_is_slow_the_next_go_at_once(slow_from: int) -> None:
    """From the first slow call on (the first ones may come from a
    client's attribute cache)."""
    calls = Calls(slow_from)
    assert list(calls_at_once_when_far(calls, range(60))) == list(range(0, 600, 10))
    assert sorted(calls.made) == list(range(60))
    assert 1 < calls.most <= CALLS_AT_ONCE


def test_a_caller_that_stops_early_made_one_wave_at_most() -> None:
    calls = Calls()
    for result in calls_at_once_when_far(calls, range(100)):
        if result == 50:
            break
    # The first call alone (slow), then one wave of which item 5 was read.
    assert sorted(calls.made) == list(range(1 + CALLS_AT_ONCE))


def test_an_error_is_raised_in_order_and_the_threads_go_on() -> None:
    calls = Calls(fail_at=7)
    got = []
    with pytest.raises(RuntimeError, match="call 7 failed"):
        for result in calls_at_once_when_far(calls, range(40)):
            got.append(result)
    assert got == list(range(0, 70, 10))
    again = Calls()
    assert list(calls_at_once_when_far(again, range(40))) == list(range(0, 400, 10))
    assert again.most > 1


def test_a_forked_child_makes_its_own_threads() -> None:
    list(calls_at_once_when_far(Calls(), range(20)))  # the parent's threads
    pid = os.fork()
    if pid == 0:  # the child: its calls at once must not wait forever
        code = 0
        try:
            calls = Calls()
            results = list(calls_at_once_when_far(calls, range(20)))
            code = 0 if results == list(range(0, 200, 10)) and calls.most > 1 else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("a forked child's calls at once never returned")
