# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A cache root's namespaces: the names of their directories
(:func:`parse_namespace_name`) and their manifests (:func:`write_manifest`,
:func:`load_manifest`).

A namespace directory holds:

- ``layout.json``, its manifest: the layout its chunks were written with,
  so that tools read them without the model;
- chunk files at ``aa/bb/cc/dd`` (vineyard's path of the chunk's ids, see
  :mod:`~vllm.worker.vineyard.storage.chunks`); empty ones are vineyard's
  placeholders;
- ``__temp``, where vineyard writes a chunk before renaming it into place.

Imports neither vLLM nor torch (the sweeper runs in the backend process).
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass, fields
from typing import Any

from vllm.worker.vineyard.storage.digests import FORMAT_VERSION
from vllm.worker.vineyard.storage.file_modes import OWNER_ONLY, FileModes
from vllm.worker.vineyard.storage.layout import KVCacheLayout
from vllm.worker.vineyard.storage.safe_io import read_json, write_json
from vllm.worker.vineyard.storage.sealing import TRAILER_BYTES

logger = logging.getLogger(__name__)

MANIFEST = "layout.json"
TEMP_DIR = "__temp"  # vineyard's, in every namespace directory
#: Largest manifest read (a real one is well under 1 KiB).
MAX_MANIFEST_BYTES = 1 << 16

_MANIFEST_TEMP = re.compile(re.escape(MANIFEST) + r"\.[A-Za-z0-9_]+\.tmp")
_NAMESPACE = re.compile(
    r"v(?P<format>[0-9]+)-(?P<model>[A-Za-z0-9._-]{0,48})-[0-9a-f]{16}"
    r"-c(?P<chunk>[0-9]+)-tp(?P<tp_size>[0-9]+)r(?P<tp_rank>[0-9]+)"
    r"-(?P<key>nokey|[0-9a-f]{12})"
)
# Format 1 (no trailers, no manifest): never read any more, still swept.
_LEGACY_NAMESPACE = re.compile(
    r"(?P<model>[A-Za-z0-9._-]{0,48})-[0-9a-f]{16}"
    r"-tp(?P<tp_size>[0-9]+)r(?P<tp_rank>[0-9]+)"
)


@dataclass(frozen=True)
class NamespaceName:
    """What a namespace directory's name tells (see ``KVCacheLayout``)."""

    format_version: int  # 1: the old format, before names were versioned
    model: str  # the model's base name, as the directory has it
    chunk_size: int | None  # tokens (not in format 1 names)
    tp_size: int
    tp_rank: int
    key_id: str | None  # which auth key seals the chunks (None: format 1)

    @property
    def legacy(self) -> bool:
        return self.format_version < 2


def parse_namespace_name(name: str) -> NamespaceName | None:
    """The parts of a namespace directory's name, or ``None`` if ``name``
    is not one."""
    m = _NAMESPACE.fullmatch(name)
    if m is not None:
        return NamespaceName(
            int(m["format"]),
            m["model"],
            int(m["chunk"]),
            int(m["tp_size"]),
            int(m["tp_rank"]),
            m["key"],
        )
    m = _LEGACY_NAMESPACE.fullmatch(name)
    if m is not None:
        return NamespaceName(
            1, m["model"], None, int(m["tp_size"]), int(m["tp_rank"]), None
        )
    return None


def is_namespace_name(name: str) -> bool:
    """Whether ``name`` is a namespace directory's name (any format)."""
    return parse_namespace_name(name) is not None


def is_manifest_temp(name: str) -> bool:
    """Whether ``name``, in a namespace directory, is a manifest being
    written (or left half written by a writer that died)."""
    return _MANIFEST_TEMP.fullmatch(name) is not None


@dataclass(frozen=True)
class Manifest:
    """A namespace's ``layout.json``: the layout's fields, and what a tool
    needs to read its chunk files."""

    layout: dict[str, Any]  # the fields of ``KVCacheLayout``
    format_version: int
    namespace: str  # the directory it was written for
    blocks_per_chunk: int
    entry_bytes: int
    created_at: float


def _manifest_doc(layout: KVCacheLayout) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "namespace": layout.namespace,
        "layout": {f.name: getattr(layout, f.name) for f in fields(layout)},
        # Derived, so that tools need not know how to derive them.
        "blocks_per_chunk": layout.blocks_per_chunk,
        "entry_bytes": layout.entry_bytes,
    }


def write_manifest(
    namespace_dir: str, layout: KVCacheLayout, modes: FileModes = OWNER_ONLY
) -> bool:
    """Write ``namespace_dir/layout.json`` for ``layout``, atomically (a
    temporary file renamed into place); a manifest that already says the
    same is left as it is (so its ``created_at`` stays). Never raises on a
    filesystem error: logs a warning and returns False (the cache works
    without a manifest; tools then show its layout as unknown)."""
    doc = _manifest_doc(layout)
    path = os.path.join(namespace_dir, MANIFEST)
    try:
        existing = _read_manifest_doc(path)
        if existing is not None and all(existing.get(k) == v for k, v in doc.items()):
            return True
        os.makedirs(namespace_dir, exist_ok=True)
        doc["created_at"] = time.time()
        write_json(namespace_dir, MANIFEST, doc, modes)
    except OSError as e:
        logger.warning(
            "vineyard cache: cannot write the manifest %s (%s); the cache "
            "works without it, tools show this namespace's layout as unknown",
            path,
            e,
        )
        return False
    return True


def _read_manifest_doc(path: str, dir_fd: int | None = None) -> dict[str, Any] | None:
    """The manifest's JSON, or ``None`` if absent, not a regular file, too
    large or not a JSON object (never follows a link)."""
    try:
        return read_json(path, MAX_MANIFEST_BYTES, dir_fd)
    except (OSError, ValueError):
        return None


def _parse_manifest(doc: dict[str, Any] | None, name: str) -> Manifest | None:
    """A manifest that is whole, consistent and written for the namespace
    directory ``name`` (a copied or planted one is ignored)."""
    if doc is None:
        return None
    try:
        layout = doc["layout"]
        bpc, entry_bytes = int(doc["blocks_per_chunk"]), int(doc["entry_bytes"])
        if (
            not isinstance(layout, dict)
            or doc["namespace"] != name
            or bpc < 1
            or bpc * int(layout["block_size"]) != int(layout["chunk_size"])
            or entry_bytes
            != int(layout["num_layers"]) * int(layout["block_bytes"]) + TRAILER_BYTES
        ):
            return None
        return Manifest(
            dict(layout),
            int(doc["format_version"]),
            name,
            bpc,
            entry_bytes,
            float(doc.get("created_at", 0.0)),
        )
    except (KeyError, TypeError, ValueError):
        return None


def load_manifest(namespace_dir: str, dir_fd: int | None = None) -> Manifest | None:
    """The namespace's manifest, or ``None`` (absent or not valid); no vLLM
    import (for the sweeper and tools). With ``dir_fd``, the namespace
    directory open (a scan's), ``namespace_dir`` only names it."""
    name = os.path.basename(os.path.normpath(namespace_dir))
    path = MANIFEST if dir_fd is not None else os.path.join(namespace_dir, MANIFEST)
    return _parse_manifest(_read_manifest_doc(path, dir_fd), name)
