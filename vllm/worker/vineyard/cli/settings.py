# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``settings``: show or change a root's own disk limit and TTL, which
govern every instance's sweeps of it (see
:class:`~vllm.worker.vineyard.storage.root_files.RootSettings`); ``ls``
shows them too."""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from vllm.worker.vineyard.cli.arguments import UsageError, root_argument
from vllm.worker.vineyard.cli.output import print_json
from vllm.worker.vineyard.config import GiB, VineyardLLMCacheConfig
from vllm.worker.vineyard.storage.file_modes import modes_of_root
from vllm.worker.vineyard.storage.root_files import (
    RootSettings,
    read_root_settings,
    record_root_settings,
)

#: The instances' default disk limit (VINEYARD_CACHE_DISK_LIMIT_GB's),
#: for a root without settings, in bytes as the cache computes it.
DEFAULT_DISK_LIMIT = int(VineyardLLMCacheConfig.disk_limit_gb * GiB)


def root_settings(root: str) -> tuple[RootSettings | None, str | None]:
    """The root's recorded settings and, where they cannot be read, why."""
    try:
        return read_root_settings(root), None
    except (OSError, ValueError) as e:
        return None, str(e)


def settings_doc(settings: RootSettings | None, error: str | None) -> dict[str, Any]:
    return {
        "recorded": settings is not None,
        "disk_limit_bytes": settings.disk_limit_bytes if settings else None,
        "ttl_s": settings.ttl_s if settings else None,
        "error": error,
    }


def settings_text(settings: RootSettings | None, error: str | None) -> str:
    if error is not None:
        return f"unreadable ({error}); each process sweeps with its own"
    if settings is None:
        return "none recorded yet (the first instance to sweep records its own)"
    return settings.describe()


def cmd_settings(args: argparse.Namespace, out: TextIO) -> int:
    root = root_argument(args.root)
    settings, error = root_settings(root)
    changed = args.disk_limit is not None or args.ttl_s is not None
    if changed:
        # Unset parts: as recorded, else the instances' defaults.
        base = settings or RootSettings(DEFAULT_DISK_LIMIT, 0.0)
        try:
            new = RootSettings(
                base.disk_limit_bytes if args.disk_limit is None else args.disk_limit,
                base.ttl_s if args.ttl_s is None else args.ttl_s,
            )
        except ValueError as e:
            raise UsageError(str(e).replace("disk_limit_bytes", "--disk-limit")) from e
        # Group-writable only where the root is shared by a group.
        settings = record_root_settings(
            root, new, replace=True, modes=modes_of_root(root)
        )
        error = None
    if args.json:
        doc = {"root": root, "changed": changed, **settings_doc(settings, error)}
        print_json(doc, out, indent=None)
        return 0
    verb = "now" if changed else "are"
    print(
        f"the settings of {root} {verb}: {settings_text(settings, error)}; they "
        "govern every instance's sweeps of it (from their next sweep)",
        file=out,
    )
    return 0
