# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler's read-ahead: a request with a hit that waits in vLLM's
queue behind others has its hit read by the workers meanwhile (into read
buffers of their own, :meth:`~vllm.worker.vineyard.transfer.loads.
LoadPipeline.read_ahead`), so that its load, once it is scheduled, finishes
in the step that starts it. What every rank has read ahead is promised
whatever the link costs: loading it costs a copy."""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import TYPE_CHECKING

from vllm.v1.request import RequestStatus

from vllm.worker.vineyard.connector.metadata import ReadAheadOrder
from vllm.worker.vineyard.connector.request_state import RequestState

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

    from vllm.worker.vineyard.connector.load_costs import LoadCosts
    from vllm.worker.vineyard.connector.lookups import BackgroundLookups

#: Block digests this instance computed or loaded lately, at most: where a
#: queued request's blocks are among them, vLLM most likely holds them and
#: they are not read ahead.
MAX_LOCAL_DIGESTS = 1 << 16


class ReadAheads:
    def __init__(
        self, block_size: int, tp_size: int, prefix_caching: bool, enabled: bool
    ):
        self._enabled = enabled  # the workers have read-ahead buffers
        self._block_size = block_size
        self._tp_size = tp_size
        self._prefix_caching = prefix_caching  # vLLM's own: what it holds
        # Requests whose lookup runs while they wait, in arrival order.
        self._queued: dict[str, RequestState] = {}
        # Per request and rank: tokens (first, end) read ahead whole.
        self._ready: dict[str, dict[int, tuple[int, int]]] = {}
        self._local: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def arrived(self, state: RequestState) -> None:
        """A request arrived and its lookup started."""
        if self._enabled:
            self._queued[state.request.request_id] = state

    def computed(self, digests: Iterable[bytes]) -> None:
        """The engine computed or loaded these blocks (vLLM caches them)."""
        if not self._prefix_caching:
            return
        for digest in digests:
            self._local[digest] = None
            self._local.move_to_end(digest)
        while len(self._local) > MAX_LOCAL_DIGESTS:
            self._local.popitem(last=False)

    def orders(
        self,
        lookups: BackgroundLookups,
        chunk: int,
        costs: LoadCosts,
        step: SchedulerOutput,
    ) -> list[ReadAheadOrder]:
        """Read-aheads for the requests still queued whose lookups found
        more than vLLM likely holds, from the first chunk vLLM does not
        hold (as far as this instance knows) to the end of the hit, where
        loading it is expected to take more than half a step like this one
        (else its load ends in the step that starts it anyway, and reading
        ahead would only take the readers and the link from others)."""
        orders, bs = [], self._block_size
        for req_id, state in list(self._queued.items()):
            request = state.request
            if request.status != RequestStatus.WAITING or state.digests_sent:
                del self._queued[req_id]  # scheduled (or gone)
                continue
            found = lookups.peek(req_id)
            if found is None:
                continue  # its lookup runs
            hit_end = found[0]
            del self._queued[req_id]
            digests = state.digests_up_to(hit_end, bs)
            bpc, local = chunk // bs, state.num_local_tokens // chunk
            while (local + 1) * bpc <= len(digests) and (
                digests[(local + 1) * bpc - 1] in self._local
            ):
                local += 1
            start = local * chunk
            tokens = step.total_num_scheduled_tokens
            if hit_end - start >= chunk and costs.worth_reading_ahead(
                hit_end - start, tokens
            ):
                read_end = -(-hit_end // chunk) * bpc
                orders.append(
                    ReadAheadOrder(req_id, digests[:read_end], start, hit_end)
                )
        return orders

    def report(self, read_ahead: dict[int, dict[str, tuple[int, int]]]) -> None:
        """The ranks' read-aheads that moved on, or were dropped."""
        for rank, ready in read_ahead.items():
            for req_id, span in ready.items():
                self._ready.setdefault(req_id, {})[rank] = span

    def ready(self, req_id: str, num_computed_tokens: int) -> int:
        """Tokens from ``num_computed_tokens`` on that every rank has read
        ahead (whole blocks)."""
        ranks = self._ready.get(req_id, {})
        if len(ranks) < self._tp_size:
            return 0
        if any(first > num_computed_tokens for first, _ in ranks.values()):
            return 0
        end = min(end for _, end in ranks.values())
        return max(0, end - num_computed_tokens) // self._block_size * self._block_size

    def forget(self, req_id: str) -> None:
        self._queued.pop(req_id, None)
        self._ready.pop(req_id, None)

    def clear(self) -> None:
        """A reset: what was read ahead has the old names."""
        self._ready.clear()
        self._local.clear()
