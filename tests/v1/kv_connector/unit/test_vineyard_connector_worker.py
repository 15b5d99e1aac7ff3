# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The worker side of ``VineyardConnector`` without an engine.

Metadata built by the real scheduler side (from real ``SchedulerOutput``
objects) is run through :class:`VineyardConnectorWorker` whose cache is a
real :class:`VineyardLLMCache` on small CPU KV tensors with real vineyard
backends: loads fill exactly the promised blocks, a short or bad load
reports exactly the blocks vLLM must recompute, a preempted request whose
chunks are still being written loses nothing, one TP rank's failed write
is retried, ``close()`` during a load does not hang, and the connector's
stats aggregate across ranks as documented.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.v1.kv_connector.unit.vineyard_connector_testing import (
    BLOCK_SIZE,
    BLOCKS_PER_CHUNK,
    CHUNK_SIZE,
    Step,
    WorkerHarness,
    admit,
    allocate,
    fresh_tokens,
    make_config,
    make_layout,
    make_request,
    make_scheduler,
    make_worker,
    only,
    report_to,
    run_step,
    tp_workers,
)
from tests.vineyard_testing import wait_until
from vllm.worker.vineyard.config import VineyardLLMCacheConfig
from vllm.worker.vineyard.connector.lookups import VineyardCacheLookup
from vllm.worker.vineyard.storage.digests import extend_digests, synthetic_ids

pytestmark = pytest.mark.timeout(180)


def chunk_path(w: WorkerHarness, tokens: list[int], chunk: int) -> str:
    ids = synthetic_ids(extend_digests([], tokens, BLOCK_SIZE))
    return w.cache.files.path(ids[: (chunk + 1) * BLOCKS_PER_CHUNK])


def save_prompt(
    config: VineyardLLMCacheConfig,
    w: WorkerHarness,
    tokens: list[int],
    blocks: list[int],
) -> None:
    """Prefill ``tokens`` into ``blocks`` in one step and wait until its
    whole chunks are written."""
    sched = make_scheduler(config, [w.layout])
    req = make_request(f"save-{tokens[0]}-{blocks[0]}", tokens)
    admit(sched, req)
    run_step(sched, Step(new=[(req, blocks, len(tokens))]), [w])
    w.worker.get_finished({req.request_id})
    w.wait_for_writes()


def test_metadata_load_fills_blocks(
    config: VineyardLLMCacheConfig, worker: WorkerHarness
) -> None:
    """A second request for a saved prompt, in other blocks: the load the
    metadata carries fills exactly the blocks of the cached chunks with the
    saved KV, and leaves the block being computed alone."""
    prompt = fresh_tokens(4 * CHUNK_SIZE + 5)
    save_prompt(config, worker, prompt, list(range(0, 9)))
    expected = worker.kv[:, 0:8].clone()

    sched = make_scheduler(config, [worker.layout])
    req = make_request("load", prompt)
    assert admit(sched, req) == 4 * CHUNK_SIZE
    blocks = list(range(20, 29))
    untouched = worker.block(28)
    before = worker.cache.metrics.snapshot()
    run_step(sched, Step(new=[(req, blocks, 5)]), [worker])
    assert torch.equal(worker.kv[:, 20:28], expected)
    assert torch.equal(worker.block(28), untouched)
    assert worker.worker.take_load_errors() == set()
    after = worker.cache.metrics.snapshot()
    assert after["loaded_tokens"] - before["loaded_tokens"] == 4 * CHUNK_SIZE
    assert after["load_errors"] == before["load_errors"]


def _flip_payload_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-200, os.SEEK_END)  # inside the last entry's KV
        byte = f.read(1)
        f.seek(-200, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x40]))


def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) - 100)


DAMAGE = {"missing": os.unlink, "corrupt": _flip_payload_byte, "truncated": _truncate}


@pytest.mark.parametrize("damage", DAMAGE)
def test_short_load_reports_exactly_the_unloaded_blocks(
    damage: str, config: VineyardLLMCacheConfig, worker: WorkerHarness
) -> None:
    """The lookup promised four chunks; chunk 2 is then evicted, bit-rotted
    or truncated before the load. Chunks 0-1 are loaded, and
    ``take_load_errors`` (vLLM's ``get_block_ids_with_load_errors``) is
    exactly the blocks of chunks 2-3, once; a bad chunk is counted and
    removed, so the next lookup stops before it."""
    prompt = fresh_tokens(4 * CHUNK_SIZE + 3)
    save_prompt(config, worker, prompt, list(range(30, 39)))
    expected = worker.kv[:, 30:34].clone()
    sched = make_scheduler(config, [worker.layout])
    req = make_request(f"short-{damage}", prompt)
    assert admit(sched, req) == 4 * CHUNK_SIZE
    path = chunk_path(worker, prompt, 2)
    DAMAGE[damage](path)
    before = worker.cache.metrics.snapshot()
    blocks = list(range(40, 49))
    step = Step(new=[(req, blocks, 3)])
    run_step(sched, step, [worker])

    assert step.load_errors == set(blocks[4:8])
    assert worker.worker.take_load_errors() == set()  # reported once
    assert req.num_computed_tokens == 2 * CHUNK_SIZE + 3  # from the failed block
    assert torch.equal(worker.kv[:, 40:44], expected)
    after = worker.cache.metrics.snapshot()
    assert after["loaded_tokens"] - before["loaded_tokens"] == 2 * CHUNK_SIZE
    assert after["load_errors"] - before["load_errors"] == 1
    bad = after["corrupt_chunks"] - before["corrupt_chunks"]
    assert bad == (0 if damage == "missing" else 1)
    assert not os.path.exists(path)
    assert admit(make_scheduler(config, [worker.layout]), req) == 2 * CHUNK_SIZE


def test_a_stalled_load_is_recomputed_and_saved(tmp_path: Path) -> None:
    """A transient read failure (the reader stalls past its timeout) while
    every chunk is on disk: the load comes up short and is reported before
    the request runs, so no forward pass ever attends to blocks the load
    did not fill; vLLM computes from the failed block, and the worker saves
    what it computes (vineyard keeps the chunks it already has)."""
    config = make_config(tmp_path, backend_timeout_s=2.0)
    w = make_worker(config, make_layout())
    try:
        prompt = fresh_tokens(6 * CHUNK_SIZE + 3)
        save_prompt(config, w, prompt[: 4 * CHUNK_SIZE + 1], list(range(0, 5)))
        sched = make_scheduler(config, [w.layout])
        req = make_request("short-then-recomputed", prompt)
        assert admit(sched, req) == 4 * CHUNK_SIZE
        tail = chunk_path(w, prompt, 4)
        written = w.cache.metrics.snapshot()["tokens_written"]

        os.kill(w.pid("read"), signal.SIGSTOP)
        blocks = list(range(10, 10 + 6 * BLOCKS_PER_CHUNK + 1))
        step = Step(new=[(req, blocks, 6 * CHUNK_SIZE + 3)])
        run_step(sched, step, [w])
        assert step.load_errors == set(blocks[: 4 * BLOCKS_PER_CHUNK])
        assert w.cache.metrics.snapshot()["load_errors"] == 1
        w.wait_for_writes()
        # A buffer holds one step's worth of chunks: the rest goes next step.
        run_step(sched, Step(running=[(req, [], 1)]), [w])
        w.wait_for_writes()
        assert os.path.exists(tail)
        assert w.cache.metrics.snapshot()["tokens_written"] > written
        # The failed promise is not made again to this request (once its
        # lookup, in the background, has answered: on a busy machine it may
        # not within this step's wait).
        answers: list[tuple[int | None, bool]] = []

        def answered() -> bool:
            answers.append(sched.get_num_new_matched_tokens(req, 0))
            return answers[-1][0] is not None

        assert wait_until(answered)
        assert answers[-1] == (0, False)
    finally:
        w.close()


def test_preempted_while_saving_loses_nothing(
    config: VineyardLLMCacheConfig, worker: WorkerHarness
) -> None:
    """A request's chunks are staged and submitted, but the writer is
    stopped (the write is in flight) when the request is preempted; its old
    blocks are reused by another request (overwritten) and it resumes in
    new blocks. The staged bytes are what gets written: a later load
    returns the original KV. After the resume the worker saves from the new
    blocks, and every chunk is written once."""
    prompt = fresh_tokens(3 * CHUNK_SIZE + 10)
    sched = make_scheduler(config, [worker.layout])
    req = make_request("preempt", prompt)
    admit(sched, req)
    old_blocks = list(range(50, 57))
    original = worker.kv[:, 50:56].clone()
    writer = worker.pid("write")
    before = worker.cache.metrics.snapshot()
    os.kill(writer, signal.SIGSTOP)
    try:
        run_step(sched, Step(new=[(req, old_blocks, 2 * CHUNK_SIZE)]), [worker])
        assert worker.cache.pool.num_in_flight == 1  # being saved
        # Preempted; another request overwrites the freed blocks.
        worker.kv[:, 50:57] = -1.0
        req.num_computed_tokens = 0
        # Nothing is on disk yet: the resumed request recomputes.
        assert admit(sched, req) == 0
        new_blocks = list(range(60, 67))
        worker.kv[:, 60:66] = original  # what recomputing gives
        meta = run_step(
            sched, Step(resumed=[(req, new_blocks, req.num_tokens)]), [worker]
        )
        assert only(meta).replace_blocks
    finally:
        os.kill(writer, signal.SIGCONT)
    worker.wait_for_writes()
    after = worker.cache.metrics.snapshot()
    assert after["tokens_written"] - before["tokens_written"] == 3 * CHUNK_SIZE
    assert after["updates_failed"] == before["updates_failed"]
    # A fresh request loads what was saved, from both sides of the
    # preemption, into other blocks.
    worker.worker.get_finished({req.request_id})
    other = make_request("after-preempt", prompt)
    sched2 = make_scheduler(config, [worker.layout])
    assert admit(sched2, other) == 3 * CHUNK_SIZE
    run_step(sched2, Step(new=[(other, list(range(70, 77)), 10)]), [worker])
    assert torch.equal(worker.kv[:, 70:76], original)


@pytest.fixture
def rank_workers(
    tmp_path: Path,
) -> Iterator[tuple[VineyardLLMCacheConfig, list[WorkerHarness]]]:
    config = make_config(tmp_path / "root")
    with tp_workers(config) as workers:
        yield config, workers


def test_one_rank_write_failure_is_retried(
    rank_workers: tuple[VineyardLLMCacheConfig, list[WorkerHarness]],
) -> None:
    """Rank 1's namespace directory is a regular file while both ranks save
    a prompt: rank 0's chunks are written, rank 1's write fails (counted),
    so no chunk is usable (the lookup is the minimum across ranks). Once
    the directory is back, rank 1's next save rewinds to the failed chunks
    and writes them, and the prompt is cached on both ranks."""
    config, workers = rank_workers
    layouts = [w.layout for w in workers]
    rank1_root = workers[1].cache.files.namespace_dir
    os.rename(rank1_root, rank1_root + ".away")
    with open(rank1_root, "w") as f:
        f.write("not a directory")
    prompt = fresh_tokens(3 * CHUNK_SIZE + 1)
    sched = make_scheduler(config, layouts)
    req = make_request("tp-fail", prompt)
    assert admit(sched, req) == 0
    run_step(sched, Step(new=[(req, list(range(7)), req.num_tokens)]), workers)
    for w in workers:
        w.wait_for_writes()
    totals = [w.cache.metrics.snapshot() for w in workers]
    assert totals[0]["tokens_written"] == 3 * CHUNK_SIZE
    assert totals[0]["updates_failed"] == 0
    assert totals[1]["tokens_written"] == 0
    assert totals[1]["updates_failed"] == 1
    lookup = VineyardCacheLookup(config, layouts)
    digests = extend_digests([], prompt, BLOCK_SIZE)
    assert lookup.lookup(digests, 0, len(prompt)) == (0, 0)
    # The ranks' reports reach the scheduler: it follows the minimum.
    report_to(sched, workers)
    state = sched._requests[req.request_id]
    assert state.rank_saved == {0: 3 * CHUNK_SIZE}  # rank 1 stored nothing
    assert state.saved == 0

    os.unlink(rank1_root)
    os.rename(rank1_root + ".away", rank1_root)
    run_step(sched, Step(running=[(req, [], 1)]), workers)
    for w in workers:
        w.wait_for_writes()
    assert workers[1].cache.metrics.snapshot()["tokens_written"] == 3 * CHUNK_SIZE
    assert workers[0].cache.metrics.snapshot()["tokens_written"] == 3 * CHUNK_SIZE
    expect = 3 * CHUNK_SIZE
    assert lookup.lookup(digests, 0, len(prompt)) == (expect, expect)
    report_to(sched, workers)
    assert state.saved == 3 * CHUNK_SIZE


def test_short_load_on_one_rank_saves_again_on_every_rank(
    rank_workers: tuple[VineyardLLMCacheConfig, list[WorkerHarness]],
) -> None:
    """TP=2, rank 0's chunk 1 is bit-rotted between the lookup and the load:
    rank 0's load comes up short, rank 1's does not. vLLM recomputes from
    the bad block on both ranks; the scheduler moves the request's saves
    back to that chunk on every rank (rank 0 writes it again, rank 1's
    rewrite is a no-op), and a later request loads the whole prefix on
    both ranks, with rank 0's original bytes."""
    config, workers = rank_workers
    layouts = [w.layout for w in workers]
    prompt = fresh_tokens(3 * CHUNK_SIZE + 1)
    sched = make_scheduler(config, layouts)
    first = make_request("tp-first", prompt)
    admit(sched, first)
    blocks = list(range(7))
    original = [w.kv[:, 0:6].clone() for w in workers]
    run_step(sched, Step(new=[(first, blocks, first.num_tokens)]), workers)
    for w in workers:
        w.wait_for_writes()
        w.worker.get_finished({first.request_id})

    second = make_request("tp-second", prompt)
    assert admit(sched, second) == 3 * CHUNK_SIZE
    _flip_payload_byte(chunk_path(workers[0], prompt, 1))
    step = Step(new=[(second, list(range(20, 27)), 1)])
    run_step(sched, step, workers)
    assert step.load_errors == set(range(20 + BLOCKS_PER_CHUNK, 26))
    assert second.num_computed_tokens == CHUNK_SIZE + 1
    state = sched._requests[second.request_id]
    assert state.save_from == CHUNK_SIZE
    # vLLM recomputes chunks 1-2 (the same KV as before) and saves them.
    for w, kv in zip(workers, original, strict=True):
        w.kv[:, 20:26] = kv
    second.num_computed_tokens = CHUNK_SIZE
    run_step(sched, Step(running=[(second, [], 2 * CHUNK_SIZE + 1)]), workers)
    for w in workers:
        w.wait_for_writes()
    report_to(sched, workers)
    assert state.rank_saved == {0: 3 * CHUNK_SIZE, 1: 3 * CHUNK_SIZE}

    third = make_request("tp-third", prompt)
    assert admit(make_scheduler(config, layouts), third) == 3 * CHUNK_SIZE
    sched3 = make_scheduler(config, layouts)
    admit(sched3, third)
    step3 = Step(new=[(third, list(range(40, 47)), 1)])
    run_step(sched3, step3, workers)
    assert step3.load_errors == set()
    for w, kv in zip(workers, original, strict=True):
        assert torch.equal(w.kv[:, 40:46], kv)


def test_no_hits_are_promised_while_a_rank_cannot_load(
    rank_workers: tuple[VineyardLLMCacheConfig, list[WorkerHarness]],
) -> None:
    """Rank 1's readers are disabled: its report makes the scheduler
    promise no hits (the lookup still finds the prefix); once it can load
    again, hits are promised again."""
    config, workers = rank_workers
    layouts = [w.layout for w in workers]
    prompt = fresh_tokens(2 * CHUNK_SIZE + 1)
    sched = make_scheduler(config, layouts)
    first = make_request("down-first", prompt)
    admit(sched, first)
    run_step(sched, Step(new=[(first, list(range(5)), first.num_tokens)]), workers)
    for w in workers:
        w.wait_for_writes()
    readers = workers[1].cache._readers
    for reader in readers:
        reader._disabled = ("disabled by the test", time.monotonic())
    report_to(sched, workers)
    assert admit(sched, make_request("down-second", prompt)) == 0
    for reader in readers:
        reader._disabled = None
    report_to(sched, workers)
    assert admit(sched, make_request("down-third", prompt)) == 2 * CHUNK_SIZE


def test_abort_during_a_load_stops_its_writes(
    config: VineyardLLMCacheConfig, worker: WorkerHarness
) -> None:
    """A request aborted while its load is in flight (the reader stopped)
    is reported finished at once, so vLLM can free its blocks, and when the
    reader answers later nothing is written into them; the loads after it
    go on."""
    prompt = fresh_tokens(2 * CHUNK_SIZE + 1)
    save_prompt(config, worker, prompt, [0, 1, 2, 3, 4])
    sched = make_scheduler(config, [worker.layout])
    req = make_request("aborted", prompt)
    assert admit(sched, req) == 2 * CHUNK_SIZE
    meta = allocate(sched, req, [20, 21, 22, 23, 24])
    untouched = worker.kv[:, 20:25].clone()
    reader = worker.pid("read")
    os.kill(reader, signal.SIGSTOP)
    try:
        worker.worker.start_load_kv(meta)
        assert worker.worker.get_finished(set()) == set()  # loading
        assert worker.worker.get_finished({req.request_id}) == {req.request_id}
    finally:
        os.kill(reader, signal.SIGCONT)
    # The next request's load is read after the aborted one's answer.
    other = make_request("after-abort", prompt)
    assert admit(sched, other) == 2 * CHUNK_SIZE
    step = Step(new=[(other, [30, 31, 32, 33, 34], 1)])
    run_step(sched, step, [worker])
    assert step.load_errors == set()
    assert torch.equal(worker.kv[:, 30:34], worker.kv[:, 0:4])
    assert torch.equal(worker.kv[:, 20:25], untouched)
    assert worker.worker.take_load_errors() == set()


def test_close_during_a_load(tmp_path: Path) -> None:
    """``close()`` while a load waits on a stalled reader (stopped with
    SIGSTOP, timeout far away): it returns at once, and the load is then
    reported finished with nothing loaded (its blocks count as load errors)
    instead of after the backend timeout."""
    config = make_config(tmp_path / "root", backend_timeout_s=300.0)
    w = make_worker(config, make_layout())
    try:
        prompt = fresh_tokens(2 * CHUNK_SIZE + 1)
        save_prompt(config, w, prompt, [0, 1, 2, 3, 4])
        sched = make_scheduler(config, [w.layout])
        req = make_request("closing", prompt)
        assert admit(sched, req) == 2 * CHUNK_SIZE
        meta = allocate(sched, req, [10, 11, 12, 13, 14])
        untouched = w.kv[:, 10:14].clone()
        os.kill(w.pid("read"), signal.SIGSTOP)
        w.worker.start_load_kv(meta)  # returns at once
        assert w.cache._readers[0] is not None
        assert w.cache._readers[0]._in_flight == "query"
        assert w.worker.get_finished(set()) == set()  # still loading
        closer = threading.Thread(target=w.worker.shutdown)
        closer.start()
        # Bounds for "does not hang" only: the reader would answer in 300 s.
        closer.join(60)
        assert not closer.is_alive()
        assert w.worker.get_finished(set()) == {req.request_id}
        assert w.worker.take_load_errors() == {10, 11, 12, 13}
        assert torch.equal(w.kv[:, 10:14], untouched)
        assert w.cache.metrics.snapshot()["load_errors"] == 1
    finally:
        w.close()


@pytest.fixture
def one_reader(tmp_path: Path) -> Iterator[tuple[WorkerHarness, list[int]]]:
    """A worker with one reader and a saved prompt of four whole chunks
    (one chunk per segment: four reads), in blocks 0-8."""
    config = make_config(tmp_path, readers=1)
    w = make_worker(config, make_layout())
    try:
        prompt = fresh_tokens(4 * CHUNK_SIZE + 5)
        save_prompt(config, w, prompt, list(range(0, 9)))
        assert w.cache.loads._segment_blocks == BLOCKS_PER_CHUNK
        yield w, prompt
    finally:
        w.close()


def test_a_load_moves_on_between_layers(
    one_reader: tuple[WorkerHarness, list[int]],
) -> None:
    """A load of four reads: a read goes out only when the forward thread
    polls, so a pass whose layers do not ask has its load wait after the
    first read, however long the pass; asked before each layer's attention
    (vLLM's ``wait_for_layer_load``), the reads go out one after another and
    the load is done by the pass's end, its blocks exact."""
    w, prompt = one_reader
    expected = w.kv[:, 0:8].clone()
    sched = make_scheduler(w.cache.config, [w.layout])
    req = make_request("between-layers", prompt)
    assert admit(sched, req) == 4 * CHUNK_SIZE
    loads = w.cache.loads
    # The reader answers only after the step's start: a poll takes every
    # answer that is in, and a reader this fast could answer them all.
    os.kill(w.pid("read"), signal.SIGSTOP)
    try:
        w.worker.start_load_kv(allocate(sched, req, list(range(20, 29))))
    finally:
        os.kill(w.pid("read"), signal.SIGCONT)
    assert wait_until(lambda: all(r.reader.ready() for r in loads._in_flight))
    time.sleep(0.2)
    assert loads._jobs[req.request_id].next_segment == 1  # no read sent since

    deadline = time.monotonic() + 30
    while loads.loading(req.request_id):  # the layers of a pass
        assert time.monotonic() < deadline, "the load never finished"
        w.worker.between_layers()
        time.sleep(0.001)
    assert w.worker.get_finished(set()) == {req.request_id}
    assert torch.equal(w.kv[:, 20:28], expected)
    assert w.worker.take_load_errors() == set()


def test_loads_are_judged_slow_only_when_a_step_starts_or_ends(
    one_reader: tuple[WorkerHarness, list[int]],
) -> None:
    """A load priced so that any read makes it slower than computing: polled
    between layers only, it is never judged and loads whole (a load's first
    answers are mostly a file's latency); polled as a step starts or ends
    with its first answer in, it stops as slow (the rest is computed)."""
    w, prompt = one_reader
    digests = extend_digests([], prompt, BLOCK_SIZE)
    loads, end = w.cache.loads, 4 * CHUNK_SIZE
    stopped = w.cache.metrics.snapshot()["loads_stopped_slow"]
    loads.start("mid-pass", digests, 0, end, range(20, 29), 1e-12)
    deadline = time.monotonic() + 30
    while loads.loading("mid-pass"):
        assert time.monotonic() < deadline, "the load never finished"
        w.worker.between_layers()
        time.sleep(0.001)
    assert loads.take_finished() == [("mid-pass", end, end)]
    assert w.cache.metrics.snapshot()["loads_stopped_slow"] == stopped

    # The reader answers one read between polls (a poll takes every answer
    # that is in: a reader this fast could answer them all in one).
    reader = w.pid("read")
    os.kill(reader, signal.SIGSTOP)
    try:
        loads.start("step", digests, 0, end, range(40, 49), 1e-12)
        loads.poll()  # the first read goes out
        os.kill(reader, signal.SIGCONT)
        assert wait_until(lambda: all(r.reader.ready() for r in loads._in_flight))
        os.kill(reader, signal.SIGSTOP)
        loads.poll()  # its answer is in, the next read out: judged
    finally:
        os.kill(reader, signal.SIGCONT)
    ((name, loaded, promised),) = loads.take_finished()
    assert (name, promised) == ("step", end) and loaded < end
    assert w.cache.metrics.snapshot()["loads_stopped_slow"] == stopped + 1
