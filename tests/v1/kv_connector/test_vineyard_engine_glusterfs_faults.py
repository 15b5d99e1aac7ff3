# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Two engines on two hosts' mounts of one GlusterFS replica-2 volume, while
the filesystem misbehaves under them: a brick server dies and comes back,
host A's mount is torn away (lazy unmount) and mounted again, the volume is
set read-only, and chunk files end in split-brain. The engines run through
all of it without a restart; each fault costs hits only, every output equals
a run without the cache.

Both engines run at once (one forked, one a fresh interpreter); each round is
held at a gate until the test has changed the filesystem for it (see
``gate`` in ``vineyard_engine_testing``). The cache-level versions of these
faults, with both kinds of mount loss, are in
``tests/worker/vineyard/storage/test_glusterfs_faults.py``.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.vineyard_engine_testing import (
    CHUNK_SIZE,
    EngineRun,
    ReferenceRunner,
    cacheable_prefix,
    engine_env,
    open_gate,
    run_engine,
    wait_at_gate,
)
from tests.vineyard_testing import random_tokens
from tests.worker.vineyard_glusterfs_testing import GlusterVolume, glusterfs_volume
from vllm.worker.vineyard.storage.scan import scan_root

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

MAX_TOKENS = 4
#: An operator's file on the root, which no fault may make the cache touch.
NOTE = b"not the cache's"

#: Per engine, its rounds: (gate, prompt names). A's first round opens as
#: soon as its engine is up.
A_ROUNDS = (
    (None, ["first"]),  # both bricks up
    ("a1", ["brick_down_a", "brick_down_b"]),  # brick 0 down
    ("a2", ["mount_lost", "written_mount_lost"]),  # A's mount gone
    ("a3", ["after_remount"]),  # A's mount back
    ("a4", ["read_only", "written_read_only"]),  # the volume read-only
    ("a5", ["split_brain"]),  # its chunk files in split-brain
)
B_ROUNDS = (
    ("b0", ["first", "brick_down_a"]),  # brick 0 still down
    ("b1", ["brick_down_b", "mount_lost", "after_remount", "read_only"]),
    ("b2", ["split_brain"]),  # both bricks up
)


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    rng = random.Random(41)
    names = {name for _, names in (*A_ROUNDS, *B_ROUNDS) for name in names}
    return {name: random_tokens(rng, rng.randint(400, 700)) for name in sorted(names)}


@dataclass
class Outcome:
    a: EngineRun
    b: EngineRun
    #: What A's mount point held while the mount was gone.
    local_folder_while_lost: list[str]
    #: How many chunk files were put in split-brain.
    split_files: int
    note_intact: bool


def _rounds(
    spec: tuple[tuple[str | None, list[str]], ...],
    prompts: dict[str, list[int]],
    gates: Path,
) -> list[dict[str, object]]:
    return [
        {
            "prompts": [prompts[name] for name in names],
            "max_tokens": MAX_TOKENS,
            "gate": None if gate is None else str(gates / gate),
        }
        for gate, names in spec
    ]


def _split_brain(volume: GlusterVolume, paths: list[Path]) -> None:
    """Each file written differently on each brick while the other was down
    (two partitions), with self-heal off so that it stays split."""
    volume.set("cluster.self-heal-daemon", "off")
    volume.set("cluster.data-self-heal", "off")
    for down, fill in ((0, b"\x01"), (1, b"\x02")):
        volume.kill_brick(down)
        for path in paths:
            with open(path, "r+b") as f:
                f.write(fill * os.path.getsize(path))
        volume.start_bricks()


@pytest.fixture(scope="module")
def outcome(
    toy_model: str, prompts: dict[str, list[int]], module_dir: Path
) -> Iterator[Outcome]:
    gates = module_dir / "gates"
    gates.mkdir()
    with (
        glusterfs_volume(module_dir / "gluster") as volume,
        ThreadPoolExecutor(2) as pool,
    ):
        roots = [mount / "cache" for mount in volume.mounts]
        roots[0].mkdir(mode=0o700)
        (roots[0] / "NOTES").write_bytes(NOTE)

        def start(
            name: str, root: Path, spec: tuple[tuple[str | None, list[str]], ...]
        ) -> Future[EngineRun]:
            return pool.submit(
                run_engine,
                toy_model,
                _rounds(spec, prompts, gates),
                # One block per chunk whatever the volume's round trip (about
                # 1 ms here on a loaded machine): the test counts hits in
                # blocks.
                engine_env(root, extra={"VINEYARD_CACHE_CHUNK_SIZE": str(CHUNK_SIZE)}),
                module_dir / name,
                timeout_s=800.0,
                fresh=name == "b",  # the fork server runs one at a time
            )

        a = start("a", roots[0], A_ROUNDS)
        b = start("b", roots[1], B_ROUNDS)

        def step(gate: str, change: Callable[[], None] = lambda: None) -> None:
            """Change the filesystem, then run the round at ``gate``."""
            change()
            open_gate(gates / gate)

        def reached(gate: str) -> None:
            wait_at_gate(gates / gate, running=lambda: not (a.done() or b.done()))

        try:
            reached("a1")  # A filled the cache with both bricks up
            step("a1", lambda: volume.kill_brick(0))
            reached("a2")
            reached("b0")
            step("b0")
            reached("b1")

            def only_the_healed_brick() -> None:
                volume.start_bricks()
                volume.wait_healed()
                volume.kill_brick(1)

            step("b1", only_the_healed_brick)
            reached("b2")
            volume.start_bricks()
            volume.wait_healed()

            step("a2", lambda: volume.unmount_lazily(0))
            reached("a3")
            local = sorted(os.listdir(volume.mounts[0]))
            step("a3", lambda: volume.mount(0))
            reached("a4")
            step("a4", lambda: volume.set("features.read-only", "on"))
            reached("a5")
            volume.set("features.read-only", "off")

            before = {c.path for c in scan_root(str(roots[1])).chunks}
            step("b2")
            run_b = b.result()
            written = [
                Path(c.path)
                for c in scan_root(str(roots[1])).chunks
                if c.path not in before
            ]
            step("a5", lambda: _split_brain(volume, written))
            run_a = a.result()
        finally:  # a failure above must not leave an engine waiting
            for gate, _ in (*A_ROUNDS, *B_ROUNDS):
                if gate is not None:
                    open_gate(gates / gate)
        yield Outcome(
            run_a,
            run_b,
            local,
            len(written),
            (roots[1] / "NOTES").read_bytes() == NOTE,
        )


@pytest.fixture(scope="module")
def no_cache(
    toy_model: str, prompts: dict[str, list[int]], reference: ReferenceRunner
) -> dict[str, list[int]]:
    names = sorted(prompts)
    run = reference(toy_model, [prompts[n] for n in names], max_tokens=MAX_TOKENS)
    return dict(zip(names, run.last.outputs, strict=True))


def hits(prompts: dict[str, list[int]], *names: str) -> int:
    return sum(cacheable_prefix(len(prompts[name])) for name in names)


def test_outputs_identical_to_no_cache_through_every_fault(
    outcome: Outcome, no_cache: dict[str, list[int]]
) -> None:
    for run, spec in ((outcome.a, A_ROUNDS), (outcome.b, B_ROUNDS)):
        assert [r.outputs for r in run.rounds] == [
            [no_cache[name] for name in names] for _, names in spec
        ]
        assert run.last.counter("backend_restarts") == 0
        assert run.last.counter("corrupt_chunks") == 0
    assert outcome.note_intact


def test_a_brick_down_and_back(outcome: Outcome, prompts: dict[str, list[int]]) -> None:
    """With brick 0 down, A writes through brick 1 and B hits all of it;
    after the heal, brick 0 alone serves what was written while it was
    down."""
    a, b = outcome.a, outcome.b
    assert a.delta(1, "write_errors") == 0
    assert b.delta(0, "hit_tokens") == hits(prompts, "first", "brick_down_a")
    assert b.delta(1, "hit_tokens") == hits(prompts, "brick_down_b")
    assert b.delta(1, "write_errors") == 0


def test_a_lost_mount_costs_that_host_its_hits_until_it_returns(
    outcome: Outcome, prompts: dict[str, list[int]]
) -> None:
    a = outcome.a
    # B wrote "mount_lost" before; A cannot see it, and its own writes fail
    # (counted) without landing in the empty local folder left behind.
    assert a.delta(2, "hit_tokens") == 0
    assert a.delta(2, "write_errors") > 0
    assert outcome.local_folder_while_lost == []
    # Mounted again, the same engine hits what B wrote.
    assert a.delta(3, "hit_tokens") == hits(prompts, "after_remount")


def test_a_read_only_volume_serves_hits_and_counts_writes(
    outcome: Outcome, prompts: dict[str, list[int]]
) -> None:
    a = outcome.a
    assert a.delta(4, "hit_tokens") == hits(prompts, "read_only")
    assert a.delta(4, "loaded_tokens") == hits(prompts, "read_only")
    assert a.delta(4, "write_errors") > 0


def test_split_brain_chunks_are_never_served(outcome: Outcome) -> None:
    a = outcome.a
    assert outcome.split_files > 0
    # The lookup finds the files (their metadata is fine); reading them
    # fails (EIO), so the load fails and its blocks are recomputed.
    assert a.delta(5, "loaded_tokens") == 0
    assert a.delta(5, "load_errors") >= 1
