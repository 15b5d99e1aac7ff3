# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Backend trouble: serving goes on with correct outputs, the trouble shows
in logs and metrics, and nothing hangs (every engine runs under a timeout,
and the runner waits for every submitted update to be accounted for)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.vineyard_engine_testing import (
    BLOCK_SIZE,
    EngineRun,
    ReferenceRunner,
    cacheable_prefix,
    engine_env,
    flip_a_payload_byte,
    run_engine,
    standard_prompts,
)
from vllm.worker.vineyard.storage.chunks import ChunkFiles
from vllm.worker.vineyard.storage.digests import extend_digests, synthetic_ids
from vllm.worker.vineyard.storage.namespaces import MANIFEST
from vllm.worker.vineyard.storage.root_files import ROOT_FILES

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]

# Without the local prefix cache every hit comes from vineyard.
LLM_KWARGS = {"enable_prefix_caching": False}


@pytest.fixture(scope="module")
def no_cache(toy_model: str, reference: ReferenceRunner) -> list[list[int]]:
    return reference(toy_model, standard_prompts()).last.outputs


def test_unusable_root_at_startup(
    toy_model: str, module_dir: Path, no_cache: list[list[int]]
) -> None:
    # Tests may run as root, which ignores permission bits: a path below a
    # regular file can be created by nobody.
    blocker = module_dir / "a-file"
    blocker.write_text("not a directory")
    root = blocker / "cache"
    prompts = standard_prompts()
    run = run_engine(
        toy_model,
        [{"prompts": prompts}, {"prompts": prompts}],
        engine_env(root),
        module_dir / "unusable",
        llm_kwargs=LLM_KWARGS,
        timeout_s=180,
    )
    for round_ in run.rounds:
        assert round_.outputs == no_cache
        assert round_.num_cached_tokens == [0] * len(prompts)
    assert str(root) in run.log and "Not a directory" in run.log
    # Counted, not only logged: the worker's cache and the scheduler's
    # lookups never started.
    assert run.rounds[-1].counter("backend_start_failures") >= 1


def test_root_broken_at_runtime(
    toy_model: str, module_dir: Path, no_cache: list[list[int]]
) -> None:
    root = module_dir / "broken" / "cache"
    prompts = standard_prompts()
    run = run_engine(
        toy_model,
        [
            {"prompts": prompts},
            # The root becomes a regular file: everything cached is gone
            # and nothing can be written any more.
            {"prompts": prompts, "break_path": str(root)},
            {"prompts": prompts},
        ],
        engine_env(root),
        module_dir / "broken",
        llm_kwargs=LLM_KWARGS,
        timeout_s=180,
    )
    assert run.rounds[0].counter("tokens_written") > 0
    for i, round_ in enumerate(run.rounds):
        assert round_.settled
        assert round_.outputs == no_cache
        if i > 0:
            assert round_.num_cached_tokens == [0] * len(prompts)
            assert run.delta(i, "hit_tokens") == 0
            assert run.delta(i, "tokens_written") == 0
            # Visible: every update after the break is rejected or failed.
            assert (
                run.delta(i, "tokens_rejected") > 0
                or run.delta(i, "updates_failed") > 0
            )


@pytest.fixture(scope="module")
def killed(toy_model: str, module_dir: Path) -> EngineRun:
    """SIGKILL every vineyard backend process of the engine (the worker's
    two readers and its writer; the scheduler's lookups need none) between
    generate calls."""
    prompts = standard_prompts()
    return run_engine(
        toy_model,
        [
            {"prompts": prompts[:1]},
            {"prompts": prompts, "kill_backends": True},
            {"prompts": prompts, "kill_backends": True},
        ],
        engine_env(
            module_dir / "killed" / "cache", extra={"VINEYARD_CACHE_READERS": "2"}
        ),
        module_dir / "killed",
        llm_kwargs=LLM_KWARGS,
        timeout_s=180,
    )


def test_killed_backends_restart(killed: EngineRun) -> None:
    assert [r.killed_backends for r in killed.rounds] == [0, 3, 3]
    # Backends restart on their next call: the readers for the loads of
    # rounds 1 and 2, the writer for the saves of round 1.
    assert killed.delta(1, "backend_restarts") >= 1
    assert killed.delta(2, "backend_restarts") >= 1
    assert killed.delta(1, "tokens_written") > 0
    assert killed.last.counter("updates_failed") == 0
    # The reader restarts on a thread of its own (the forward thread never
    # waits for it): loads that come while it restarts come up short and
    # are recomputed, at most every load of the rounds after a kill.
    assert killed.last.counter("load_errors") <= 2 * len(standard_prompts())
    assert all(r.settled for r in killed.rounds)
    assert killed.shutdown_s is not None  # and within the harness's bound


def test_killed_backends_keep_serving(
    killed: EngineRun, no_cache: list[list[int]]
) -> None:
    prompts = standard_prompts()
    assert killed.rounds[0].outputs == no_cache[:1]
    assert killed.rounds[1].outputs == no_cache
    assert killed.rounds[2].outputs == no_cache
    # What was written before the kill is still found by the lookups (the
    # reader loads it once restarted; a load during the restart is
    # recomputed), and never more than that.
    assert killed.delta(1, "hit_tokens") >= cacheable_prefix(len(prompts[0]))
    assert killed.delta(2, "hit_tokens") >= sum(
        cacheable_prefix(len(p)) for p in prompts
    )
    for r in killed.rounds[1:]:
        assert all(
            n <= cacheable_prefix(len(p))
            for n, p in zip(r.num_cached_tokens, prompts, strict=False)
        )


def _flip_a_byte_in_every_chunk(root: Path) -> int:
    """Bit rot at rest: one payload byte of every chunk file under
    ``root`` flipped (its last entry's KV, before the trailer)."""
    flipped = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__temp"]
        for name in filenames:
            if name == MANIFEST or name in ROOT_FILES:
                continue
            flip_a_payload_byte(os.path.join(dirpath, name))
            flipped += 1
    return flipped


def test_corrupt_chunks_are_recomputed_and_written_again(
    toy_model: str, module_dir: Path, no_cache: list[list[int]]
) -> None:
    """Every chunk file is bit-rotted between two engines. The second
    engine's lookups promise them (a lookup only stats), its loads fail
    verification and go through vLLM's load-error path: the blocks are
    recomputed, the outputs equal a run without the cache, the bad chunks
    are counted and removed. The same engine then writes them again and
    loads what it wrote: it recovers without a restart."""
    root = module_dir / "corrupt" / "cache"
    env = engine_env(root)
    prompts = standard_prompts()

    def engine(name: str, num_rounds: int) -> EngineRun:
        """An engine on ``root`` generating ``prompts`` in each round."""
        rounds = [{"prompts": prompts} for _ in range(num_rounds)]
        return run_engine(
            toy_model, rounds, env, module_dir / "corrupt" / name, llm_kwargs=LLM_KWARGS
        )

    first = engine("writer", 1)
    assert first.last.settled and first.last.counter("tokens_written") > 0
    assert _flip_a_byte_in_every_chunk(root) > 0

    second = engine("reader", 3)
    bitten = second.rounds[0]
    assert bitten.outputs == no_cache
    assert bitten.counter("hit_tokens") > 0  # promised by the lookup
    assert bitten.counter("corrupt_chunks") > 0
    assert bitten.counter("load_errors") > 0
    assert bitten.counter("loaded_tokens") == 0  # nothing bad loaded
    # (vLLM still reports the promised tokens as external prefix-cache hits
    # and num_cached_tokens: it counts at scheduling time.)

    # Each load stops at a request's first bad chunk, so later rounds find
    # the rest (counted and removed too); the removed chunks are written
    # again and then loaded.
    assert all(r.settled for r in second.rounds)
    assert second.delta(0, "tokens_written") + second.delta(1, "tokens_written") > 0
    assert second.delta(2, "loaded_tokens") > 0
    for round_ in second.rounds:
        assert round_.outputs == no_cache


#: The reads of one load: LLM_KWARGS' engines read segments of 4 blocks
#: (a quarter of a step of 1024 tokens), two readers at once.
SEGMENT_BLOCKS = 1024 // BLOCK_SIZE // 4
BAD_BLOCK = 3 * SEGMENT_BLOCKS + 1  # inside the fourth segment


def _chunk_file_of(root: Path, prompt: list[int], num_blocks: int) -> Path:
    """The chunk file of ``prompt``'s first ``num_blocks`` blocks (the
    default chunk: one block) in the one namespace under ``root``."""
    ids = synthetic_ids(extend_digests([], prompt, BLOCK_SIZE))[:num_blocks]
    paths = [
        Path(ChunkFiles(str(namespace), 1, 0).path(ids))
        for namespace in root.iterdir()
        if namespace.is_dir()
    ]
    (path,) = [p for p in paths if p.is_file()]
    return path


@pytest.mark.parametrize("keyed", [False, True], ids=["checksum", "keyed"])
def test_a_corrupt_chunk_among_segments_in_flight_is_caught(
    toy_model: str, module_dir: Path, no_cache: list[list[int]], keyed: bool
) -> None:
    """A load reads a long prompt in segments, two readers at once (each
    reading and verifying its own) while the forward thread copies the one
    before. One bit-rotted chunk inside the fourth segment stops the
    load exactly there: the three segments before it and the good block of
    its own segment are loaded (verified), nothing from the bad block on,
    with the checksum and with a key. vLLM recomputes the rest and the
    outputs equal a run without the cache, and the chunk is written again."""
    workdir = module_dir / f"corrupt-in-flight-{keyed}"
    root = workdir / "cache"
    extra = {"VINEYARD_CACHE_READERS": "2"}
    if keyed:
        key = workdir / "auth.key"
        workdir.mkdir(parents=True)
        key.write_text("a secret of at least sixteen bytes\n")
        extra["VINEYARD_CACHE_AUTH_KEY_FILE"] = str(key)
    env = engine_env(root, extra=extra)
    prompts = standard_prompts()
    unique = prompts[2]  # shares no block with the others
    assert cacheable_prefix(len(unique)) // BLOCK_SIZE > 4 * SEGMENT_BLOCKS

    first = run_engine(
        toy_model, [{"prompts": prompts}], env, workdir / "writer",
        llm_kwargs=LLM_KWARGS,
    )  # fmt: skip
    assert first.last.settled
    bad = _chunk_file_of(root, unique, BAD_BLOCK + 1)
    flip_a_payload_byte(bad)
    corrupted = bad.read_bytes()

    second = run_engine(
        toy_model, [{"prompts": prompts}], env, workdir / "reader",
        llm_kwargs=LLM_KWARGS,
    )  # fmt: skip
    hit = second.rounds[0]
    assert hit.outputs == no_cache
    assert hit.counter("corrupt_chunks") == 1
    assert hit.counter("load_errors") == 1
    whole = cacheable_prefix(len(prompts[0])) + cacheable_prefix(len(prompts[1]))
    assert hit.counter("loaded_tokens") == whole + BAD_BLOCK * BLOCK_SIZE
    # The bad file was removed, and the recomputed blocks written again.
    assert hit.settled
    assert bad.read_bytes() != corrupted
