# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Two hosts on one cache root, on a real distributed filesystem: a
GlusterFS volume mounted twice (two clients), a real cache on each mount.
What one host writes the other loads (verified, bit-exact); the root's own
settings, its sweep lock and LRU by use hold across the clients."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

from tests.vineyard_testing import wait_until
from tests.worker.vineyard_cache_testing import make_tokens
from tests.worker.vineyard_disk_testing import CHUNK_SIZE, open_cache
from tests.worker.vineyard_glusterfs_testing import glusterfs_mounts
from vllm.worker.vineyard.storage.root_files import (
    SWEEP_LOCK,
    RootSettings,
    flock_within,
    read_root_settings,
    record_root_settings,
)
from vllm.worker.vineyard.storage.scan import scan_root
from vllm.worker.vineyard.storage.sweeper import RootSweeper

PREFIX = 4 * CHUNK_SIZE
MiB = 1 << 20


def test_two_hosts_share_one_root_on_glusterfs(tmp_path: Path) -> None:
    with glusterfs_mounts(tmp_path) as (mount_a, mount_b):
        root_a, root_b = mount_a / "cache", mount_b / "cache"
        root_a.mkdir(mode=0o700)
        # The root's settings, recorded by its operator; host B's own limit
        # is far smaller.
        record_root_settings(str(root_a), RootSettings(1 << 30, 0.0))
        host_a = open_cache(root_a, sweep_interval_s=3600.0, disk_limit_gb=1.0)
        host_b = open_cache(root_b, sweep_interval_s=3600.0, disk_limit_gb=0.001)
        try:
            rng = random.Random(7)
            prompts = [make_tokens(PREFIX, rng) for _ in range(3)]
            for tokens in prompts:
                host_a.write(tokens)
            # Written through one client, loaded through the other (the
            # harness checks every loaded block's bytes).
            for tokens in prompts:
                assert host_b.load(tokens) == PREFIX
            assert host_b.counters()["corrupt_chunks"] == 0
            chunks = {c.path for c in scan_root(str(root_a)).chunks}
            assert len(chunks) == 3 * 4

            # B's sweeper follows the root's settings (read through its
            # own mount), not its own 1 MiB: nothing is evicted.
            sweeper_a = RootSweeper(str(root_a), 1 << 30, 0.0, 3600.0)
            sweeper_b = RootSweeper(str(root_b), 1 * MiB, 0.0, 3600.0)
            assert read_root_settings(str(root_b)) == RootSettings(1 << 30, 0.0)
            assert sweeper_b.sweep()
            assert sweeper_b.limit_bytes == 1 << 30
            assert {c.path for c in scan_root(str(root_a)).chunks} == chunks

            # One sweep per root at a time, across hosts: A holds the lock
            # (once B's unlock of its sweep reaches the bricks: GlusterFS
            # releases a closed file's lock asynchronously).
            fd = os.open(root_a / SWEEP_LOCK, os.O_RDWR)
            try:
                assert flock_within(fd, 30.0, 0.05)
                assert not sweeper_b.sweep()
            finally:
                os.close(fd)
            # Free again once A's unlock reaches the bricks (GlusterFS
            # releases a closed file's lock asynchronously).
            assert wait_until(sweeper_b.sweep)

            # LRU by use across hosts: every chunk last used long ago, then
            # B loads the first prompt (a hit marks its chunks used); with
            # a limit that holds about two prompts, A's sweep keeps it.
            old = time.time() - 10_000
            for path in chunks:
                os.utime(path, (old, old))
            # Past FUSE's attribute cache: B's mount sees them old.
            seen_by_b = [root_b / os.path.relpath(path, root_a) for path in chunks]
            assert wait_until(
                lambda: all(p.stat().st_mtime < old + 1 for p in seen_by_b), 30.0
            )
            assert host_b.load(prompts[0]) == PREFIX

            def used_since() -> list[int]:
                return [
                    c.disk_bytes
                    for c in scan_root(str(root_a)).chunks
                    if c.mtime > old + 1
                ]

            # B's hit (the prompt's 4 chunks) is seen through A's mount.
            assert wait_until(lambda: len(used_since()) == 4, 30.0)
            per_prompt = sum(used_since())
            new_settings = RootSettings(2 * per_prompt, 0.0)
            record_root_settings(str(root_b), new_settings, replace=True)
            # Past FUSE's caches: A's mount reads B's settings.
            assert wait_until(
                lambda: read_root_settings(str(root_a)) == new_settings, 30.0
            )
            assert sweeper_a.sweep()
            assert sweeper_a.limit_bytes == 2 * per_prompt  # B's change
            left = {c.path for c in scan_root(str(root_a)).chunks}
            used = {host_a.chunk_path(prompts[0], k) for k in range(4)}
            assert used <= left and len(left) < len(chunks)
            assert host_a.load(prompts[0]) == PREFIX
        finally:
            host_a.cache.close()
            host_b.cache.close()
