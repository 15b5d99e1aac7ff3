# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``purge``: delete whole namespaces (every chunk, leftover and manifest
of theirs, then their folders where empty), chosen by name or by model;
only the cache's own entries go."""

from __future__ import annotations

import argparse
import os
from typing import Any, TextIO

from vllm.worker.vineyard.cli.arguments import UsageError, root_argument
from vllm.worker.vineyard.cli.ls import namespace_doc
from vllm.worker.vineyard.cli.output import human, print_json
from vllm.worker.vineyard.storage.namespaces import is_namespace_name
from vllm.worker.vineyard.storage.removal import remove_dir, remove_file
from vllm.worker.vineyard.storage.scan import NamespaceScan, RootScan, scan_root


def _model_matches(ns: NamespaceScan, model: str) -> bool:
    """``model`` as the manifest has it (the model's path or name), or as
    the namespace's name has it (its base name)."""
    if ns.manifest is not None and ns.manifest.layout.get("model") == model:
        return True
    return ns.parsed.model == model


def _under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory + os.sep)


def cmd_purge(args: argparse.Namespace, out: TextIO) -> int:
    root = root_argument(args.root)
    if args.namespace is not None and not is_namespace_name(args.namespace):
        raise UsageError(
            f"--namespace: {args.namespace!r} is not a namespace name (`ls` shows them)"
        )
    scan = scan_root(root, all_dirs=True)
    if args.namespace is not None:
        targets = [ns for ns in scan.namespaces.values() if ns.name == args.namespace]
    else:
        targets = [
            ns for ns in scan.namespaces.values() if _model_matches(ns, args.model)
        ]
    results = [
        _purge(root, scan, ns, args.dry_run)
        for ns in sorted(targets, key=lambda t: t.name)
    ]
    if args.json:
        doc = {
            "root": root,
            "dry_run": bool(args.dry_run),
            "namespaces": results,
            "chunks": sum(r["chunks"] for r in results),
            "bytes": sum(r["bytes"] for r in results),
        }
        print_json(doc, out)
        return 0
    _print_purged(args, root, results, out)
    return 0


def _purge(
    root: str, scan: RootScan, ns: NamespaceScan, dry_run: bool
) -> dict[str, Any]:
    """Remove one namespace's entries (unless ``dry_run``): what went."""
    chunks = [c for c in scan.chunks if c.namespace == ns.name]
    leftovers = [x for x in scan.leftovers if x.namespace == ns.name]
    removed = freed = 0
    if not dry_run:
        for c in chunks:
            if remove_file(root, c.path, c.ino):
                removed += 1
                freed += c.disk_bytes
        for x in leftovers:
            remove_file(root, x.path, x.ino)
        if ns.manifest_file is not None:
            remove_file(root, ns.manifest_file)
        for d in scan.dirs:  # children first; fails where not empty
            if _under(d.path, ns.path):
                remove_dir(root, d.path)
    return {
        "namespace": ns.name,
        "model": namespace_doc(ns)["model"],
        "chunks": len(chunks) if dry_run else removed,
        "bytes": sum(c.disk_bytes for c in chunks) if dry_run else freed,
        "other_files": len(leftovers) + (ns.manifest_file is not None),
        "directory_removed": not dry_run and not os.path.lexists(ns.path),
        "left_alone": [f.path for f in scan.foreign if f.namespace == ns.name],
    }


def _print_purged(
    args: argparse.Namespace, root: str, results: list[dict[str, Any]], out: TextIO
) -> None:
    if not results:
        what = (
            f"--namespace {args.namespace!r}"
            if args.namespace is not None
            else f"--model {args.model!r}"
        )
        print(f"nothing matches {what} under {root}", file=out)
    verb = "would purge" if args.dry_run else "purged"
    for r in results:
        note = ""
        if r["left_alone"]:
            note = f"; left alone (not the cache's): {', '.join(r['left_alone'])}"
        elif r["directory_removed"]:
            note = "; directory removed"
        print(
            f"{verb} {r['namespace']} ({r['model']}): {r['chunks']} chunks, "
            f"{human(r['bytes'])}, {r['other_files']} other file(s){note}",
            file=out,
        )
