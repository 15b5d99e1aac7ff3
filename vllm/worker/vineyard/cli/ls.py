# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``ls``: a root's namespaces, their size and last use, its settings, and
what on it is not the cache's."""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from vllm.worker.vineyard.cli.arguments import root_argument
from vllm.worker.vineyard.cli.output import human, iso, print_json, table, when
from vllm.worker.vineyard.cli.settings import (
    root_settings,
    settings_doc,
    settings_text,
)
from vllm.worker.vineyard.storage.scan import (
    Foreign,
    NamespaceScan,
    RootScan,
    scan_root,
)

_FORMATS = {None: "unknown (no manifest)", 1: "1 (old)"}


def namespace_doc(ns: NamespaceScan) -> dict[str, Any]:
    """What is known of a namespace: from its manifest, else its name."""
    m, parsed = ns.manifest, ns.parsed
    layout = m.layout if m is not None else {}
    return {
        "namespace": ns.name,
        "model": layout.get("model", parsed.model),
        "dtype": layout.get("dtype"),
        "block_size": layout.get("block_size"),
        "chunk_size": layout.get("chunk_size", parsed.chunk_size),
        "tp_size": layout.get("tp_size", parsed.tp_size),
        "tp_rank": layout.get("tp_rank", parsed.tp_rank),
        "key_id": layout.get("key_id", parsed.key_id),
        "format_version": (
            m.format_version if m is not None else 1 if parsed.legacy else None
        ),
        "manifest": m is not None,
        "layout": layout or None,
        "chunks": ns.chunks,
        "bytes": ns.bytes,
        "last_use": ns.last_use,
        "last_use_iso": iso(ns.last_use),
        "leftovers": ns.leftovers,
    }


def _foreign_doc(f: Foreign) -> dict[str, Any]:
    return {
        "path": f.path,
        "kind": f.kind,
        "reason": f.reason,
        "namespace": f.namespace,
        "at_chunk_path": f.at_chunk_path,
    }


def cmd_ls(args: argparse.Namespace, out: TextIO) -> int:
    root = root_argument(args.root)
    scan = scan_root(root)
    namespaces = [namespace_doc(ns) for _, ns in sorted(scan.namespaces.items())]
    settings, settings_error = root_settings(root)
    if args.json:
        doc = {
            "root": root,
            "settings": settings_doc(settings, settings_error),
            "namespaces": namespaces,
            "total_chunks": len(scan.chunks),
            "total_bytes": sum(c.disk_bytes for c in scan.chunks),
            "not_cache": [_foreign_doc(f) for f in scan.foreign],
            "errors": [{"path": p, "error": e} for p, e in scan.errors],
        }
        print_json(doc, out)
        return 0
    print(f"root settings: {settings_text(settings, settings_error)}", file=out)
    if not namespaces:
        print(f"no cache namespaces under {root}", file=out)
    else:
        _print_namespaces(namespaces, scan, out)
    _print_others(scan, out)
    return 0


def _print_namespaces(
    namespaces: list[dict[str, Any]], scan: RootScan, out: TextIO
) -> None:
    rows = [
        ["MODEL", "DTYPE", "BLOCK", "CHUNK", "TP", "KEY", "FORMAT"]
        + ["CHUNKS", "SIZE", "LAST USE", "NAMESPACE"]
    ]

    def text(value: Any) -> str:
        return "?" if value is None else str(value)

    for d in namespaces:
        rows.append(
            [
                text(d["model"]) or "?",
                text(d["dtype"]),
                text(d["block_size"]),
                text(d["chunk_size"]),
                f"{d['tp_size']}/{d['tp_rank']}",
                text(d["key_id"]),
                _FORMATS.get(d["format_version"], str(d["format_version"])),
                str(d["chunks"]),
                human(d["bytes"]),
                when(d["last_use"]),
                d["namespace"],
            ]
        )
    table(rows, out)
    total = sum(c.disk_bytes for c in scan.chunks)
    print(
        f"total: {len(scan.chunks)} chunks, {human(total)} in "
        f"{len(namespaces)} namespace(s)",
        file=out,
    )


def _print_others(scan: RootScan, out: TextIO) -> None:
    """What is not the cache's, and what could not be read."""
    if scan.foreign:
        print(
            f"\nnot the cache's own ({len(scan.foreign)}; never touched, not counted):",
            file=out,
        )
        for f in sorted(scan.foreign, key=lambda f: f.path):
            hint = " (run `verify`)" if f.at_chunk_path else ""
            print(f"  {f.path}  [{f.kind}] {f.reason}{hint}", file=out)
    if scan.errors:
        print(f"\nunreadable ({len(scan.errors)}):", file=out)
        for path, error in scan.errors:
            print(f"  {path}: {error}", file=out)
