# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The loads the scheduler orders from the workers: asynchronous ones, and
ones in the step that schedules their request (vLLM's synchronous loads).

An asynchronous load ends in the step that starts it at the earliest, so its
request is computed a whole step later: in a busy engine, a step of the other
requests' prefills. A hit whose load is expected to take a small share of a
step is instead loaded by the workers before that step's forward pass, and its
request computed in the same step; every other request in the step waits for
the load meanwhile. So a step's loads are made so while they are expected to
take at most a step divided by the requests in it (one more than in the last
step), and at most :data:`MAX_SYNC_LOAD_STEP_SHARE` of a step: then the
others' wait in all is less than the step the request would wait loaded
asynchronously; a request alone in the engine delays no other, so its load is
made so at any price. A load that takes much longer than expected (see
:data:`SYNC_WAIT_STEPS`) stops where it is, and vLLM recomputes the rest of
its request (its failed blocks are reported in the same step)."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from vllm.worker.vineyard.connector.metadata import RequestDelta
from vllm.worker.vineyard.connector.request_state import RequestState

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

    from vllm.worker.vineyard.connector.load_costs import LoadCosts

#: The largest share of the engine's last step that a step's loads before
#: its forward pass may be expected to take, in all (see the module).
MAX_SYNC_LOAD_STEP_SHARE = 0.5
#: A load before a forward pass is waited for this many times its expected
#: time plus :data:`SYNC_WAIT_SLACK_S`, or :data:`SYNC_WAIT_STEPS` times the
#: engine's last step, whichever is longer, not counting its reader's wait
#: for a CPU (computing the rest would wait for one too); then it stops where
#: it is. Loaded asynchronously, its request would have waited a step.
SYNC_WAIT_FACTOR = 4.0
SYNC_WAIT_SLACK_S = 0.02
SYNC_WAIT_STEPS = 1.0
#: Steps whose outputs may be outstanding (vLLM's async scheduling).
MAX_STEPS_IN_FLIGHT = 2


class LoadOrders:
    """The scheduler's loads: which hits load before their step's forward
    pass, what each order carries, and when a synchronous one is over."""

    def __init__(self, costs: LoadCosts, block_size: int) -> None:
        self._costs = costs
        self._block_size = block_size
        self._planned_s = 0.0  # expected time of this step's loads so far
        self._last_requests = 0  # requests in the last step with tokens
        self._step: list[RequestState] = []
        # Per step whose output is outstanding, its synchronous loads.
        self._in_flight: collections.deque[list[RequestState]] = collections.deque()

    def sync_wait_s(self, tokens_to_read: int, alone: bool = False) -> float | None:
        """How long the workers may wait before the forward pass for a load
        that reads ``tokens_to_read`` (what was read ahead costs a copy), if
        it is loaded in the step that schedules it; ``None``: it is loaded
        asynchronously. A request ``alone`` in the engine is loaded so at
        any price: it delays no other, and loaded asynchronously it would
        wait a step more."""
        load_s = self._costs.load_s(tokens_to_read // self._block_size)
        step_s = self._costs.last_step_s
        share = min(MAX_SYNC_LOAD_STEP_SHARE, 1 / (self._last_requests + 1))
        if load_s is None or (not alone and self._planned_s + load_s > share * step_s):
            return None
        self._planned_s += load_s
        return max(
            SYNC_WAIT_FACTOR * load_s + SYNC_WAIT_SLACK_S, SYNC_WAIT_STEPS * step_s
        )

    def send(self, delta: RequestDelta, state: RequestState) -> None:
        """The request's load goes to the workers with its delta, with the
        prices it is judged by; a synchronous one with its wait."""
        assert state.load is not None
        start, end = state.load
        delta.load, delta.sync_wait_s = state.load, state.sync_wait_s
        delta.compute_s_per_token = self._costs.stop_price(end - start)
        delta.load_s_per_block = self._costs.load_s(1)
        state.loading, state.load = state.load, None
        if state.timeline is not None:
            state.timeline.sent()
        if state.sync_wait_s is not None:
            self._step.append(state)
            if state.timeline is not None:  # loaded before its forward pass
                state.timeline.finished_loading()

    def step_scheduled(self, step: SchedulerOutput) -> None:
        """The step was scheduled (vLLM reports no output for a step
        without tokens, and a request loaded in its step is scheduled)."""
        self._planned_s = 0.0
        if step.total_num_scheduled_tokens > 0:
            self._last_requests = len(step.num_scheduled_tokens)
            if len(self._in_flight) == MAX_STEPS_IN_FLIGHT:
                self._done(self._in_flight.popleft())  # its output never came
            self._in_flight.append(self._step)
        self._step = []

    def step_finished(self) -> None:
        """The oldest step's output is in, its failed blocks applied: its
        loads are over."""
        if self._in_flight:
            self._done(self._in_flight.popleft())

    @staticmethod
    def _done(states: list[RequestState]) -> None:
        for state in states:
            state.loading = None
