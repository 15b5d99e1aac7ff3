# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The v2 storage format at the cache level, on real vineyard and real
backend processes: one entry per KV block (all layers), every loaded entry
verified against its trailer, lookups by ``stat`` only, keyed namespaces,
file modes, formats and chunk sizes that never mix (issue 7, Tests), and
hash collisions that leave others' files alone (issue 22).

Corruption is made at rest, on the chunk files themselves, the way bit rot,
a crash, a foreign writer or an attacker would leave them: vineyard's own
file layout is an int32 count ``n``, ``n`` int32 ids, then the chunk's
entries (payload, then a 64-byte trailer, each).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mmh3
import numpy as np
import pytest
import torch

from tests.vineyard_testing import wait_until
from tests.worker.vineyard_cache_testing import (
    BLOCK_SIZE,
    CHUNK_SIZE,
    CacheFactory,
    CacheHarness,
    chunk_files,
    make_tokens,
    read_header_ids,
    same_bits,
    whole_chunks,
    write_header_ids,
)
from vllm.worker.vineyard.connector.lookups import VineyardCacheLookup
from vllm.worker.vineyard.log_limiter import LogLimiter
from vllm.worker.vineyard.storage.chunks import ChunkFiles, PendingTouches
from vllm.worker.vineyard.storage.digests import (
    FORMAT_VERSION,
    extend_digests,
    synthetic_ids,
)
from vllm.worker.vineyard.storage.sealing import TRAILER_BYTES, Sealer

SEQ_CHUNKS = 4
SEQ_LEN = SEQ_CHUNKS * CHUNK_SIZE + 3
CACHED = SEQ_CHUNKS * CHUNK_SIZE
BAD = 2  # the chunk that is corrupted
SRC, DONOR_SRC, DST = 0, 20, 40  # first blocks of the requests


# --------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------

ROUND_TRIPS = [
    # (block size, chunk size, dtype): one-block and several-block chunks
    # for each block size, both dtypes across them.
    (16, 16, torch.float32),
    (16, 64, torch.bfloat16),
    (32, 32, torch.bfloat16),
    (32, 96, torch.float32),
    (128, 128, torch.float32),
    (128, 256, torch.bfloat16),
]


@pytest.mark.parametrize(
    ("block_size", "chunk_size", "dtype"),
    ROUND_TRIPS,
    ids=[f"b{b}-c{c}-{str(d)[6:]}" for b, c, d in ROUND_TRIPS],
)
def test_round_trip_is_bit_exact(
    make_cache: CacheFactory, block_size: int, chunk_size: int, dtype: torch.dtype
):
    """Saved, looked up and loaded into other blocks, bit for bit, through
    loads of several read segments (a buffer holds two chunks)."""
    length = 3 * chunk_size + 1  # a partial chunk at the end
    blocks_each = -(-length // block_size)
    h = make_cache(
        dtype=dtype,
        block_size=block_size,
        chunk_size=chunk_size,
        num_kv_heads=1,
        head_size=8,
        num_blocks=2 * blocks_each + 2,
        max_num_batched_tokens=2 * chunk_size,
    )
    assert h.layout.blocks_per_chunk == chunk_size // block_size
    cached = 3 * chunk_size
    tokens = make_tokens(length)
    src = h.save_tokens(tokens, 0)
    counters = h.counters()
    assert counters["tokens_written"] == cached
    assert counters["bytes_written"] == cached // block_size * h.layout.entry_bytes
    assert len(chunk_files(h.namespace_dir)) == 3
    assert h.lookup(tokens) == (cached, cached)

    dst = h.blocks_for(blocks_each, length)
    n = cached // block_size
    before = h.kv.clone()
    assert not same_bits(before[:, dst[:n]], before[:, src[:n]])  # can fail
    assert h.load(tokens, 0, cached, dst) == cached
    h.check_loaded(before, src, dst, n)
    counters = h.counters()
    assert counters["loaded_tokens"] == cached
    assert counters["load_errors"] == counters["corrupt_chunks"] == 0
    assert counters["bytes_read"] == n * h.layout.entry_bytes


# --------------------------------------------------------------------------
# Corruption at rest
# --------------------------------------------------------------------------


def _corrupt(kind: str, h: CacheHarness, victim: list[int], donor: list[int]) -> str:
    """Damage chunk BAD of ``victim`` on disk; returns its path."""
    path = h.chunk_path(victim, BAD)
    header = 4 + 4 * len(read_header_ids(path))
    entry = h.layout.entry_bytes
    if kind == "flipped-byte":
        with open(path, "r+b") as f:
            f.seek(header + entry + entry // 3)  # the second entry's payload
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
    elif kind == "truncated":
        os.truncate(path, header + entry + entry // 2)
    elif kind == "other-prefix":
        shutil.copyfile(h.chunk_path(donor, BAD), path)
    elif kind == "forged-ids":
        # The donor's chunk under the victim's ids: vineyard takes it for
        # the victim's (its header matches), but its trailers hold the
        # donor's digests.
        ids = read_header_ids(path)
        shutil.copyfile(h.chunk_path(donor, BAD), path)
        write_header_ids(path, ids)
        assert read_header_ids(path) == ids
    else:
        raise AssertionError(kind)
    return path


@pytest.mark.parametrize(
    "kind", ["flipped-byte", "truncated", "other-prefix", "forged-ids"]
)
def test_corruption_at_rest_never_reaches_the_kv(small_cache: CacheHarness, kind: str):
    """A damaged chunk stops the load there (short, counted), its blocks
    are not written, the bad file is removed, and a later save writes it
    again so that a load hits fully."""
    h = small_cache
    victim, donor = make_tokens(SEQ_LEN), make_tokens(SEQ_LEN)
    src = h.save_tokens(victim, SRC, "victim")
    h.save_tokens(donor, DONOR_SRC, "donor")
    path = _corrupt(kind, h, victim, donor)
    h.reset_counters()

    dst = h.blocks_for(DST, SEQ_LEN)
    good = BAD * CHUNK_SIZE
    before = h.kv.clone()
    assert h.load(victim, 0, CACHED, dst) == good
    h.check_loaded(before, src, dst, good // h.block_size)
    counters = h.counters()
    assert counters["corrupt_chunks"] == 1
    assert counters["load_errors"] == 1
    assert counters["loaded_tokens"] == good
    bad_chunk_bytes = (BAD + 1) * h.layout.blocks_per_chunk * h.layout.entry_bytes
    if kind in ("flipped-byte", "forged-ids"):
        # Vineyard itself returned the bad chunk: the trailer caught it.
        assert counters["bytes_read"] >= bad_chunk_bytes
    assert not os.path.exists(path), "the bad chunk was not removed"
    assert h.lookup(victim) == (good, good)  # lookups see it gone

    # Written again by a later save of the same prompt, then a full hit.
    h.save_tokens(victim, SRC, "victim-again")
    assert os.path.exists(path)
    assert h.lookup(victim) == (CACHED, CACHED)
    before = h.kv.clone()
    assert h.load(victim, 0, CACHED, dst) == CACHED
    h.check_loaded(before, src, dst, CACHED // h.block_size)
    assert h.counters()["corrupt_chunks"] == 1  # no new one


def test_chunks_cut_short_one_behind_another_are_all_removed(
    small_cache: CacheHarness,
) -> None:
    """A disk that fills mid-write can cut several chunks of one prefix
    short: the lookup that stops at the first removes each damaged chunk
    after it too (one it never reached would stay, as vineyard keeps a file
    it finds at a chunk's path), so one save writes them all again."""
    h = small_cache
    tokens = make_tokens(SEQ_LEN)
    src = h.save_tokens(tokens, SRC, "first")
    entry = h.layout.entry_bytes
    paths = [h.chunk_path(tokens, chunk) for chunk in (BAD, BAD + 1)]
    for path in paths:
        os.truncate(path, 4 + 4 * len(read_header_ids(path)) + entry // 2)
    h.reset_counters()

    good = BAD * CHUNK_SIZE
    assert h.lookup(tokens) == (good, good)
    assert h.counters()["corrupt_chunks"] == 2
    assert not any(os.path.exists(path) for path in paths)

    h.save_tokens(tokens, SRC, "again")
    assert h.lookup(tokens) == (CACHED, CACHED)
    dst = h.blocks_for(DST, SEQ_LEN)
    before = h.kv.clone()
    assert h.load(tokens, 0, CACHED, dst) == CACHED
    h.check_loaded(before, src, dst, CACHED // h.block_size)


# --------------------------------------------------------------------------
# Hash collisions leave others' files alone
# --------------------------------------------------------------------------


def _collide(prefixes: list[list[int]], same_ids: bool = False) -> list[list[int]]:
    """Two token lists, the shorter first, whose last chunks' files share
    a path (vineyard's 32-bit MurmurHash3 of their ids) and whose ids
    differ or, ``same_ids``, are the same: a birthday search over one more
    block after ``prefixes`` (of an odd number of blocks, so that with it
    they are whole chunks). With two prefixes, one list follows each; with
    one, both follow it (the hash of its ids is then a permutation of the
    last id: only the same ids share a path). Any seeds of the prefixes
    do, in a second or two; the fixtures' seeds are ones that end early."""
    tail = make_tokens(BLOCK_SIZE - 2, seed=0)

    def tokens(k: int, i: int) -> list[int]:
        return [*prefixes[k], i % 32000, i // 32000, *tail]

    starts = [extend_digests([], p, BLOCK_SIZE) for p in prefixes]
    seen: list[dict[int, tuple[int, list[int]]]] = [{} for _ in prefixes]
    for i in itertools.count():
        for k, start in enumerate(starts):
            ids = synthetic_ids(extend_digests(list(start), tokens(k, i), BLOCK_SIZE))
            path = mmh3.hash(np.asarray(ids, np.int32).tobytes(), 0, signed=False)
            found = seen[k - 1].get(path)  # the other prefix's (its own if alone)
            if found is not None and (found[1] == ids) == same_ids:
                return sorted([tokens(k - 1, found[0]), tokens(k, i)], key=len)
            seen[k].setdefault(path, (i, ids))
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def same_size_collision() -> list[list[int]]:
    """Two one-chunk prompts (and the token vLLM computes) whose chunk
    files share a path."""
    prefixes = [make_tokens(BLOCK_SIZE, seed=s) for s in (23, 24)]
    return [t + [0] for t in _collide(prefixes)]


@pytest.fixture(scope="module")
def cross_size_collision() -> list[list[int]]:
    """A one-chunk prompt and a two-chunk one whose second chunk's file
    has the path of the first's (files of different sizes)."""
    prefixes = [make_tokens(BLOCK_SIZE, seed=31), make_tokens(3 * BLOCK_SIZE, seed=32)]
    return [t + [0] for t in _collide(prefixes)]


@pytest.fixture(scope="module")
def id_collision() -> list[list[int]]:
    """Two one-chunk prompts of the same ids (vineyard's keys): the same
    first block, then blocks whose 31-bit ids collide."""
    return [t + [0] for t in _collide([make_tokens(BLOCK_SIZE, seed=21)], True)]


def test_the_header_tells_a_collision_from_a_damaged_chunk(
    tmp_path: Path, cross_size_collision: list[list[int]]
):
    """What a file's header says decides: another prefix's whole chunk at
    its own path is theirs; a file of these ids, one cut short, one with a
    count no chunk has, or another prefix's copied to a path not its own
    is not (this prefix removes it); nothing there cannot be read."""
    files = ChunkFiles(str(tmp_path), 2, 8)
    short, long = (
        synthetic_ids(extend_digests([], t, BLOCK_SIZE)) for t in cross_size_collision
    )
    path = files.path(short)
    assert files.path(long) == path
    with pytest.raises(FileNotFoundError):
        files.holds_other_prefix(short)

    def holds_other(header: list[int], size: int) -> bool:
        data = np.asarray(header, np.int32).tobytes()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data[:size].ljust(size, b"\0"))
        return files.holds_other_prefix(short)

    whole = files.file_bytes(len(long))
    assert holds_other([len(long), *long], whole)
    assert not holds_other([len(long), *long], whole - 1)  # cut short
    assert not holds_other([len(long), *long], 10)  # cut in the header
    assert not holds_other([len(short), *short], files.file_bytes(len(short)) + 1)
    assert not holds_other([2**31 - 1, *long], whole)  # never read
    assert not holds_other([len(long), *long[:-1], long[-1] ^ 1], whole)


def _save_both(
    h: CacheHarness, mine: list[int], other: list[int], collisions: int
) -> tuple[list[int], list[int], dict[str, bytes]]:
    """Save ``mine``, then ``other``, whose save counts ``collisions`` (it
    stops before ``mine``'s chunk at their shared path: vineyard would
    delete it); returns their blocks and the bytes of ``mine``'s chunk
    files. Counters start at 0 again."""
    src = h.save_tokens(mine, SRC, "mine")
    files = {}
    for c in range(len(mine) // CHUNK_SIZE):
        with open(h.chunk_path(mine, c), "rb") as f:
            files[h.chunk_path(mine, c)] = f.read()
    h.reset_counters()
    other_src = h.save_tokens(other, DONOR_SRC, "other")
    assert h.counters()["path_collisions"] == collisions
    h.reset_counters()
    return src, other_src, files


def _owner_keeps(
    h: CacheHarness, tokens: list[int], src: list[int], files: dict[str, bytes]
) -> None:
    """``tokens``' chunk files are byte for byte as its save wrote them,
    and it hits and loads whole, bit-exact."""
    for path, content in files.items():
        with open(path, "rb") as f:
            assert f.read() == content, f"{path} was changed"
    cached = whole_chunks(len(tokens))
    assert h.lookup(tokens) == (cached, cached)
    dst = h.blocks_for(DST, len(tokens))
    before = h.kv.clone()
    assert h.load(tokens, 0, cached, dst) == cached
    h.check_loaded(before, src, dst, cached // h.block_size)


@pytest.mark.parametrize("owner", [0, 1])
def test_a_path_collision_of_same_size_files_leaves_the_owners_file(
    make_cache: CacheFactory, same_size_collision: list[list[int]], owner: int
):
    """Two prompts whose chunk files (of one size) share a path: the first
    saved keeps it, the other's save stops before it. The other's lookup
    finds a whole chunk there (lookups read no bytes); its load reads none
    of it (vineyard compares the ids) and leaves it in place, counted as a
    collision, not a corrupt chunk."""
    h = make_cache()
    mine, other = same_size_collision[owner], same_size_collision[1 - owner]
    assert h.chunk_path(mine, 0) == h.chunk_path(other, 0)
    assert h.ids(mine) != h.ids(other)
    src, _, files = _save_both(h, mine, other, collisions=1)

    assert h.lookup(other) == (CHUNK_SIZE, CHUNK_SIZE)
    _load_misses_at_a_collision(h, other)
    _owner_keeps(h, mine, src, files)


@pytest.mark.parametrize("owner", ["short", "long"])
def test_a_path_collision_across_lengths_leaves_the_owners_file(
    make_cache: CacheFactory, cross_size_collision: list[list[int]], owner: str
):
    """A one-chunk prompt whose chunk file has the path of a two-chunk
    prompt's second chunk: to the other prompt that file has the wrong
    size, yet it is no damaged chunk of its own (its header names a prefix
    of that path), so its lookup stops there and leaves it, counted as a
    collision; it loads only the chunks before (and its save stopped
    there)."""
    h = make_cache()
    short, long = cross_size_collision
    assert h.chunk_path(short, 0) == h.chunk_path(long, 1)
    mine, other = (short, long) if owner == "short" else (long, short)
    src, other_src, files = _save_both(h, mine, other, collisions=1)

    cached = CHUNK_SIZE if other is long else 0  # its chunk before the path
    assert h.lookup(other) == (cached, cached)
    dst = h.blocks_for(DST, len(other))
    before = h.kv.clone()
    assert h.load(other, 0, 2 * CHUNK_SIZE, dst) == cached
    h.check_loaded(before, other_src, dst, cached // h.block_size)
    counters = h.counters()
    assert counters["path_collisions"] == 1
    assert counters["corrupt_chunks"] == 0
    _owner_keeps(h, mine, src, files)


def _load_misses_at_a_collision(h: CacheHarness, other: list[int]) -> dict[str, int]:
    """``other``'s load of its first chunk, whose file is another prompt's:
    nothing is loaded, one collision is counted and no corrupt chunk."""
    before = h.kv.clone()
    assert h.load(other, 0, CHUNK_SIZE, h.blocks_for(DST, len(other))) == 0
    assert same_bits(h.kv, before)
    counters = h.counters()
    assert counters["path_collisions"] == 1
    assert counters["corrupt_chunks"] == 0
    return counters


def test_an_id_collision_leaves_the_owners_file(
    make_cache: CacheFactory, id_collision: list[list[int]]
):
    """Two prompts of the same ids (so one chunk file): vineyard reads the
    owner's chunk for the other; its second block fails verification for
    the other, but verifies under the digest its trailer names (a valid
    block of another prefix with this id): left in place, counted as a
    collision, not a corrupt chunk. (The other's save found its ids there,
    so vineyard kept the file as its own.)"""
    h = make_cache()
    mine, other = id_collision
    assert h.ids(mine) == h.ids(other)
    assert h.digests(mine)[1] != h.digests(other)[1]
    src, _, files = _save_both(h, mine, other, collisions=0)

    assert h.lookup(other) == (CHUNK_SIZE, CHUNK_SIZE)
    counters = _load_misses_at_a_collision(h, other)
    assert counters["bytes_read"] > 0  # vineyard did hand the chunk over
    _owner_keeps(h, mine, src, files)


# --------------------------------------------------------------------------
# Lookups read no KV
# --------------------------------------------------------------------------


@pytest.fixture
def opened_paths() -> Iterator[list[str]]:
    """Paths opened by this process (audit events) while recording."""
    recording: list[str] = []
    active = [True]

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if active[0] and event == "open" and args and isinstance(args[0], str):
            recording.append(args[0])

    sys.addaudithook(hook)  # cannot be removed: deactivated at teardown
    yield recording
    active[0] = False


def test_lookups_read_no_kv(make_cache: CacheFactory, opened_paths: list[str]):
    """Lookups of hits and misses, over two TP ranks' namespaces, open no
    file and make no backend read a byte; they answer the whole chunks that
    every rank holds (the minimum). A load then does read: the counter can
    fail."""
    ranks = [make_cache(tp_size=2, tp_rank=r, seed=r) for r in range(2)]
    assert ranks[0].namespace_dir != ranks[1].namespace_dir
    config = ranks[0].config
    lookups = VineyardCacheLookup(config, [r.layout for r in ranks])
    tokens, missing = make_tokens(SEQ_LEN), make_tokens(SEQ_LEN)
    ranks[0].save_tokens(tokens[: 4 * CHUNK_SIZE + 1], SRC)
    ranks[1].save_tokens(tokens[: 2 * CHUNK_SIZE + 1], SRC)
    for r in ranks:
        r.reader_stats()
        r.reset_counters()

    def lookup(t: list[int], num_local: int = 0) -> tuple[int, int]:
        digests = extend_digests([], t, ranks[0].block_size)
        return lookups.lookup(digests, num_local, len(t))

    opened_paths.clear()
    assert lookup(tokens) == (2 * CHUNK_SIZE, 2 * CHUNK_SIZE)  # the minimum
    assert lookup(tokens, CHUNK_SIZE) == (CHUNK_SIZE, 2 * CHUNK_SIZE)
    assert lookup(missing) == (0, 0)
    for r in ranks:  # each rank alone
        assert r.lookup(missing) == (0, 0)
    assert ranks[0].lookup(tokens) == (CACHED, CACHED)
    assert ranks[1].lookup(tokens) == (2 * CHUNK_SIZE, 2 * CHUNK_SIZE)
    root = os.path.realpath(config.root)
    assert not [p for p in opened_paths if os.path.realpath(p).startswith(root)]
    for r in ranks:
        r.reader_stats()
        counters = r.counters()
        assert counters["bytes_read"] == 0
        assert counters["loaded_tokens"] == 0

    h = ranks[0]
    dst = h.blocks_for(DST, SEQ_LEN)
    assert h.load(tokens, 0, CACHED, dst) == CACHED
    assert h.counters()["bytes_read"] == CACHED // h.block_size * h.layout.entry_bytes


# --------------------------------------------------------------------------
# Keys, namespaces and modes
# --------------------------------------------------------------------------


@pytest.fixture
def key_files(tmp_path: Path) -> dict[str, str]:
    keys = {}
    for name, secret in (("k1", "the first shared secret"), ("k2", "another secret!!")):
        path = tmp_path / f"{name}.key"
        path.write_text(secret + "\n")
        keys[name] = str(path)
    return keys


def _plant(source: CacheHarness, target: CacheHarness) -> int:
    """Copy every chunk file of ``source``'s namespace to the same place in
    ``target``'s (chunk paths depend on the ids only); returns how many."""
    files = chunk_files(source.namespace_dir)
    for path in files:
        dest = os.path.join(
            target.namespace_dir, os.path.relpath(path, source.namespace_dir)
        )
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copyfile(path, dest)
    return len(files)


def test_keyed_caches_load_only_chunks_sealed_with_their_key(
    make_cache: CacheFactory, key_files: dict[str, str]
):
    """Chunks written without the key, or with another key, planted in a
    keyed namespace, are never loaded (a short load, counted, the file
    removed); caches with the same key share hits; caches with different
    keys on one root keep apart and each keeps hitting its own."""
    k1 = make_cache(auth_key_file=key_files["k1"], seed=1)
    k1_twin = make_cache(auth_key_file=key_files["k1"], seed=2)
    k2 = make_cache(auth_key_file=key_files["k2"], seed=3)
    plain = make_cache(seed=4)
    assert k1.namespace_dir == k1_twin.namespace_dir
    assert len({k1.namespace_dir, k2.namespace_dir, plain.namespace_dir}) == 3
    assert k1.namespace_dir.endswith("-" + k1.layout.key_id)
    assert plain.namespace_dir.endswith("-nokey")

    # The same key: one namespace, shared hits, bit for bit.
    tokens = make_tokens(SEQ_LEN)
    src = k1.save_tokens(tokens, SRC)
    assert k1_twin.lookup(tokens) == (CACHED, CACHED)
    dst = k1_twin.blocks_for(DST, SEQ_LEN)
    assert k1_twin.load(tokens, 0, CACHED, dst) == CACHED
    n = CACHED // k1.block_size
    assert same_bits(k1_twin.kv[:, dst[:n]], k1.kv[:, src[:n]])

    # Different keys on one root: each writes and hits its own bytes.
    src2 = k2.save_tokens(tokens, SRC)
    for h, s in ((k1, src), (k2, src2)):
        before = h.kv.clone()
        assert h.load(tokens, 0, CACHED, h.blocks_for(DST, SEQ_LEN)) == CACHED
        h.check_loaded(before, s, h.blocks_for(DST, SEQ_LEN), n)
        assert h.counters()["corrupt_chunks"] == 0

    # Forged: another key's chunks, and unkeyed ones, planted under k1.
    for writer in (k2, plain):
        other = make_tokens(SEQ_LEN)
        writer.save_tokens(other, SRC, "planted")
        assert _plant(writer, k1) >= SEQ_CHUNKS
        assert k1.lookup(other) == (CACHED, CACHED)  # the files are there
        k1.reset_counters()
        before = k1.kv.clone()
        assert k1.load(other, 0, CACHED, k1.blocks_for(DST, SEQ_LEN)) == 0
        assert same_bits(k1.kv, before), "planted KV was loaded"
        counters = k1.counters()
        # Each segment read at once stops at its first chunk.
        assert counters["corrupt_chunks"] == k1.reads_at_once(0, CACHED)
        assert counters["load_errors"] == 1
        assert not os.path.exists(k1.chunk_path(other, 0))
    # k1's own chunks still hit.
    assert k1.lookup(tokens) == (CACHED, CACHED)


@pytest.mark.parametrize("keyed", [True, False], ids=["key", "no-key"])
@pytest.mark.parametrize("other", ["model", "tp-rank"])
def test_chunks_copied_across_namespaces_are_never_loaded(
    make_cache: CacheFactory, key_files: dict[str, str], keyed: bool, other: str
):
    """Another model of the same shapes (or another TP rank of the same
    model) on the same root, with the same key: its chunk files copied into
    this namespace (which needs write access to the root, not the key) are
    there by ``stat``, but fail verification here: nothing of them is
    loaded, the bad chunk is counted and removed."""
    key = {"auth_key_file": key_files["k1"]} if keyed else {}
    mine = make_cache(seed=1, **key)
    theirs = (
        make_cache(model="other-model", seed=2, **key)
        if other == "model"
        else make_cache(tp_size=2, tp_rank=1, seed=2, **key)
    )
    assert mine.namespace_dir != theirs.namespace_dir
    tokens = make_tokens(SEQ_LEN)
    theirs.save_tokens(tokens, SRC)
    assert _plant(theirs, mine) >= SEQ_CHUNKS
    assert mine.lookup(tokens) == (CACHED, CACHED)  # the files are there
    before = mine.kv.clone()
    assert mine.load(tokens, 0, CACHED, mine.blocks_for(DST, SEQ_LEN)) == 0
    assert same_bits(mine.kv, before), "another namespace's KV was loaded"
    assert mine.counters()["corrupt_chunks"] == mine.reads_at_once(0, CACHED)
    assert not os.path.exists(mine.chunk_path(tokens, 0))


@pytest.mark.parametrize("key", [None, b"k" * 32], ids=["no-key", "key"])
def test_the_seal_binds_the_namespace(key: bytes | None) -> None:
    entry = bytearray(256 + TRAILER_BYTES)
    entry[:256] = bytes(range(256))
    digest = bytes(range(16))
    Sealer(key, "namespace-a").seal(memoryview(entry), digest)
    assert Sealer(key, "namespace-a").verify(memoryview(entry), digest)
    assert not Sealer(key, "namespace-b").verify(memoryview(entry), digest)


@pytest.mark.parametrize(
    "field,value",
    [
        ("kv_cache_dtype", "fp8_e4m3"),
        ("kv_cache_dtype", "fp8_e5m2"),
        ("weights", "sha256:another-checkpoint"),
        ("hf_overrides", '{"rope_scaling": {"factor": 2.0}}'),
    ],
)
def test_what_changes_kv_bytes_changes_the_namespace(
    small_cache: CacheHarness, field: str, value: str
) -> None:
    """Same shapes, different bytes: fp8 variants (all stored as uint8),
    other weights at the same path, config overrides."""
    layout = small_cache.layout
    changed: Any = {field: value}
    assert dataclasses.replace(layout, **changed).namespace != layout.namespace


def _modes(root: str) -> tuple[set[int], set[int]]:
    """The permission bits of the files and of the directories under (and
    including) ``root``."""
    files: set[int] = set()
    dirs = {stat.S_IMODE(os.stat(root).st_mode)}
    for dirpath, dirnames, filenames in os.walk(root):
        dirs.update(
            stat.S_IMODE(os.stat(os.path.join(dirpath, d)).st_mode) for d in dirnames
        )
        files.update(
            stat.S_IMODE(os.stat(os.path.join(dirpath, f)).st_mode) for f in filenames
        )
    return files, dirs


def test_files_are_owner_only_by_default(small_cache: CacheHarness):
    small_cache.save_tokens(make_tokens(SEQ_LEN), SRC)
    files, dirs = _modes(small_cache.namespace_dir)
    assert files == {0o600}
    assert dirs == {0o700}


def test_group_access_makes_files_group_readable(make_cache: CacheFactory):
    h = make_cache(group_access=True)
    h.save_tokens(make_tokens(SEQ_LEN), SRC)
    files, dirs = _modes(h.namespace_dir)
    # What umask 007 gives: the owner's bits for the group, none for others.
    assert files and all(m & 0o060 == 0o060 and m & 0o007 == 0 for m in files)
    assert dirs == {0o770}


# --------------------------------------------------------------------------
# Formats, chunk sizes and salts never mix
# --------------------------------------------------------------------------


def test_v1_namespace_on_the_same_root_is_never_read(small_cache: CacheHarness):
    """An old-format (v1) namespace directory on the root, here even
    holding files at the very paths that v2 computes, is never looked at:
    v2 namespaces are named apart (version and chunk size in the name)."""
    h = small_cache
    name = os.path.basename(h.namespace_dir)
    assert name.startswith(f"v{FORMAT_VERSION}-")
    assert f"-c{CHUNK_SIZE}-" in name
    v1_dir = os.path.join(h.config.root, "test-model-0123456789abcdef-tp1r0")
    tokens = make_tokens(SEQ_LEN)
    h.save_tokens(tokens, SRC)
    for path in chunk_files(h.namespace_dir):
        dest = os.path.join(v1_dir, os.path.relpath(path, h.namespace_dir))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.replace(path, dest)  # moved: only the v1 dir has them now
    assert not chunk_files(h.namespace_dir)
    assert h.lookup(tokens) == (0, 0)
    before = h.kv.clone()
    assert h.load(tokens, 0, CACHED, h.blocks_for(DST, SEQ_LEN)) == 0
    assert same_bits(h.kv, before)
    assert h.counters()["corrupt_chunks"] == 0  # not even looked at


def test_chunk_sizes_on_one_root_never_load_each_others_chunks(
    small_cache: CacheHarness, make_cache: CacheFactory
):
    """Chunk files of one chunk size sit at the paths that another chunk
    size would compute for other chunks (a 64-token chunk's path is the
    32-token cache's second chunk's); namespaces keep them apart."""
    h32 = small_cache
    h64 = make_cache(root=Path(h32.config.root), chunk_size=2 * CHUNK_SIZE, seed=7)
    assert (
        h64.namespace_dir != h32.namespace_dir
        and f"-c{2 * CHUNK_SIZE}-" in h64.namespace_dir
    )
    tokens = make_tokens(SEQ_LEN)
    h64.save_tokens(tokens, SRC)
    assert h32.lookup(tokens) == (0, 0)
    before = h32.kv.clone()
    assert h32.load(tokens, 0, CACHED, h32.blocks_for(DST, SEQ_LEN)) == 0
    assert same_bits(h32.kv, before)
    # Each keeps its own.
    src = h32.save_tokens(tokens, SRC)
    assert h32.load(tokens, 0, CACHED, h32.blocks_for(DST, SEQ_LEN)) == CACHED
    n = CACHED // h32.block_size
    assert same_bits(h32.kv[:, h32.blocks_for(DST, SEQ_LEN)[:n]], h32.kv[:, src[:n]])
    assert h64.lookup(tokens) == (CACHED, CACHED)


def test_salts_name_different_blocks_from_the_first_on() -> None:
    tokens = make_tokens(5 * 16)
    plain = extend_digests([], tokens, 16)
    a = extend_digests([], tokens, 16, "tenant-a")
    a_again = extend_digests([], tokens, 16, "tenant-a")
    b = extend_digests([], tokens, 16, "tenant-b")
    empty = extend_digests([], tokens, 16, "")
    assert a == a_again
    for other in (plain, b, empty):
        assert all(x != y for x, y in zip(a, other, strict=True))
    assert all(x != y for x, y in zip(plain, empty, strict=True))
    assert synthetic_ids(a) == synthetic_ids(a_again)
    assert synthetic_ids(a)[0] != synthetic_ids(b)[0]
    # Incremental extension gives the same chain.
    grown = extend_digests([], tokens[:32], 16, "tenant-a")
    assert extend_digests(grown, tokens, 16, "tenant-a") == a


def test_salted_requests_share_kv_only_with_the_same_salt(
    small_cache: CacheHarness,
):
    h = small_cache
    tokens = make_tokens(SEQ_LEN)
    try:
        h.salt = "tenant-a"
        src = h.save_tokens(tokens, SRC)
        assert h.lookup(tokens) == (CACHED, CACHED)
        h.salt = "tenant-b"
        assert h.lookup(tokens) == (0, 0)
        h.salt = None
        assert h.lookup(tokens) == (0, 0)
        h.salt = "tenant-a"
        dst = h.blocks_for(DST, SEQ_LEN)
        assert h.load(tokens, 0, CACHED, dst) == CACHED
        n = CACHED // h.block_size
        assert same_bits(h.kv[:, dst[:n]], h.kv[:, src[:n]])
    finally:
        h.salt = None


def test_trailer_size_is_part_of_every_entry(small_cache: CacheHarness):
    """One vineyard entry per block of all layers: a chunk file is the
    header and ``blocks_per_chunk`` entries of payload plus trailer."""
    h = small_cache
    tokens = make_tokens(SEQ_LEN)
    h.save_tokens(tokens, SRC)
    layout = h.layout
    assert layout.entry_bytes == layout.num_layers * layout.block_bytes + TRAILER_BYTES
    for c in range(SEQ_CHUNKS):
        path = h.chunk_path(tokens, c)
        ids = read_header_ids(path)
        assert ids == h.ids(tokens)[: (c + 1) * layout.blocks_per_chunk]
        assert os.path.getsize(path) == h.cache.files.file_bytes(len(ids))


def test_warnings_that_every_chunk_could_trigger_are_rate_limited() -> None:
    """A failing disk or a damaged root must not flood the log: one warning
    per kind and interval, then the count of the ones left out."""
    logged: list[str] = []

    class Recorder:
        def warning(self, msg: str, *args: object) -> None:
            logged.append(msg % args)

    log = LogLimiter(Recorder(), interval_s=3600.0)
    for i in range(100):
        log.warning("corrupt", "chunk %d is bad", i)
    log.warning("unreadable", "chunk %d is unreadable", 0)
    assert logged == ["chunk 0 is bad", "chunk 0 is unreadable"]
    log._last["corrupt"] -= 3600.0  # an interval later
    log.warning("corrupt", "chunk %d is bad", 100)
    assert logged[-1] == "chunk 100 is bad (99 more like it in the last minute)"


def _saved_long_ago(h: CacheHarness) -> tuple[list[int], list[str], float]:
    """A saved prompt whose chunks were last used a day ago: its tokens,
    its chunk paths and that time."""
    tokens = make_tokens(SEQ_LEN)
    h.save_tokens(tokens, SRC)
    paths = [h.chunk_path(tokens, c) for c in range(SEQ_CHUNKS)]
    long_ago = time.time() - 86400
    for path in paths:
        os.utime(path, (long_ago, long_ago))
    return tokens, paths, long_ago


def test_a_hit_marks_the_whole_prefix_used(make_cache: CacheFactory) -> None:
    """LRU by use, whoever served it: a load of chunks 2-3 whose chunks 0-1
    vLLM's own prefix cache served marks all four used, so a hot shared
    prefix is not evicted for being served locally."""
    h = make_cache()
    tokens, paths, long_ago = _saved_long_ago(h)
    start = 2 * CHUNK_SIZE
    dst = h.blocks_for(DST, SEQ_LEN)
    assert h.load(tokens, start, CACHED, dst) == CACHED
    assert all(os.stat(p).st_mtime > long_ago + 3600 for p in paths)


def test_an_idle_reader_marks_a_hit_used(make_cache: CacheFactory) -> None:
    """The reader marks a hit's chunks after answering it, once no request
    waits: no later request is needed (a load as the engine makes it)."""
    h = make_cache()
    tokens, paths, long_ago = _saved_long_ago(h)
    loads = h.cache.loads
    loads.start("hit", h.digests(tokens), 0, CACHED, h.blocks_for(DST, SEQ_LEN))
    loads.poll(wait=True)
    assert [r[:2] for r in loads.take_finished()] == [("hit", CACHED)]

    def marked() -> bool:
        return all(os.stat(p).st_mtime > long_ago + 3600 for p in paths)

    assert wait_until(marked, 10.0)


def test_pending_touches_wait_for_a_run_at_most_their_delay(tmp_path: Path) -> None:
    """Marks wait until run (an idle reader, or a request other than a
    read), or until they are overdue; a run marks each once."""
    files = ChunkFiles(str(tmp_path), 1, 16, False)
    ids = [[11, 12, 13], [21, 22]]
    long_ago = time.time() - 86400
    paths = []
    for seq in ids:
        for end in range(1, len(seq) + 1):
            path = Path(files.path(seq[:end]))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"x")
            os.utime(path, (long_ago, long_ago))
            paths.append(path)
    touches = PendingTouches(files, max_delay_s=1.0)
    assert not touches and not touches.due(100.0)
    touches.add(ids[0], 1, 2, now=100.0)  # chunks 1-2 of the first
    touches.add(ids[1], 0, 0, now=100.5)  # nothing
    touches.add(ids[1], 0, 2, now=100.7)
    assert touches and not touches.due(100.9) and touches.due(101.0)
    assert all(p.stat().st_mtime == long_ago for p in paths)
    touches.run()
    assert not touches and not touches.due(200.0)
    marked = [p.stat().st_mtime > long_ago + 3600 for p in paths]
    assert marked == [False, True, True, True, True]
