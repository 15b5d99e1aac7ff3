# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Removals below a cache root that others may share: each opens every
directory on the way without following links and checks that what it
removes is still what the caller found (a directory swapped for a link
meanwhile is not followed, a file replaced meanwhile stays).

Imports neither vLLM nor torch (the sweeper runs in the backend process).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Collection

from vllm.worker.vineyard.storage.safe_io import OPEN_DIR, OPEN_ROOT, release
from vllm.worker.vineyard.storage.scan import scan_root


def _remove(root: str, path: str, check: Callable[[os.stat_result], bool]) -> bool:
    """Remove ``path`` (below ``root``) if ``check`` accepts its ``lstat``,
    reaching it through directories opened without following links (a
    directory swapped for a link meanwhile is not followed)."""
    rel = os.path.relpath(path, root)
    parts = rel.split(os.sep)
    if rel.startswith(os.pardir) or os.path.isabs(rel) or rel == os.curdir:
        return False
    try:
        fd = os.open(root, OPEN_ROOT)
    except OSError:
        return False
    try:
        for part in parts[:-1]:
            sub = os.open(part, OPEN_DIR, dir_fd=fd)
            release(fd)
            fd = sub
        st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
        if not check(st):
            return False
        if stat.S_ISDIR(st.st_mode):
            os.rmdir(parts[-1], dir_fd=fd)
        else:
            os.unlink(parts[-1], dir_fd=fd)
        return True
    except OSError:
        # Gone (another sweeper or a reader's repair was first), not empty,
        # or a read-only or failing filesystem: the caller goes on.
        return False
    finally:
        release(fd)


def remove_file(root: str, path: str, ino: int | None = None) -> bool:
    """Delete the regular file ``path`` below ``root`` (only if it is still
    inode ``ino``, when given); whether it was deleted now."""
    return _remove(
        root,
        path,
        lambda st: stat.S_ISREG(st.st_mode) and (ino is None or st.st_ino == ino),
    )


def remove_dir(root: str, path: str) -> bool:
    """Remove the empty directory ``path`` below ``root``; whether it was."""
    return _remove(root, path, lambda st: stat.S_ISDIR(st.st_mode))


def remove_namespace_chunks(
    root: str, namespaces: Collection[str]
) -> tuple[list[str], int]:
    """Delete every chunk file of ``namespaces`` under ``root``; returns the
    paths deleted (below the root's real path) and how many could not be
    (other namespaces' chunks and everything not a chunk stay)."""
    root = os.path.realpath(root)
    gone: list[str] = []
    left = 0
    for chunk in scan_root(root).chunks:
        if chunk.namespace not in namespaces:
            continue
        if remove_file(root, chunk.path, chunk.ino):
            gone.append(chunk.path)
        elif os.path.lexists(chunk.path):
            left += 1
    return gone, left
