# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The distributed filesystem's own faults, on a real GlusterFS replica-2
volume mounted twice (two clients as two hosts), a real cache on each: a
brick server that dies and comes back, a client whose mount is torn away
(lazy unmount, killed client), a volume set read-only, and a chunk in
split-brain. Each costs hits, never correctness: every loaded block is
checked bit-exact against what was written (the harness), and whatever the
cache did not write stays."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.worker.vineyard_cache_testing import make_tokens
from tests.worker.vineyard_disk_testing import CHUNK_SIZE, Harness, open_cache
from tests.worker.vineyard_glusterfs_testing import GlusterVolume, glusterfs_volume

PREFIX = 4 * CHUNK_SIZE
#: An operator's file on the root, which no fault may make the cache touch.
NOTE = b"not the cache's"


class TwoHosts:
    """A cache on each client of one volume, on the root ``cache``."""

    def __init__(self, volume: GlusterVolume) -> None:
        self.volume = volume
        self.roots = tuple(mount / "cache" for mount in volume.mounts)
        self.roots[0].mkdir(mode=0o700)
        (self.roots[0] / "NOTES").write_bytes(NOTE)
        self.a = open_cache(self.roots[0], sweep_interval_s=3600.0)
        self.b = open_cache(self.roots[1], sweep_interval_s=3600.0)
        self.rng = random.Random(11)

    def prompt(self) -> list[int]:
        return make_tokens(PREFIX, self.rng)

    def note_intact(self) -> bool:
        return (self.roots[1] / "NOTES").read_bytes() == NOTE

    def close(self) -> None:
        self.a.cache.close()
        self.b.cache.close()


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[TwoHosts]:
    with glusterfs_volume(tmp_path) as volume:
        hosts = TwoHosts(volume)
        try:
            yield hosts
        finally:
            hosts.close()


def write_errors(host: Harness) -> int:
    host.poll_stats()
    return host.counters()["write_errors"]


def test_a_brick_that_dies_and_comes_back(hosts: TwoHosts) -> None:
    """Writes and hits go on through the other brick; after the heal, the
    brick that was down serves what was written meanwhile on its own."""
    before = hosts.prompt()
    hosts.a.write(before)
    hosts.volume.kill_brick(0)
    during = hosts.prompt()
    hosts.a.write(during)
    assert hosts.b.load(before) == PREFIX
    assert hosts.b.load(during) == PREFIX
    assert write_errors(hosts.a) == 0

    hosts.volume.start_bricks()
    hosts.volume.wait_healed()
    # Only the brick that was down serves now: it holds the chunks written
    # while it was (healed), intact.
    hosts.volume.kill_brick(1)
    assert hosts.b.load(during) == PREFIX
    assert hosts.a.load(before) == PREFIX
    after = hosts.prompt()
    hosts.b.write(after)
    assert hosts.a.load(after) == PREFIX
    assert hosts.b.counters()["corrupt_chunks"] == 0
    assert hosts.note_intact()


@pytest.mark.parametrize("loss", ["lazy-unmount", "killed-client"])
def test_a_host_that_loses_its_mount(hosts: TwoHosts, loss: str) -> None:
    """The host that lost its mount misses and fails its writes (counted),
    writes nothing into the empty local folder left at the mount's path,
    and hits again once the volume is mounted again, without a restart;
    the other host is unaffected."""
    shared = hosts.prompt()
    hosts.a.write(shared)
    mount_a = hosts.volume.mounts[0]
    if loss == "lazy-unmount":
        hosts.volume.unmount_lazily(0)
    else:
        hosts.volume.kill_client(0)

    lost = hosts.prompt()
    errors = write_errors(hosts.a)
    hosts.a.write(lost, max_saves=2)
    assert write_errors(hosts.a) > errors
    assert hosts.a.load(shared) == 0
    if loss == "lazy-unmount":
        assert os.listdir(mount_a) == []  # nothing written to the local disk
    # The other host serves and writes as before.
    assert hosts.b.load(shared) == PREFIX
    other = hosts.prompt()
    hosts.b.write(other)

    hosts.volume.mount(0)
    assert hosts.a.load(shared) == PREFIX
    assert hosts.a.load(other) == PREFIX
    hosts.a.write(lost)
    assert hosts.b.load(lost) == PREFIX
    assert hosts.note_intact()


def test_a_read_only_volume_still_serves_hits(hosts: TwoHosts) -> None:
    written = hosts.prompt()
    hosts.a.write(written)
    hosts.volume.set("features.read-only", "on")
    try:
        refused = hosts.prompt()
        errors = write_errors(hosts.a)
        hosts.a.write(refused, max_saves=2)
        assert write_errors(hosts.a) > errors
        assert hosts.b.load(refused) == 0
        # A hit's last-use mark fails on a read-only volume; the hit stands.
        assert hosts.a.load(written) == PREFIX
        assert hosts.b.load(written) == PREFIX
    finally:
        hosts.volume.set("features.read-only", "off")
    hosts.a.write(refused)
    assert hosts.b.load(refused) == PREFIX
    assert hosts.note_intact()


def test_a_chunk_in_split_brain_is_never_served(hosts: TwoHosts) -> None:
    """A chunk file whose two replicas diverged while each brick was down
    in turn (two partitions; self-heal off so it stays split): reading it
    fails, so a load stops before it, and the chunks before it are still
    served."""
    volume = hosts.volume
    volume.set("cluster.self-heal-daemon", "off")
    tokens = hosts.prompt()
    hosts.a.write(tokens)
    path = hosts.a.chunk_path(tokens, 2)
    size = os.path.getsize(path)
    for down, fill in ((0, b"\x01"), (1, b"\x02")):
        volume.kill_brick(down)
        with open(path, "r+b") as f:  # another host's write, in a partition
            f.write(fill * size)
        volume.start_bricks()
    with pytest.raises(OSError):  # EIO: replicas disagree
        Path(path.replace(str(hosts.roots[0]), str(hosts.roots[1]))).read_bytes()

    hosts.b.reset_counters()
    assert hosts.b.load(tokens) == 2 * CHUNK_SIZE
    assert hosts.b.counters()["load_errors"] >= 1
    assert hosts.note_intact()
