# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A cache root that others could turn against its user is refused at
startup, with an error naming ``VINEYARD_CACHE_ROOT`` and saying why; a
root reached through a symlink works (it is resolved once).

Cases that need another user's files (a root or a folder above it owned by
someone else) run where the tests run as root (CI does) and skip elsewhere.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from tests.worker.vineyard_cache_testing import CacheFactory, make_tokens
from vllm.worker.vineyard.storage.digests import key_id, load_auth_key
from vllm.worker.vineyard.storage.file_modes import GROUP_SHARED, OWNER_ONLY, file_modes
from vllm.worker.vineyard.storage.root import check_root

SETTING = "VINEYARD_CACHE_ROOT"
OTHER_UID = 4242
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")


def private_dir(path: Path, mode: int = 0o700) -> Path:
    path.mkdir(parents=True)
    path.chmod(mode)
    return path


def test_a_private_root_is_created_and_resolved(tmp_path: Path) -> None:
    base = private_dir(tmp_path / "base")
    root = base / "cache"
    assert check_root(str(root), OWNER_ONLY, SETTING) == str(root)
    assert root.is_dir() and root.stat().st_mode & 0o777 == 0o700
    link = base / "link"
    link.symlink_to(root)
    assert check_root(str(link), OWNER_ONLY, SETTING) == str(root)


@pytest.mark.parametrize(
    ("mode", "group_access", "why"),
    [
        (0o777, False, "writable by others"),
        (0o777, True, "writable by others"),
        (0o770, False, "writable by its group"),
    ],
)
def test_a_root_writable_by_others_is_refused(
    tmp_path: Path, mode: int, group_access: bool, why: str
) -> None:
    root = private_dir(tmp_path / "base") / "cache"
    root.mkdir()
    root.chmod(mode)
    with pytest.raises(ValueError, match=f"{SETTING}=.*{why}"):
        check_root(str(root), file_modes(group_access), SETTING)


def test_a_group_root_with_group_access_is_accepted(tmp_path: Path) -> None:
    root = private_dir(tmp_path / "base") / "cache"
    root.mkdir()
    root.chmod(0o770)
    assert check_root(str(root), GROUP_SHARED, SETTING) == str(root)


def test_a_folder_above_writable_by_anyone_is_refused_unless_sticky(
    tmp_path: Path,
) -> None:
    open_dir = private_dir(tmp_path / "open", 0o777)
    with pytest.raises(ValueError, match=f"{SETTING}=.*writable by others.*sticky"):
        check_root(str(open_dir / "cache"), OWNER_ONLY, SETTING)
    open_dir.chmod(0o1777)  # as /tmp
    assert check_root(str(open_dir / "cache"), OWNER_ONLY, SETTING)


@as_root
@pytest.mark.parametrize("whose", ["root", "parent"])
def test_another_users_root_or_parent_is_refused(tmp_path: Path, whose: str) -> None:
    parent = private_dir(tmp_path / "parent", 0o755)
    root = private_dir(parent / "cache")
    os.chown(root if whose == "root" else parent, OTHER_UID, OTHER_UID)
    with pytest.raises(ValueError, match=f"{SETTING}=.*uid {OTHER_UID}"):
        check_root(str(root), OWNER_ONLY, SETTING)


def test_a_cache_on_an_unsafe_root_does_not_start(
    make_cache: CacheFactory, tmp_path: Path
) -> None:
    root = private_dir(tmp_path / "base") / "cache"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(ValueError, match="ROOT=.*writable by others"):
        make_cache(root=root)


def test_a_cache_through_a_symlinked_root_works(
    make_cache: CacheFactory, tmp_path: Path
) -> None:
    real = private_dir(tmp_path / "real")
    link = tmp_path / "link"
    link.symlink_to(real)
    h = make_cache(root=link)
    assert h.cache.files.namespace_dir.startswith(str(real) + os.sep)
    tokens = make_tokens(3 * h.chunk_size + 1)
    h.save_tokens(tokens, 0)
    assert h.lookup(tokens)[0] == 3 * h.chunk_size


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_load_never_opens_what_is_not_a_regular_file(
    make_cache: CacheFactory, tmp_path: Path, kind: str
) -> None:
    """A chunk file swapped for a FIFO (whose open would block) or for a
    link (even to the chunk's own bytes) between the lookup and the load:
    the load stops before it at once, counted, and nothing is opened."""
    h = make_cache(backend_timeout_s=30.0)
    tokens = make_tokens(4 * h.chunk_size + 1)
    src = h.save_tokens(tokens, 0)
    path = h.chunk_path(tokens, 2)
    os.rename(path, tmp_path / "moved")
    if kind == "fifo":
        os.mkfifo(path)
    else:
        os.symlink(tmp_path / "moved", path)
    dst = h.blocks_for(40, len(tokens))
    before = h.kv.clone()
    started = time.monotonic()
    loaded = h.load(tokens, 0, 4 * h.chunk_size, dst)
    assert time.monotonic() - started < 10.0  # far below the 30 s timeout
    assert loaded == 2 * h.chunk_size
    n = loaded // h.block_size
    h.check_loaded(before, src, dst, n)
    assert h.counters()["corrupt_chunks"] == 1


@pytest.mark.parametrize("kind", ["fifo", "dangling-link"])
def test_a_write_never_opens_what_is_not_a_regular_file(
    make_cache: CacheFactory, tmp_path: Path, kind: str
) -> None:
    """A FIFO (whose open would block the writer) or a dangling link (which
    vineyard would follow, creating a file outside the root) where a chunk
    is about to be written: it is removed (counted), never opened, and the
    chunk is written in its place."""
    h = make_cache(backend_timeout_s=30.0)
    tokens = make_tokens(3 * h.chunk_size + 1)
    path = h.chunk_path(tokens, 1)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    target = tmp_path / "outside" / "planted"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        target.parent.mkdir()
        os.symlink(target, path)
    started = time.monotonic()
    h.save_tokens(tokens, 0)
    assert time.monotonic() - started < 10.0  # far below the 30 s timeout
    assert os.path.isfile(path) and not os.path.islink(path)
    assert not target.exists()
    counters = h.counters()
    assert counters["corrupt_chunks"] == 1
    assert counters["updates_failed"] == 0
    assert h.lookup(tokens)[0] == 3 * h.chunk_size


def test_the_key_id_costs_a_memory_hard_hash_per_guess(tmp_path: Path) -> None:
    """The key id in namespace names (which anyone who lists the root sees)
    is scrypt of the key, not a fast hash: each offline guess of a weak
    secret costs scrypt's 16 MiB and tens of milliseconds."""
    (tmp_path / "a").write_bytes(b"a" * 32)
    (tmp_path / "b").write_bytes(b"b" * 32)
    a = load_auth_key(str(tmp_path / "a"))
    b = load_auth_key(str(tmp_path / "b"))
    assert a is not None and b is not None
    assert key_id(None) == "nokey"
    assert key_id(a) == key_id(a) != key_id(b)
    expected = hashlib.scrypt(
        a, salt=b"vineyard-llm-cache key id", n=1 << 14, r=8, p=1, dklen=6
    ).hex()
    assert key_id(a) == expected
    fast = hashlib.blake2b(a, digest_size=6, person=b"vineyard-id").hexdigest()
    assert key_id(a) != fast
