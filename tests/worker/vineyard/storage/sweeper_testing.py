# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers of the sweeper's tests: chunk-shaped files laid out as vineyard
lays them out (aged with ``os.utime``), sweepers with a long interval that
the tests run by hand, prefixes for real caches, another process holding a
root's lock, and a host whose clock is off."""

from __future__ import annotations

import contextlib
import os
import random
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

from tests.vineyard_testing import wait_until
from tests.worker.vineyard_disk_testing import CHUNK_SIZE, Harness, chunk_files
from vllm.worker.vineyard.storage.root_files import (
    SWEEP_LOCK,
    RootSettings,
    record_root_settings,
)
from vllm.worker.vineyard.storage.sealing import MAGIC_PREFIX, TRAILER_BYTES
from vllm.worker.vineyard.storage.sweeper import RootSweeper

CHUNK_BYTES = 8192  # two filesystem blocks: size on disk == file size
LONG_AGO = 10_000.0


def namespace(k: int = 0) -> str:
    """A namespace directory's name (the sweeper touches nothing else)."""
    return f"v2-model{k}-0123456789abcdef-c32-tp1r0-nokey"


NS = namespace()


def sweeper(root: Path, limit_chunks: float = 1e6, ttl_s: float = 0.0) -> RootSweeper:
    return RootSweeper(str(root), int(limit_chunks * CHUNK_BYTES), ttl_s, 3600.0)


def sweep_now(s: RootSweeper, now: float | None = None) -> None:
    """A pass by ``s`` now, after any pass that holds the root's lock (a
    real cache's sweeper runs the passes its writer asks for)."""
    assert wait_until(lambda: s.sweep(now), 30.0), "the root's lock stayed held"


def set_root(root: str, limit_bytes: int, ttl_s: float = 0.0) -> RootSweeper:
    """A sweeper of a root whose settings are changed on purpose first (a
    real cache's own sweeper recorded its settings there already)."""
    record_root_settings(root, RootSettings(limit_bytes, ttl_s), replace=True)
    return RootSweeper(root, limit_bytes, ttl_s, 3600.0)


def chunk_bytes(size: int) -> bytes:
    """A file shaped as a chunk (no manifest: its header fits its size, it
    ends in a trailer), of ``size`` bytes."""
    if size == 0:
        return b""
    header = struct.pack("<ii", 1, 1)
    trailer = MAGIC_PREFIX.ljust(TRAILER_BYTES, b"\0")
    return header + b"\1" * (size - len(header) - len(trailer)) + trailer


def put_file(path: Path, mtime: float, size: int = CHUNK_BYTES) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(chunk_bytes(size))
    os.utime(path, (mtime, mtime))
    return path


def disk_bytes(path: Path | str) -> int:
    """The space a file takes (as the sweeper counts it)."""
    st = os.stat(path)
    return max(st.st_size, st.st_blocks * 512)


def age(path: Path | str, mtime: float) -> None:
    os.utime(path, (mtime, mtime))


def age_tree(root: Path | str, mtime: float) -> None:
    """Set the mtime of everything under ``root`` (deepest first)."""
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in [*filenames, *dirnames]:
            age(os.path.join(dirpath, name), mtime)


def chunk_path(root: Path, i: int, ns: str = NS) -> Path:
    name = f"{i:08x}"
    return root / ns / name[0:2] / name[2:4] / name[4:6] / name[6:8]


def prefixes(n: int, seed: int, num_chunks: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(1, 32000) for _ in range(num_chunks * CHUNK_SIZE + 1)]
        for _ in range(n)
    ]


def chunk_paths(h: Harness, tokens: list[int], num_chunks: int = 4) -> list[str]:
    return [h.chunk_path(tokens, c) for c in range(num_chunks)]


#: A disk limit of about 100 chunks of the real cache (20 KiB on disk each).
BUDGET = 2 << 20  # about 100 chunks of the real cache (20 KiB on disk each)


def bytes_on_disk(root: Path | str) -> tuple[int, int]:
    """The chunk files under ``root``: their space on disk, and the largest
    one's."""
    sizes = []
    for path in chunk_files(root):
        with contextlib.suppress(FileNotFoundError):  # the sweeper's thread
            sizes.append(disk_bytes(path))
    return sum(sizes), max(sizes, default=0)


def settled(caches: list[Harness], root: Path) -> dict[str, int]:
    """The writers' counts (summed) and the chunks left, once a background
    pass that may be running has finished (the same twice, 0.2 s apart;
    the backends' CPU time grows with every poll, so it is left out)."""
    last: dict[str, int] = {}
    for _ in range(100):
        now = {"left": len(chunk_files(root))}
        for h in caches:
            h.poll_stats()
            for name, value in h.counters().items():
                if not name.endswith("_cpu_us"):
                    now[name] = now.get(name, 0) + value
        if now == last:
            return now
        last = now
        time.sleep(0.2)
    raise AssertionError("the writers' sweeps did not settle")


HOLD_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def lock_held_elsewhere(root: Path, name: str = SWEEP_LOCK) -> Iterator[None]:
    """Another process holds the lock of the root's sweep lock file (as its
    sweep would) or ledger."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(root / name)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        yield
    finally:
        assert holder.stdin is not None
        holder.stdin.close()  # it exits: the lock goes with it
        holder.wait(10)


@contextlib.contextmanager
def clock_off_by(seconds: float) -> Iterator[None]:
    """Run as a host whose wall clock is ``seconds`` off."""
    real = time.time
    with mock.patch.object(time, "time", lambda: real() + seconds):
        yield


def write_now(path: Path) -> Path:
    """A chunk file written now: its mtime stamped by the filesystem (on a
    network filesystem, by its server's clock)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(chunk_bytes(CHUNK_BYTES))
    return path
