# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Real engines on a cache root that fills up and is swept.

- One engine on a small tmpfs (a real filesystem that returns ENOSPC): it
  fills it, keeps generating exactly what an engine without the cache
  does, counts the failed writes, its sweeper evicts (the disk limit is far
  above the filesystem: the free-space rule alone), and it writes again.
- Three engines (separate processes started together) writing overlapping
  prefixes to one root with a disk limit of a few dozen chunks, so
  eviction runs while they write and read: outputs identical to no cache,
  and every engine gets hits in a last round.

vLLM's local prefix cache is off, so every hit comes from vineyard.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vineyard_engine_testing import (
    EngineRun,
    ReferenceRunner,
    engine_env,
    open_gate,
    run_engine,
    wait_at_gate,
)
from tests.vineyard_testing import random_tokens

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

MAX_TOKENS = 8
LLM_KWARGS: dict[str, Any] = {"enable_prefix_caching": False}
MiB = 1 << 20
#: A chunk of the default toy model: 256 tokens x 4 layers x K, V x
#: 2 heads x 64 x float32 = 1 MiB (and its trailers and ids).
FS_BYTES = 4 * MiB
#: The three engines' disk limit: 42 chunks of 64 tokens of the toy model
#: (256 KiB each), about 40 with their ids and trailers.
THREE_ENGINES_BUDGET = 42 * MiB // 4


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[list[int]]]:
    rng = random.Random(21)
    base = random_tokens(rng, 768)
    return {
        "fill": [random_tokens(rng, 1300) for _ in range(2)],
        "after": [random_tokens(rng, 1300)],
        # Three prompts sharing a 768-token prefix, 300 more tokens each.
        "shared": [base + random_tokens(rng, 300) for _ in range(3)],
    }


@pytest.fixture(scope="module")
def no_cache(
    toy_model: str, prompts: dict[str, list[list[int]]], reference: ReferenceRunner
) -> dict[str, list[list[int]]]:
    """What an engine without the cache generates (one reference run)."""
    names = ("fill", "after", "shared")
    outputs = reference(
        toy_model, [p for n in names for p in prompts[n]], max_tokens=MAX_TOKENS
    ).last.outputs
    out: dict[str, list[list[int]]] = {}
    for n in names:
        out[n], outputs = outputs[: len(prompts[n])], outputs[len(prompts[n]) :]
    return out


@pytest.fixture(scope="module")
def small_fs(module_dir: Path) -> Iterator[Path]:
    import subprocess

    path = module_dir / "fs"
    path.mkdir()
    done = subprocess.run(
        # Private, as a cache root must be (a tmpfs is 1777 by default).
        [
            "mount",
            "-t",
            "tmpfs",
            "-o",
            f"size={FS_BYTES},mode=0700",
            "tmpfs",
            str(path),
        ],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs: {done.stderr.strip()}")
    yield path
    if subprocess.run(["umount", str(path)]).returncode:
        subprocess.run(["umount", "-l", str(path)])


@pytest.fixture(scope="module")
def full_disk(
    toy_model: str,
    prompts: dict[str, list[list[int]]],
    small_fs: Path,
    module_dir: Path,
) -> EngineRun:
    """Round 0 writes 10 chunks to a filesystem that holds 3; round 1
    repeats those prompts; round 2, after a pause of two sweep intervals
    (the sweeper makes room), brings a new one."""
    env = engine_env(small_fs, extra={"VINEYARD_CACHE_SWEEP_INTERVAL_S": "2"})
    return run_engine(
        toy_model,
        [
            {"prompts": prompts["fill"], "max_tokens": MAX_TOKENS},
            {"prompts": prompts["fill"], "max_tokens": MAX_TOKENS},
            {"prompts": prompts["after"], "max_tokens": MAX_TOKENS, "pause_s": 5.0},
        ],
        env,
        module_dir / "full_disk",
        llm_kwargs=LLM_KWARGS,
    )


def test_full_disk_engine(
    full_disk: EngineRun, no_cache: dict[str, list[list[int]]]
) -> None:
    """Outputs identical to no cache throughout; write errors counted
    (never as completed updates); evictions; writes again afterwards."""
    run = full_disk
    assert run.rounds[0].outputs == no_cache["fill"]
    assert run.rounds[1].outputs == no_cache["fill"]
    assert run.rounds[2].outputs == no_cache["after"]
    last = run.last
    assert last.counter("write_errors") > 0
    assert last.counter("updates_failed") >= 1
    assert last.counter("updates_completed") < last.counter("updates_submitted")
    assert last.counter("evicted_chunks") > 0
    # Nothing bad is promised or loaded: a file that a failed write left
    # at a chunk path (of the wrong size) is removed by the lookup that
    # finds it (counted in corrupt_chunks), never loaded. But a lookup
    # promises chunks by stat, and the sweeper making room (LRU: round 0's
    # chunks all share one second, so the largest, the last chunks of a
    # prefix, go first) may evict some of them before the reader reads
    # them: that load comes up short, is counted, and its tokens are
    # recomputed (the outputs above are identical). Only round 1 has hits:
    # at most one short load per request, each explained by an eviction (a
    # load that lost every promised chunk leaves its request with no cached
    # tokens at all, so requests are counted, not requests with a hit).
    requests = len(run.rounds[1].outputs)
    assert last.counter("load_errors") == run.delta(1, "load_errors") <= requests
    assert last.counter("load_errors") <= last.counter("evicted_chunks")
    short = last.counter("hit_tokens") - last.counter("loaded_tokens")
    assert short >= 0
    assert (short > 0) == (last.counter("load_errors") > 0)
    # Writes resume once the sweeper has made room: new prompts are saved.
    assert run.delta(2, "tokens_written") > 0
    names = ("tokens_written", "write_errors", "updates_failed", "evicted_chunks")
    print("full disk:", {name: last.counter(name) for name in names})


@pytest.fixture(scope="module")
def three_engines(
    toy_model: str, prompts: dict[str, list[list[int]]], module_dir: Path
) -> list[EngineRun]:
    """Three engines started together on one root, a budget of about 40
    chunks. Round 0: each writes a prompt of its own (60 chunks in all:
    eviction runs). Round 1: engine ``i`` writes shared prompts ``i`` and
    ``i + 1`` (24 chunks, every pair of engines writes some same chunks at
    once) while round 0's chunks are evicted. Round 2: each generates all
    three. Each round starts once every engine finished the one before (and
    its writes), a second later: LRU tells apart what is used in different
    seconds only."""
    shared = prompts["shared"]
    own = [*prompts["fill"], *prompts["after"]]
    env = engine_env(
        module_dir / "shared_root",
        extra={
            "VINEYARD_CACHE_DISK_LIMIT_GB": str(THREE_ENGINES_BUDGET / (1 << 30)),
            "VINEYARD_CACHE_SWEEP_INTERVAL_S": "1",
        },
    )
    gates = [
        [module_dir / f"engine_{i}" / f"round{r}" for r in (1, 2)] for i in range(3)
    ]
    runs: list[EngineRun | None] = [None] * 3
    errors: list[BaseException] = []

    def start(i: int) -> None:
        try:
            runs[i] = run_engine(
                toy_model,
                [
                    {"prompts": [own[i]]},
                    {
                        "prompts": [shared[i], shared[(i + 1) % 3]],
                        "gate": str(gates[i][0]),
                    },
                    {"prompts": shared, "gate": str(gates[i][1])},
                ],
                env,
                module_dir / f"engine_{i}",
                llm_kwargs=LLM_KWARGS,
            )
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with pytest.MonkeyPatch.context() as mp:
        # One fresh interpreter per engine: the fork server runs one at a
        # time.
        mp.setenv("VINEYARD_ENGINE_TESTS_FORK_SERVER", "0")
        threads = [threading.Thread(target=start, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        try:
            for r in range(2):
                for i in range(3):
                    wait_at_gate(gates[i][r], running=threads[i].is_alive)
                time.sleep(1.1)
                for i in range(3):
                    open_gate(gates[i][r])
        except BaseException:
            for gate in (g for engine_gates in gates for g in engine_gates):
                open_gate(gate)  # none waits for the gate timeout
            raise
        finally:
            for t in threads:
                t.join()
    if errors:
        raise errors[0]
    return [r for r in runs if r is not None]


def test_three_engines_one_root(
    three_engines: list[EngineRun], no_cache: dict[str, list[list[int]]]
) -> None:
    """No crash, no wrong output, no corrupt chunk, while eviction runs;
    every engine gets hits in the last round (what was used last stays);
    the counters show what the races cost."""
    expected = no_cache["shared"]
    own = [*no_cache["fill"], *no_cache["after"]]
    assert len(three_engines) == 3
    for i, run in enumerate(three_engines):
        assert run.rounds[0].outputs == [own[i]]
        assert run.rounds[1].outputs == [expected[i], expected[(i + 1) % 3]]
        assert run.rounds[2].outputs == expected
        assert run.last.counter("corrupt_chunks") == 0
        assert run.last.counter("write_errors") == 0
    hits = [run.delta(2, "hit_tokens") for run in three_engines]
    assert all(h > 0 for h in hits), hits
    assert sum(r.last.counter("evicted_chunks") for r in three_engines) > 0
    summary = {
        name: [r.last.counter(name) for r in three_engines]
        for name in (
            "tokens_written",
            "tokens_rejected",
            "hit_tokens",
            "loaded_tokens",
            "load_errors",
            "evicted_chunks",
            "updates_failed",
        )
    }
    print("three engines on one root:", summary)
