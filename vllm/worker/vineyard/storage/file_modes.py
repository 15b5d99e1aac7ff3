# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Who may use what the cache creates (:class:`FileModes`): its owner alone,
or its group too (``VINEYARD_CACHE_GROUP_ACCESS``). One value, built once
from the setting, carries the umask of the backend processes, the mode of
the files written directly and of the folders made, and what must not be
writable on a root; others than the owner (and the group it is shared
with) never get access.

Imports neither vLLM nor torch.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass


@dataclass(frozen=True)
class FileModes:
    """The modes of what the cache creates; see :func:`file_modes`."""

    umask: int
    file_mode: int
    dir_mode: int

    @property
    def group_shared(self) -> bool:
        """Whether the group may read and write the cache's files."""
        return not self.umask & 0o060

    @property
    def not_writable_by(self) -> int:
        """The write bits a root and the folders above it must not have
        (unless sticky): everyone's but those the cache is shared with."""
        return stat.S_IWOTH | (0 if self.group_shared else stat.S_IWGRP)


#: The owner's alone (the default).
OWNER_ONLY = FileModes(umask=0o077, file_mode=0o600, dir_mode=0o700)
#: Shared with the owner's group.
GROUP_SHARED = FileModes(umask=0o007, file_mode=0o660, dir_mode=0o770)


def file_modes(group_access: bool) -> FileModes:
    """The modes for the ``group_access`` setting (share with the group)."""
    return GROUP_SHARED if group_access else OWNER_ONLY


def modes_of_root(root: str) -> FileModes:
    """The modes that instances keep ``root`` by, read from the root
    itself: instances with group access make it group-writable. Raises
    ``OSError`` when it cannot be read."""
    return file_modes(bool(os.stat(root).st_mode & stat.S_IWGRP))
