# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``evict``: remove the least recently used chunks down to a size, in the
sweeper's order and by the root's clock; only the cache's own chunks go,
and a dry run touches nothing."""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import TextIO

from vllm.worker.vineyard.cli.arguments import root_argument
from vllm.worker.vineyard.cli.output import human, print_json
from vllm.worker.vineyard.storage.eviction import distrust_future, evict_lru
from vllm.worker.vineyard.storage.removal import remove_file
from vllm.worker.vineyard.storage.root_files import root_clock
from vllm.worker.vineyard.storage.scan import ChunkFile, scan_root


def cmd_evict(args: argparse.Namespace, out: TextIO) -> int:
    root = root_argument(args.root)
    scan = scan_root(root)
    chunks = scan.chunks
    before = sum(c.disk_bytes for c in chunks)

    def remove(chunk: ChunkFile) -> bool:
        return remove_file(root, chunk.path, chunk.ino)

    def pretend(chunk: ChunkFile) -> bool:
        return True

    # The sweeper's order: least recently used first, by the root's clock
    # (a dry run writes nothing, not even the clock probe).
    now = time.time()
    if not args.dry_run:
        with contextlib.suppress(OSError):
            now = root_clock(root)
    distrust_future(chunks, now)
    done, removed, after = evict_lru(
        chunks, before, args.to, pretend if args.dry_run else remove
    )
    gone = chunks[:done]
    by_namespace: dict[str, dict[str, int]] = {}
    for c in gone:
        entry = by_namespace.setdefault(c.namespace, {"chunks": 0, "bytes": 0})
        entry["chunks"] += 1
        entry["bytes"] += c.disk_bytes
    if args.json:
        doc = {
            "root": root,
            "dry_run": bool(args.dry_run),
            "target_bytes": args.to,
            "bytes_before": before,
            "bytes_after": after,
            "evicted": done,
            "removed": removed,
            "by_namespace": by_namespace,
            "paths": [c.path for c in gone],
        }
        print_json(doc, out)
        return 0
    verb = "would evict" if args.dry_run else "evicted"
    print(
        f"{verb} {done} chunks ({human(before - after)}, least recently used "
        f"first): {human(before)} -> {human(after)} (target {human(args.to)})",
        file=out,
    )
    for name, entry in sorted(by_namespace.items()):
        print(f"  {name}: {entry['chunks']} chunks, {human(entry['bytes'])}", file=out)
    return 0
