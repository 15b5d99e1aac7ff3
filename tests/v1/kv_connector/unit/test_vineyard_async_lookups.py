# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler's background lookups (thread logic): a lookup answers
``None`` while pending and its result later, a lookup past its deadline is
a counted miss, and a lookup thread stuck in the filesystem is abandoned
so later lookups are still answered. The filesystem is a stand-in here
(a lookup that blocks until released); the real lookups run in the
connector tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import pytest

from tests.vineyard_testing import wait_until
from vllm.worker.vineyard.connector.lookups import (
    MAX_STUCK_THREADS,
    BackgroundLookups,
    VineyardCacheLookup,
)
from vllm.worker.vineyard.metrics import VineyardCacheMetrics

pytestmark = pytest.mark.timeout(60)


class GatedLookup:
    """Answers ``(num_tokens - 1, num_tokens)``, but each lookup of a
    request id in ``held`` blocks until that id is released."""

    def __init__(self) -> None:
        self.metrics = VineyardCacheMetrics(False)
        self.held: dict[int, threading.Event] = {}
        self.took_s: dict[int, float] = {}  # a slow (not hung) filesystem
        self.calls = 0
        self._lock = threading.Lock()
        self.in_gate: set[threading.Thread] = set()  # threads held now

    def find(
        self, digests: Sequence[bytes], num_local_tokens: int, num_tokens: int
    ) -> tuple[int, int]:
        self.calls += 1
        gate = self.held.get(num_tokens)
        if gate is not None:
            me = threading.current_thread()
            with self._lock:
                self.in_gate.add(me)
            gate.wait()
            with self._lock:
                self.in_gate.discard(me)
        time.sleep(self.took_s.get(num_tokens, 0.0))
        return num_tokens - 1 - num_local_tokens, num_tokens

    def count(self, *args: int) -> None:
        self.metrics.add("hit_tokens", args[-1])

    def close(self) -> None:
        pass


@pytest.fixture
def gated() -> Iterator[GatedLookup]:
    lookup = GatedLookup()
    yield lookup
    for gate in lookup.held.values():
        gate.set()  # let abandoned threads finish


def make(lookup: GatedLookup, timeout_s: float) -> BackgroundLookups:
    real: VineyardCacheLookup = lookup  # type: ignore[assignment]
    return BackgroundLookups(real, timeout_s)


def ask(lookups: BackgroundLookups, req_id: str, num_tokens: int):
    return lookups.lookup(req_id, [], 0, num_tokens)


def until_answered(
    lookups: BackgroundLookups, req_id: str, num_tokens: int, limit_s: float = 10.0
) -> tuple[int, int]:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        lookups.begin_step()
        answer = ask(lookups, req_id, num_tokens)
        if answer is not None:
            return answer
        time.sleep(0.01)
    raise AssertionError("no answer")


def test_a_fast_lookup_is_answered_in_the_step_that_asks(gated: GatedLookup) -> None:
    """A lookup that finishes within the step's share of waiting is
    answered in that step (the share is widened here: a loaded test
    machine may not run the lookup thread within the real 5 ms; the wait
    is passed, as a patched STEP_WAIT_S is not ``begin_step``'s default)."""
    lookups = make(gated, timeout_s=5.0)
    lookups.begin_step(wait_s=2.0)
    assert ask(lookups, "fast", 100) == (99, 100)


def test_a_step_waits_what_it_is_given_for_its_lookups(gated: GatedLookup) -> None:
    """A step given more than STEP_WAIT_S (the scheduler gives a share of
    a long step) answers a lookup a few round trips long in that step."""
    gated.took_s[300] = gated.took_s[301] = 0.05
    lookups = make(gated, timeout_s=5.0)
    lookups.begin_step()
    assert ask(lookups, "near", 300) is None  # 5 ms: asked again next step
    lookups.begin_step(wait_s=2.0)
    assert ask(lookups, "far", 301) == (300, 301)


def test_a_pending_lookup_answers_none_then_its_result(gated: GatedLookup) -> None:
    gated.held[200] = threading.Event()
    lookups = make(gated, timeout_s=5.0)
    lookups.begin_step()
    start = time.monotonic()
    assert ask(lookups, "slow", 200) is None
    assert ask(lookups, "slow", 200) is None  # asked again: still pending
    # The step waited at most its small budget, not for the filesystem.
    assert time.monotonic() - start < 1.0
    gated.held[200].set()
    assert until_answered(lookups, "slow", 200) == (199, 200)
    assert lookups.metrics.totals["lookup_timeouts"] == 0


def test_a_lookup_past_its_deadline_is_a_counted_miss_and_later_ones_go_on(
    gated: GatedLookup,
) -> None:
    """The filesystem hangs for one lookup: that request is a miss after
    the deadline, and the requests after it are answered by a new thread
    (the stuck one is abandoned, never waited for)."""
    gated.held[300] = threading.Event()  # hangs until the test ends
    lookups = make(gated, timeout_s=0.3)
    lookups.begin_step()
    assert ask(lookups, "hung", 300) is None
    behind = ask(lookups, "behind", 50)  # queued behind the hung one
    assert behind is None
    # Asked step after step: pending until its deadline, then a miss.
    assert until_answered(lookups, "hung", 300) == (0, 0)
    assert lookups.metrics.totals["lookup_timeouts"] == 1
    # A new thread took over the queue: the request behind it is answered
    # (it may itself have passed the deadline while queued: then a miss).
    assert until_answered(lookups, "behind", 50) in ((49, 50), (0, 0))
    lookups.begin_step()
    assert until_answered(lookups, "after", 60) == (59, 60)
    lookups.close()


def test_a_changing_local_hit_re_aims_the_one_lookup(gated: GatedLookup) -> None:
    """vLLM's local hit of a waiting request changes every step (a
    sibling's chunked prefill fills its prefix cache): the request keeps its
    one filesystem pass, and its answer is taken off its latest local hit."""
    gated.held[400] = threading.Event()
    lookups = make(gated, timeout_s=5.0)
    for local in range(0, 160, 16):
        lookups.begin_step()
        assert lookups.lookup("moving", [], local, 400) is None
    gated.held[400].set()
    deadline = time.monotonic() + 10.0
    answer = None
    while answer is None and time.monotonic() < deadline:
        lookups.begin_step()
        answer = lookups.lookup("moving", [], 176, 400)
        time.sleep(0.01)
    assert answer == (399 - 176, 400)
    assert gated.calls == 1
    lookups.close()


def test_a_changing_local_hit_is_answered_by_its_first_deadline(
    gated: GatedLookup,
) -> None:
    """On a hung filesystem, a request whose local hit changes at every ask
    is a miss once its first ask's deadline has passed: never "ask again"
    past it, and one lookup in all."""
    gated.held[500] = threading.Event()  # hangs until the test ends
    lookups = make(gated, timeout_s=0.3)
    start = time.monotonic()
    answers = []
    for local in range(0, 16 * 100, 16):
        lookups.begin_step()
        answer = lookups.lookup("hung-moving", [], local, 500)
        answers.append((time.monotonic() - start, answer))
        if answer is not None:
            break
        time.sleep(0.02)
    waited, answer = answers[-1]
    assert answer == (0, 0)
    assert waited < 0.3 + 0.5  # the first deadline, with a step's slack
    assert all(a is None for _, a in answers[:-1])
    assert lookups.metrics.totals["lookup_timeouts"] == 1
    assert gated.calls == 1


def test_time_in_the_queue_is_not_stuck_time(
    gated: GatedLookup, caplog: pytest.LogCaptureFixture
) -> None:
    """A slow filesystem (each lookup 0.2 s, under the 0.5 s timeout) with
    lookups queued behind each other for longer than the timeout: no thread
    is taken for stuck, so no extra threads pile onto the slow disk."""
    lookups = make(gated, timeout_s=0.5)
    for n in range(10, 15):
        gated.took_s[n] = 0.2
        lookups.begin_step()
        lookups.lookup(f"slow-{n}", [], 0, n)
    deadline = time.monotonic() + 5.0
    while gated.calls < 5 and time.monotonic() < deadline:
        lookups.begin_step()
        time.sleep(0.02)
    assert gated.calls == 5
    assert not [r for r in caplog.records if "stuck" in r.getMessage()]
    lookups.close()


def test_threads_back_from_a_slow_filesystem_work_again(gated: GatedLookup) -> None:
    """Slow-filesystem episodes, one after another: every working lookup
    thread is stuck past the timeout, then the filesystem answers. In each
    episode, the fourth included, a replacement thread is started and other
    requests are answered; the abandoned threads are only those still stuck
    (a thread that comes back works again or exits); the live threads stay
    bounded (one working, plus those stuck)."""
    before = set(threading.enumerate())
    lookups = make(gated, timeout_s=1.0)

    def live() -> list[threading.Thread]:
        return [
            t
            for t in threading.enumerate()
            if t.name == "vineyard-cache-lookup" and t not in before
        ]

    assert wait_until(lambda: len(live()) == 1)
    for episode in range(4):
        gate = threading.Event()
        # Hold every live thread, each in a lookup of its own.
        stuck = len(live())
        for j in range(stuck):
            num_tokens = 1000 + 10 * episode + j
            gated.held[num_tokens] = gate
            lookups.begin_step()
            assert ask(lookups, f"stuck-{episode}-{j}", num_tokens) is None

        def all_held(n: int = stuck) -> bool:
            return len(gated.in_gate) == n

        assert wait_until(all_held), episode

        def replaced(n: int = stuck) -> bool:
            lookups.begin_step()
            return len(live()) > n

        assert wait_until(replaced), f"episode {episode}: no replacement thread"
        num_tokens = 100 + episode
        answer = until_answered(lookups, f"fresh-{episode}", num_tokens)
        assert answer == (num_tokens - 1, num_tokens), episode
        with lookups._lock:
            abandoned = list(lookups._abandoned)
        assert sorted(map(id, abandoned)) == sorted(map(id, gated.in_gate))
        assert len(live()) <= MAX_STUCK_THREADS + 1

        gate.set()  # the filesystem answers

        def recovered() -> bool:
            lookups.begin_step()
            return not lookups._abandoned and len(live()) == 1

        assert wait_until(recovered), (
            f"episode {episode}: {len(lookups._abandoned)} abandoned, "
            f"{len(live())} live"
        )
    assert lookups.metrics.totals["lookup_timeouts"] == 0
    lookups.close()
    assert wait_until(lambda: not live())
