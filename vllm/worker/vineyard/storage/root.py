# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The cache root itself (:func:`check_root`): resolved once, created if
missing, and refused where others could turn it against this process.

What a root holds: :mod:`~vllm.worker.vineyard.storage.namespaces` (its
namespaces and their manifests), :mod:`~vllm.worker.vineyard.storage.scan`
(the walk that tells the cache's own entries from others) and
:mod:`~vllm.worker.vineyard.storage.root_files` (the files of its upkeep).

Imports neither vLLM nor torch.
"""

from __future__ import annotations

import os
import stat

from vllm.worker.vineyard.storage.file_modes import FileModes


def check_root(root: str, modes: FileModes, setting: str) -> str:
    """Resolve a cache root once, create it if missing (with
    ``modes.dir_mode``), and refuse one that others could turn against this
    process: the root must be this user's and not writable by others (nor
    by its group unless ``modes`` share it with the group), and
    every folder above it must be this user's or root's and not writable
    by others unless sticky (as ``/tmp`` is), so nobody else can swap the
    root for their own. Returns the resolved path; raises ``ValueError``
    naming ``setting`` and saying why (``OSError`` if it cannot be made)."""
    resolved = os.path.realpath(root)
    # OSError (cannot create, e.g. a read-only filesystem) goes to the
    # caller: that is backend trouble, not a setting to refuse.
    os.makedirs(resolved, mode=modes.dir_mode, exist_ok=True)
    st = os.stat(resolved)
    me = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{setting}={root}: {resolved} is not a directory")
    if st.st_uid != me:
        raise ValueError(
            f"{setting}={root}: {resolved} belongs to uid {st.st_uid}, not to "
            f"this user (uid {me}); use a root of your own"
        )
    writable_by = modes.not_writable_by
    if st.st_mode & writable_by:
        who = "others" if st.st_mode & stat.S_IWOTH else "its group"
        raise ValueError(
            f"{setting}={root}: {resolved} is writable by {who} (mode "
            f"{stat.S_IMODE(st.st_mode):o}); make it private (chmod go-w), or "
            "set VINEYARD_CACHE_GROUP_ACCESS=1 for a root shared by a group"
        )
    parent = os.path.dirname(resolved)
    while True:
        try:
            pst = os.stat(parent)
        except OSError as e:
            raise ValueError(f"{setting}={root}: cannot check {parent}: {e}") from e
        if pst.st_uid not in (0, me):
            raise ValueError(
                f"{setting}={root}: {parent}, above the cache root, belongs to "
                f"uid {pst.st_uid}, who could replace the root"
            )
        if pst.st_mode & writable_by and not pst.st_mode & stat.S_ISVTX:
            raise ValueError(
                f"{setting}={root}: {parent}, above the cache root, is writable "
                f"by others (mode {stat.S_IMODE(pst.st_mode):o}) and not "
                "sticky: anyone could replace the root"
            )
        if parent == os.path.dirname(parent):
            return resolved
        parent = os.path.dirname(parent)
