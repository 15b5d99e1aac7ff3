# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler side of ``VineyardConnector`` (EngineCore process).

It asks the cache how many more prompt tokens are cached (by file metadata, on
background threads: the scheduler never waits on the filesystem), decides
whether to load them (:mod:`.load_costs`), and tells the workers, per step,
which cached blocks to load into which blocks and which blocks each running
request has now (:mod:`.load_orders`: a cheap load before its step's forward
pass, others while the request waits in vLLM's ``WAITING_FOR_REMOTE_KVS``).
Blocks are named by chained digests of their token ids and whatever else
determines their KV (:mod:`.request_keys`), computed here once and sent to the
workers as deltas.

The scheduler owns every decision: what each request loads, where its saves
start (moved back for every rank when a load came up short), and whether
hits are promised at all (not while a rank's reader cannot load). Workers
execute and report after each step (:class:`VineyardWorkerReport`, combined
over ranks by vLLM); the scheduler follows the minimum over ranks.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import vllm.envs as envs
from vllm.logger import init_logger

from vllm.worker.vineyard.config import VineyardLLMCacheConfig
from vllm.worker.vineyard.connector.events import StorageEvents
from vllm.worker.vineyard.connector.hit_timing import HitTimeline
from vllm.worker.vineyard.connector.load_costs import LoadCosts, RememberedCosts
from vllm.worker.vineyard.connector.load_orders import LoadOrders
from vllm.worker.vineyard.connector.lookups import (
    STEP_WAIT_S,
    BackgroundLookups,
    VineyardCacheLookup,
)
from vllm.worker.vineyard.connector.metadata import (
    RequestDelta,
    VineyardConnectorMetadata,
    VineyardHandshake,
    VineyardWorkerReport,
)
from vllm.worker.vineyard.connector.read_aheads import ReadAheads
from vllm.worker.vineyard.connector.removals import ResetRemovals
from vllm.worker.vineyard.connector.request_keys import request_keys, request_options
from vllm.worker.vineyard.connector.request_state import (
    NEVER,
    RequestState,
    freed_blocks,
    leading_freed_blocks,
    new_block_ids,
)
from vllm.worker.vineyard.connector.weight_identity import AdapterIdentities, Pending
from vllm.worker.vineyard.metrics import VineyardCacheMetrics

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorHandshakeMetadata,
    )
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

#: Finished requests kept for the KV events of their last writes, at most.
MAX_FINISHED_TRACKED = 4096


class VineyardConnectorScheduler:
    def __init__(
        self,
        config: VineyardLLMCacheConfig,
        block_size: int,
        chunk_size: int,
        tp_size: int,
        publish_events: bool = False,
        windowed: bool = False,
        cache_off: str | None = None,
        prefix_caching: bool = True,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.chunk_size = chunk_size
        self._tp_size = tp_size
        self._publish_events = publish_events
        self._events: StorageEvents | None = None
        self._lookup: BackgroundLookups | None = None
        self._requests: dict[str, RequestState] = {}
        # Requests with a hit in their first forward pass after the load.
        self._forwarding: list[RequestState] = []
        self._namespaces: list[str] = []  # every rank's, once handshaken
        # Finished requests whose writes may still be reported (KV events).
        self._finished: collections.OrderedDict[str, RequestState] = (
            collections.OrderedDict()
        )
        self._ranks_that_cannot_load: set[int] = set()
        self._resets = 0  # reset_cache calls (the workers follow)
        # A reset's new epoch keys blocks apart from all before it.
        self._epoch: str | None = None
        self._adapters: AdapterIdentities | None = None  # on the first LoRA
        self._removals: ResetRemovals | None = None  # once handshaken
        self._identity_wait_left = STEP_WAIT_S
        self._costs = LoadCosts(
            block_size, lambda: self.metrics, decide=config.load_policy == "auto"
        )
        self._remembered: RememberedCosts | None = None  # once handshaken
        self._loads = LoadOrders(self._costs, block_size)
        ahead = config.read_ahead_buffers > 0
        self._read_aheads = ReadAheads(block_size, tp_size, prefix_caching, ahead)
        self._idle_metrics = VineyardCacheMetrics(config.metrics_enabled)
        # Sliding windows: vLLM frees (and reuses) blocks out of the window.
        self._windowed = windowed
        self._cache_off = cache_off
        if cache_off:
            self._idle_metrics.add("unsupported_models")

    @property
    def metrics(self) -> VineyardCacheMetrics:
        return self._lookup.metrics if self._lookup else self._idle_metrics

    def set_handshakes(
        self, metadata: Mapping[int, KVConnectorHandshakeMetadata]
    ) -> None:
        """Open each TP rank's namespace for lookups (rank order)."""
        if self._cache_off:
            return  # said at startup
        if len(metadata) < self._tp_size:
            logger.error(
                "vineyard cache open on %d of %d workers: cache off",
                len(metadata),
                self._tp_size,
            )
            return
        handshakes = [h for _, h in sorted(metadata.items())]
        assert all(isinstance(h, VineyardHandshake) for h in handshakes)
        layouts = [h.layout for h in handshakes]  # type: ignore[attr-defined]
        self._namespaces = [layout.namespace for layout in layouts]
        self.chunk_size = layouts[0].chunk_size  # the workers' (maybe chosen)
        self._remembered = RememberedCosts(
            os.path.join(envs.VLLM_CACHE_ROOT, "vineyard_cache", "load_costs.json"),
            f"{os.path.realpath(self.config.root)}|{self._namespaces[0]}",
            self._costs,
        )
        lookup = VineyardCacheLookup(self.config, layouts, in_process=False)
        lookups = self._lookup = BackgroundLookups(lookup, self.config.lookup_timeout_s)
        self._costs.probe_with(lookup)
        self._removals = ResetRemovals(lookups, lambda: self.metrics)
        if self._publish_events:
            # Paths as the workers' backends name removed files: resolved.
            root = os.path.realpath(self.config.root)
            self._events = StorageEvents(
                self.block_size, [layout.files(root) for layout in layouts]
            )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """``(tokens to load, True)``, or ``(None, False)``: ask again."""
        state = self._state_of(request)
        state.load, state.sync_wait_s = None, None
        state.num_local_tokens = num_computed_tokens
        identified = state.keys is not None or state.save_from == NEVER
        if not (identified or self._identify(state)):
            return None, False  # its adapter is being identified
        if state.save_from == NEVER:
            return 0, False
        assert self._lookup is not None
        digests = state.digests_up_to(request.num_tokens, self.block_size)
        # Computing known to win: it waits for its lookup (where its saves
        # start) only a share of computing it.
        computing = state.computed_for_speed or (
            state.computed_for_speed is None and not self._costs.loads_may_win()
        )
        req_id, num_tokens = request.request_id, request.num_tokens
        found = self._lookup.lookup(req_id, digests, num_computed_tokens, num_tokens)
        if found is None and not computing:
            return None, False  # ask again next step
        if found is None and time.monotonic() - state.asked_at < (
            self._costs.lookup_wait_s(num_tokens - num_computed_tokens)
        ):
            return None, False  # computed, but its lookup is worth a wait
        if found is None:  # saves start from the first chunk, until it is in
            state.late_lookup, found = True, (0, 0)
        num_hit, save_from = found
        if state.digests_sent == 0:
            state.save_from = state.found = state.saved = save_from
            self._announce(state)  # found on the root
        num_hit = min(num_hit, max(0, state.max_hit - num_computed_tokens))
        if state.max_load_tokens is not None:  # whole blocks of its cap
            num_hit = min(
                num_hit, state.max_load_tokens // self.block_size * self.block_size
            )
        if self._ranks_that_cannot_load:
            num_hit = 0  # a reader is restarting or disabled: no promises
        # What every rank read ahead while it waited costs a copy to load.
        ready = min(num_hit, self._read_aheads.ready(req_id, num_computed_tokens))
        if num_hit > ready and state.computed_for_speed is None:
            if computing:
                self._costs.declined(num_hit)
            computed = computing or self._costs.promise(num_hit, digests) == 0
            state.computed_for_speed = computed
        if state.computed_for_speed:
            num_hit = ready
        if state.timeline is not None and not state.timeline.answered(num_hit):
            state.timeline = None
        if num_hit > 0:  # loaded before its step's forward pass, if cheap
            alone = len(self._requests) == 1
            state.sync_wait_s = self._loads.sync_wait_s(num_hit - ready, alone)
        return num_hit, num_hit > 0 and state.sync_wait_s is None

    def _state_of(self, request: Request) -> RequestState:
        """The request's state, made on first sight: what it asked of the
        cache (``kv_transfer_params``)."""
        state = self._requests.get(request.request_id)
        if state is not None:
            return state
        state = RequestState(request, time.monotonic())
        state.timeline = HitTimeline(request.arrival_time)
        self._requests[request.request_id] = state
        options = request_options(request)
        state.max_load_tokens = options.max_load_tokens
        if self._lookup is None or not options.use_cache:
            state.save_from = NEVER
            if self._lookup is not None:
                self.metrics.add("requests_opted_out")
        return state

    def on_new_request(self, request: Request) -> None:
        """A request arrived: its lookup starts now, in the background."""
        state = self._state_of(request)
        cached = state.save_from != NEVER and self._lookup is not None
        if not cached or (state.keys is None and not self._identify(state, False)):
            return
        if state.save_from == NEVER or self._lookup is None:
            return  # its adapter cannot be identified
        digests = state.digests_up_to(request.num_tokens, self.block_size)
        self._lookup.start(request.request_id, digests, request.num_tokens)
        self._read_aheads.arrived(state)

    def _identify(self, state: RequestState, wait: bool = True) -> bool:
        """Name the request's blocks: whether its keys are known now (or it
        is served uncached: its adapter is not identified in time)."""
        lora = state.request.lora_request
        if lora is not None:
            if self._adapters is None:
                self._adapters = AdapterIdentities()
            deadline = state.asked_at + self.config.lookup_timeout_s
            wait_s = self._identity_wait_left * wait
            answer = self._adapters.identity(lora, state.request, deadline, wait_s)
            if isinstance(answer, Pending):
                self._identity_wait_left = 0.0  # the others wait next step
                return False
            if answer is None:
                state.save_from = NEVER
                self.metrics.add("unidentified_weights")
                return True
            state.adapter = answer
        state.keys = request_keys(
            state.request, self.block_size, state.adapter, self._epoch
        )
        return True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external == 0:
            return
        start, end = state.num_local_tokens, state.num_local_tokens + num_external
        state.load_blocks = list(blocks.get_block_ids()[0])
        if self._windowed:
            # Blocks out of the window are vLLM's null block: not loaded.
            state.held_from = leading_freed_blocks(state.load_blocks)
        state.load = (min(max(start, state.held_from * self.block_size), end), end)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Learn from the workers: loads, saves, readers, read-aheads."""
        self._forward_passes_ended()
        self._costs.step_finished()
        if output.invalid_block_ids:
            for state in self._requests.values():
                state.load_failed(
                    output.invalid_block_ids, self.block_size, self.chunk_size
                )
        self._loads.step_finished()
        for req_id in output.finished_recving or ():
            finished = self._requests.get(req_id)
            if finished is not None:
                finished.loading = None
                if finished.timeline is not None:
                    finished.timeline.finished_loading()
        report = output.kv_connector_worker_meta
        if isinstance(report, VineyardWorkerReport):
            self._apply_report(report)

    def _apply_report(self, report: VineyardWorkerReport) -> None:
        # Writes staged before a reset stored blocks under the old epoch.
        stored = report.stored if report.resets == self._resets else {}
        for rank, runs in stored.items():
            for req_id, begin, end in runs:
                state = self._requests.get(req_id) or self._finished.get(req_id)
                if state is not None:
                    state.record_stored(rank, begin, end, self._tp_size)
                    self._announce(state)
        if report.removed and self._events is not None:
            self._events.removed(report.removed)
        if report.unreadable and self._lookup is not None:
            self._lookup.avoid(report.unreadable)
        for blocks, seconds in report.load_times:
            self._costs.observe_load(blocks, seconds)
        if report.resets == self._resets:  # else of the old names
            self._read_aheads.report(report.read_ahead)
        for rank, can_load in report.can_load.items():
            if can_load:
                self._ranks_that_cannot_load.discard(rank)
            else:
                self._ranks_that_cannot_load.add(rank)
                logger.warning(
                    "vineyard cache reader of TP rank %d cannot load: no hits "
                    "are promised until it is back",
                    rank,
                )

    def _announce(self, state: RequestState) -> None:
        """A KV event for the request's blocks newly known to be saved."""
        end = state.saved // self.block_size
        if self._events is None or end <= state.announced:
            return
        digests = state.digests_up_to(end * self.block_size, self.block_size)
        self._events.stored(state.request, digests, state.announced, end)
        state.announced = end

    def take_events(self) -> list[KVCacheEvent]:
        return self._events.take() if self._events is not None else []

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> VineyardConnectorMetadata:
        self._forward_passes_ended()
        meta = VineyardConnectorMetadata(resets=self._resets)
        if self._lookup is None:
            return meta  # the cache is off: nothing to load or save
        self._identity_wait_left = STEP_WAIT_S
        self._costs.step_scheduled(scheduler_output.total_num_scheduled_tokens)
        self._lookup.begin_step(self._costs.lookups_wait_s())
        if self._removals is not None:
            self._removals.log_finished()
        if self._remembered is not None:
            self._remembered.maybe_save()
        meta.requests.extend(self._scheduled_deltas(scheduler_output))
        meta.requests.extend(self._load_deltas())
        self._loads.step_scheduled(scheduler_output)
        for delta in meta.requests:
            self._read_aheads.computed(delta.new_digests)
        meta.read_aheads = self._read_aheads.orders(
            self._lookup, self.chunk_size, self._costs, scheduler_output
        )
        return meta

    def _scheduled_deltas(
        self, scheduler_output: SchedulerOutput
    ) -> list[RequestDelta]:
        """What the workers need of each scheduled request: its new blocks
        and the digests of its chunks completed in this step."""
        new_blocks, lookups = new_block_ids(scheduler_output), self._lookup
        assert lookups is not None
        deltas = []
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None:
                continue
            if state.save_from == NEVER:
                continue  # not cacheable: the worker needs nothing
            late = state.late_lookup
            found = lookups.take(req_id, state.num_local_tokens) if late else None
            if found is not None:  # its lookup, in after it was computed
                self._costs.declined(found[0])  # counted now, computed
                state.found_late(found[1])
                self._announce(state)
            num_computed = state.request.num_computed_tokens + num_scheduled
            blocks, replace = new_blocks.get(req_id, ([], False))
            replace = replace or state.blocks_replaced
            if self._windowed:
                state.held_from = freed_blocks(
                    scheduler_output, req_id, 0 if replace else state.held_from
                )
            chunk = self.chunk_size  # a load reads every chunk it touches
            needed = num_computed // chunk * chunk
            if state.load is not None:
                needed = max(needed, -(-state.load[1] // chunk) * chunk)
            digests_from, new_digests = state.take_digests(needed, self.block_size)
            delta = RequestDelta(
                req_id=req_id,
                new_digests=new_digests,
                digests_from=digests_from,
                block_ids=blocks,
                replace_blocks=replace,
                num_computed_tokens=num_computed,
                save_from=state.saves_from,
                held_from=state.held_from,
            )
            if state.load is not None:  # loaded before this forward pass
                self._loads.send(delta, state)
                self.metrics.add("loads_before_forward")
            if state.timeline is not None and state.timeline.forward_scheduled():
                self._forwarding.append(state)
            deltas.append(delta)
            state.blocks_replaced = False
        return deltas

    def _load_deltas(self) -> list[RequestDelta]:
        """Requests allocated this step and waiting for their KV: the
        workers load every chunk a load reads (the last one included)."""
        chunk, deltas = self.chunk_size, []
        for req_id, state in self._requests.items():
            if state.load is None:
                continue
            start, end = state.load
            digests_from, new_digests = state.take_digests(
                -(-end // chunk) * chunk, self.block_size
            )
            delta = RequestDelta(
                req_id=req_id,
                new_digests=new_digests,
                digests_from=digests_from,
                block_ids=state.load_blocks,
                replace_blocks=True,
                num_computed_tokens=start,
                save_from=state.save_from,
                held_from=state.held_from,
            )
            self._loads.send(delta, state)
            deltas.append(delta)
        return deltas

    def _forward_passes_ended(self) -> None:
        """The step that ran the forward passes scheduled after loads ended
        (vLLM calls one of the hooks that call this after each step): time
        their hits."""
        for state in self._forwarding:
            assert state.timeline is not None
            state.timeline.observe(self.metrics)
            state.timeline = None
        self._forwarding.clear()

    def reset_cache(self) -> bool:
        """Reset the cache: a new epoch names every block from now on (the
        fence, at once: nothing written before is looked up again; running
        requests save again), and the ranks' namespaces are emptied in the
        background (:mod:`.removals`). Always succeeds: the fence holds."""
        if self._lookup is None:
            return True  # the cache is off: nothing of ours is there
        self._epoch = os.urandom(8).hex()
        self._resets += 1
        self._read_aheads.clear()
        self._finished.clear()
        if self._events is not None:
            self._events.removed_all()
        for req_id, state in self._requests.items():
            self._lookup.forget(req_id)  # a lookup of the old names
            if state.keys is not None and state.save_from != NEVER:
                state.rekey(
                    request_keys(
                        state.request, self.block_size, state.adapter, self._epoch
                    )
                )
        assert self._removals is not None
        self._removals.start(self.config.root, self._namespaces)
        return True

    def request_finished(self, request: Request) -> None:
        self._forward_passes_ended()
        state = self._requests.pop(request.request_id, None)
        if state is not None and state.save_from != NEVER and self._events is not None:
            # Its last writes are reported after it finished: announce them.
            self._finished[request.request_id] = state
            while len(self._finished) > MAX_FINISHED_TRACKED:
                self._finished.popitem(last=False)
        self._read_aheads.forget(request.request_id)
        if self._lookup is not None:
            self._lookup.forget(request.request_id)
        if self._adapters is not None and request.lora_request is not None:
            self._adapters.forget(request.lora_request, request.request_id)

    def shutdown(self) -> None:
        if self._remembered is not None:
            self._remembered.save()
        if self._lookup is not None:
            self._lookup.close()
        if self._adapters is not None:
            self._adapters.close()
