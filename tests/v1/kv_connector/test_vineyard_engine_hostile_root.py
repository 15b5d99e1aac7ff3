# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A real engine on a root that holds what is not the cache's, with a tiny
budget, a 1 s TTL and sweeps every half second: a user's files (sources, a
notes file, an SSH key, a data file, an empty folder), a link to a folder
outside the root, a sparse 1 TiB file with a future mtime, a directory
1,200 levels deep, and later a FIFO and a link where the engine's own
chunks belong. Nothing that is not the cache's is touched, the cache
keeps caching (the sparse file does not empty it, the deep tree does not
stop upkeep: the root stays within its budget), no backend blocks on the
FIFO, and outputs are those of no cache.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vineyard_engine_testing import (
    BLOCK_SIZE,
    ReferenceRunner,
    engine_env,
    run_engine,
)
from tests.vineyard_testing import random_tokens
from vllm.worker.vineyard.storage.chunks import ChunkFiles
from vllm.worker.vineyard.storage.digests import extend_digests, synthetic_ids
from vllm.worker.vineyard.storage.scan import scan_root

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

MAX_TOKENS = 8
LLM_KWARGS = {"enable_prefix_caching": False}
BUDGET_GB = 0.004  # about 4 MiB: a few prompts' chunks
DEPTH = 1200


def plant(root: Path, outside: Path) -> dict[Path, bytes]:
    """A user's files and hostile entries on the root; returns the regular
    files and their contents."""
    files = {
        root / "project" / "main.py": b"print('hello')\n",
        root / "notes.txt": b"remember the milk\n",
        root / ".ssh" / "id_ed25519": b"-----BEGIN OPENSSH PRIVATE KEY-----\n",
        root / "data.bin": os.urandom(2 << 20),
        outside / "precious.txt": b"outside the root\n",
    }
    for path, content in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    (root / "empty-folder").mkdir()
    (root / "link-out").symlink_to(outside)
    sparse = root / "sparse.img"
    with open(sparse, "wb") as f:
        f.truncate(1 << 40)
    future = 4_000_000_000  # 2096
    os.utime(sparse, (future, future))
    deep = root / "deep"
    deep.mkdir()
    fd = os.open(deep, os.O_RDONLY)
    for _ in range(DEPTH):  # relative to a descriptor: no PATH_MAX
        os.mkdir("d", dir_fd=fd)
        sub = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = sub
    os.close(fd)
    return files


def remove_deep_tree(top: Path) -> None:
    """Remove the planted tree bottom-up through descriptors (pytest's own
    clean-up of old temp folders recurses and would fail on it)."""
    fds = [os.open(top, os.O_RDONLY)]
    while True:
        try:
            fds.append(os.open("d", os.O_RDONLY, dir_fd=fds[-1]))
        except FileNotFoundError:
            break
    while len(fds) > 1:
        os.close(fds.pop())
        os.rmdir("d", dir_fd=fds[-1])
    os.close(fds.pop())


@pytest.fixture
def deep_tree_removed(tmp_path: Path) -> Iterator[None]:
    yield
    if (tmp_path / "root" / "deep").exists():
        remove_deep_tree(tmp_path / "root" / "deep")


def test_a_hostile_root(
    toy_model: str,
    reference: ReferenceRunner,
    tmp_path: Path,
    deep_tree_removed: None,
) -> None:
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    outside = tmp_path / "outside"
    files = plant(root, outside)
    rng = random.Random(11)
    prompts = [random_tokens(rng, 700) for _ in range(6)]
    plain = reference(toy_model, prompts, MAX_TOKENS, **LLM_KWARGS).last.outputs
    env = engine_env(
        root,
        extra={
            "VINEYARD_CACHE_DISK_LIMIT_GB": str(BUDGET_GB),
            "VINEYARD_CACHE_TTL_S": "1",
            "VINEYARD_CACHE_SWEEP_INTERVAL_S": "0.5",
            "VINEYARD_CACHE_BACKEND_TIMEOUT_S": "20",
        },
    )
    rounds = [
        {"prompts": [p], "max_tokens": MAX_TOKENS, "pause_s": 0.5} for p in prompts
    ]
    first = run_engine(
        toy_model, rounds, env, tmp_path / "first", llm_kwargs=LLM_KWARGS
    )
    assert [r.outputs[0] for r in first.rounds] == plain
    assert first.last.counter("updates_completed") > 0
    assert (
        first.last.counter("evicted_chunks") + first.last.counter("expired_chunks") > 0
    )

    # A FIFO and a link where the engine's own chunks of the last prompt
    # belong (blocks 1 and 2): nothing blocks, nothing is followed.
    (namespace,) = scan_root(str(root)).namespaces.values()
    chunk_files = ChunkFiles(namespace.path, 1, 0)
    ids = synthetic_ids(extend_digests([], prompts[-1], BLOCK_SIZE))
    fifo, link = chunk_files.path(ids[:2]), chunk_files.path(ids[:3])
    for planted in (fifo, link):
        os.makedirs(os.path.dirname(planted), exist_ok=True)
        if os.path.lexists(planted):
            os.unlink(planted)
    os.mkfifo(fifo)
    os.symlink(outside / "precious.txt", link)
    again = run_engine(
        toy_model, rounds[-1:] * 2, env, tmp_path / "again", llm_kwargs=LLM_KWARGS
    )
    assert [r.outputs[0] for r in again.rounds] == [plain[-1]] * 2
    # The writer removes what is not a chunk at its chunk paths (counted)
    # and writes the chunks: no write waits for its timeout.
    assert again.last.counter("updates_failed") == 0
    assert again.last.counter("corrupt_chunks") >= 2

    # Nothing that is not the cache's was touched.
    for path, content in files.items():
        assert path.read_bytes() == content, path
    assert (root / "empty-folder").is_dir()
    assert os.readlink(root / "link-out") == str(outside)
    assert (root / "sparse.img").stat().st_size == 1 << 40
    assert (outside / "precious.txt").read_bytes() == b"outside the root\n"
    deep = root / "deep"
    depth = 0
    while (deep / "d").is_dir() and depth <= DEPTH:
        deep, depth = deep / "d", depth + 1
    assert depth == DEPTH
    # The cache's own bytes stayed within the budget (the sparse file and
    # the planted files are not counted, the deep tree did not stop upkeep).
    scan = scan_root(str(root))
    cache_bytes = sum(c.disk_bytes for c in scan.chunks)
    assert cache_bytes <= BUDGET_GB * (1 << 30)
