# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The cache root's on-disk format, for everything that walks a root: the
sweeper (in the writer backend) and the command-line tool.

A root holds one directory per namespace (:func:`is_namespace_name`), and a
namespace directory holds:

- ``layout.json``, its manifest (:func:`write_manifest`): the layout its
  chunks were written with, so that tools read them without the model;
- chunk files at ``aa/bb/cc/dd`` (vineyard's path of the chunk's ids), each
  an int32 count ``n``, ``n`` int32 ids, then the chunk's entries (see
  :mod:`vineyard_store`); empty ones are vineyard's placeholders;
- ``__temp``, where vineyard writes a chunk before renaming it into place.

The root itself also holds the files of its upkeep
(:mod:`vineyard_root_files`): the sweepers' lock and usage ledger, and the
root's own settings.

Everything else (files outside namespaces or of another shape, links,
devices, other filesystems mounted inside) is not the cache's own: a scan
reports it, and nothing here deletes it. Scans follow no link and cross no
filesystem; removals open every directory on the way without following
links and check that the file is still the one scanned.

Imports neither vLLM nor torch (the sweeper runs in the backend process):
only :func:`read_manifest` imports vLLM's side, when called.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from vllm.worker.vineyard.log_limiter import LogLimiter
from vllm.worker.vineyard.storage import chunks, root_files

if TYPE_CHECKING:
    from vllm.worker.vineyard.storage.layout import KVCacheLayout

logger = logging.getLogger(__name__)

MANIFEST = "layout.json"
TEMP_DIR = "__temp"  # vineyard's, in every namespace directory
#: Largest manifest read (a real one is well under 1 KiB).
MAX_MANIFEST_BYTES = 1 << 16

_HEX2 = re.compile(r"[0-9a-f]{2}")
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
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Non-blocking: a FIFO planted at a chunk path must not hang a scan.
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


# --------------------------------------------------------------------------
# Namespaces and their manifests.
# --------------------------------------------------------------------------


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
        "format_version": chunks.FORMAT_VERSION,
        "namespace": layout.namespace,
        "layout": {f.name: getattr(layout, f.name) for f in fields(layout)},
        # Derived, so that tools need not know how to derive them.
        "blocks_per_chunk": layout.blocks_per_chunk,
        "entry_bytes": layout.entry_bytes,
    }


def write_manifest(
    namespace_dir: str, layout: KVCacheLayout, group_access: bool = False
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
        fd, temp = tempfile.mkstemp(
            prefix=MANIFEST + ".", suffix=".tmp", dir=namespace_dir
        )
        try:
            with os.fdopen(fd, "w") as f:
                # As private as the chunk files (see the backend's umask).
                os.fchmod(f.fileno(), 0o660 if group_access else 0o600)
                json.dump({**doc, "created_at": time.time()}, f, indent=2)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
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
        fd = os.open(path, _OPEN_FILE, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST_BYTES:
            return None
        raw = os.read(fd, MAX_MANIFEST_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


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
            != int(layout["num_layers"]) * int(layout["block_bytes"])
            + chunks.TRAILER_BYTES
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


def load_manifest(namespace_dir: str) -> Manifest | None:
    """The namespace's manifest, or ``None`` (absent or not valid); no vLLM
    import (for the sweeper and tools)."""
    name = os.path.basename(os.path.normpath(namespace_dir))
    return _parse_manifest(
        _read_manifest_doc(os.path.join(namespace_dir, MANIFEST)), name
    )


def read_manifest(namespace_dir: str) -> KVCacheLayout | None:
    """The layout the namespace's chunks were written with, or ``None``
    (no manifest, or one that does not name this namespace)."""
    from vllm.worker.vineyard.storage.layout import KVCacheLayout

    manifest = load_manifest(namespace_dir)
    if manifest is None:
        return None
    try:
        layout = KVCacheLayout(
            **{
                f.name: manifest.layout[f.name]
                for f in fields(KVCacheLayout)
                if f.name in manifest.layout
            }
        )
    except (TypeError, ValueError):
        return None
    if layout.namespace != manifest.namespace:
        return None
    return layout


# --------------------------------------------------------------------------
# Chunk files.
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkShape:
    """What a namespace's chunk files look like: by the manifest's layout
    (a ``stat`` tells), else by each file's own header (read)."""

    blocks_per_chunk: int | None = None
    entry_bytes: int | None = None
    legacy: bool = False  # format 1: no trailers

    @classmethod
    def of(cls, name: NamespaceName, manifest: Manifest | None) -> ChunkShape:
        if manifest is not None:
            return cls(manifest.blocks_per_chunk, manifest.entry_bytes)
        return cls(legacy=name.legacy)

    def mismatch(
        self, size: int, read: Callable[[int, int], bytes] | None
    ) -> str | None:
        """Why a non-empty file of ``size`` bytes is not shaped as one of
        the namespace's chunk files (``None`` if it is); ``read(offset,
        count)`` reads it, needed only when there is no manifest."""
        if self.blocks_per_chunk is not None and self.entry_bytes is not None:
            # size == 4 + 4n + bpc * entry_bytes, n a positive multiple of
            # bpc (a chunk's ids are those of its whole prefix).
            ids_bytes = size - 4 - self.blocks_per_chunk * self.entry_bytes
            if ids_bytes > 0 and ids_bytes % (4 * self.blocks_per_chunk) == 0:
                return None
            return f"size {size} fits no chunk of this namespace's layout"
        assert read is not None, "without a manifest a chunk's header is read"
        head = read(0, 4)
        n = int.from_bytes(head, "little", signed=True) if len(head) == 4 else 0
        if n < 1 or 4 + 4 * n >= size:
            return f"its header (n={n}) does not fit its size {size}"
        if self.legacy:
            return None
        tail = size - chunks.TRAILER_BYTES
        if tail < 4 + 4 * n or read(tail, len(chunks.MAGIC_PREFIX)) != (
            chunks.MAGIC_PREFIX
        ):
            return "it does not end in an entry's trailer"
        return None


def disk_bytes(st: os.stat_result) -> int:
    """The space a file takes: whole filesystem blocks (at least its size,
    for filesystems that report blocks late)."""
    return max(st.st_size, st.st_blocks * 512)


def _read_at(fd: int) -> Callable[[int, int], bytes]:
    return lambda offset, count: os.pread(fd, count, offset)


def is_chunk_file(path: str) -> bool:
    """Whether ``path`` is one of the cache's chunk files: a non-empty
    regular file (not a link) at ``namespace/aa/bb/cc/dd`` (hex), shaped as
    its namespace's manifest says, or without one as its own header says."""
    parts = os.path.normpath(path).split(os.sep)
    if len(parts) < 5 or not all(_HEX2.fullmatch(p) for p in parts[-4:]):
        return False
    name = parse_namespace_name(parts[-5])
    if name is None:
        return False
    shape = ChunkShape.of(name, load_manifest(os.sep.join(parts[:-4]) or os.sep))
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            return False
        fd = os.open(path, _OPEN_FILE)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_ino != st.st_ino:
            return False  # replaced meanwhile
        return shape.mismatch(st.st_size, _read_at(fd)) is None
    except OSError:
        return False
    finally:
        os.close(fd)


# --------------------------------------------------------------------------
# Scans.
# --------------------------------------------------------------------------


@dataclass(slots=True)
class ChunkFile:
    path: str
    namespace: str
    mtime: float  # its last use
    disk_bytes: int
    size: int
    ino: int


@dataclass(slots=True)
class Leftover:
    """The cache's own and no chunk: a temporary file (vineyard's or a
    manifest's) or an empty placeholder; removable once old."""

    path: str
    namespace: str
    kind: str  # "temp" or "placeholder"
    mtime: float
    disk_bytes: int
    ino: int


@dataclass(slots=True)
class Foreign:
    """An entry that is not the cache's own (never deleted)."""

    path: str
    kind: str  # "file", "directory", "symlink" or "other"
    reason: str
    namespace: str | None = None
    #: A file where a chunk belongs that is not chunk-shaped (a truncated
    #: chunk, most likely): ``verify`` checks it and may remove it.
    at_chunk_path: bool = False


@dataclass(slots=True)
class DirRecord:
    """A directory of the cache's (below the root), with its mtime and
    entry count before the scan."""

    path: str
    mtime: float
    entries: int


@dataclass
class NamespaceScan:
    name: str
    path: str
    parsed: NamespaceName
    manifest: Manifest | None
    manifest_file: str | None = None  # a regular file named layout.json
    chunks: int = 0
    bytes: int = 0  # of its chunks, on disk
    last_use: float | None = None  # the newest chunk mtime
    leftovers: int = 0


@dataclass
class RootScan:
    root: str
    namespaces: dict[str, NamespaceScan] = field(default_factory=dict)
    chunks: list[ChunkFile] = field(default_factory=list)
    leftovers: list[Leftover] = field(default_factory=list)
    foreign: list[Foreign] = field(default_factory=list)
    #: Children before parents. Without ``all_dirs`` only those that hold
    #: nothing but leftovers and such directories (the ones that may be
    #: empty once leftovers go).
    dirs: list[DirRecord] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)  # path, why


@dataclass
class _Frame:
    """A directory being scanned (held open: at most one per level)."""

    fd: int
    path: str
    mtime: float
    zone: str  # "ns" (the namespace directory), "chunks" or "temp"
    level: int  # chunk directories: 1 (aa) to 3 (cc)
    ns: NamespaceScan
    shape: ChunkShape
    entries: int = 0
    keep: int = 0  # entries that stay (not leftovers, not emptiable dirs)
    subdirs: list[tuple[str, os.stat_result, str, int]] = field(default_factory=list)


class _Scanner:
    def __init__(self, root: str, all_dirs: bool):
        self.scan = RootScan(root)
        self.all_dirs = all_dirs
        self.dev = 0

    def run(self) -> RootScan:
        scan = self.scan
        try:
            root_fd = os.open(scan.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            scan.errors.append((scan.root, str(e)))
            return scan
        try:
            self.dev = os.fstat(root_fd).st_dev
            for name, st in self._list(root_fd, scan.root) or []:
                path = os.path.join(scan.root, name)
                parsed = parse_namespace_name(name)
                if stat.S_ISREG(st.st_mode) and root_files.is_root_file(name):
                    continue  # the cache's own, and no chunk
                if stat.S_ISDIR(st.st_mode) and parsed is not None:
                    if st.st_dev != self.dev:
                        self._foreign(path, st, "another filesystem mounted here")
                    else:
                        self._namespace(root_fd, name, st, parsed)
                elif stat.S_ISDIR(st.st_mode):
                    self._foreign(path, st, "a directory that is no cache namespace")
                else:
                    self._foreign(path, st, "outside the cache's namespaces")
        finally:
            os.close(root_fd)
        return scan

    def _list(self, fd: int, path: str) -> list[tuple[str, os.stat_result]] | None:
        """The entries of an open directory with their ``lstat``; entries
        that vanish meanwhile are left out; ``None`` if unreadable."""
        try:
            with os.scandir(fd) as it:
                entries = list(it)
        except OSError as e:
            self.scan.errors.append((path, str(e)))
            return None
        listed = []
        for entry in entries:
            try:
                listed.append((entry.name, entry.stat(follow_symlinks=False)))
            except FileNotFoundError:
                continue
            except OSError as e:
                self.scan.errors.append((os.path.join(path, entry.name), str(e)))
        return listed

    def _foreign(
        self,
        path: str,
        st: os.stat_result,
        reason: str,
        ns: str | None = None,
        at_chunk_path: bool = False,
    ) -> None:
        mode = st.st_mode
        if stat.S_ISLNK(mode):
            kind, reason = "symlink", "a symbolic link (never followed)"
        elif stat.S_ISDIR(mode):
            kind = "directory"
        elif stat.S_ISREG(mode):
            kind = "file"
        else:
            kind, reason = "other", "not a regular file, directory or link"
        self.scan.foreign.append(Foreign(path, kind, reason, ns, at_chunk_path))

    def _open(
        self, parent_fd: int, name: str, st: os.stat_result
    ) -> tuple[int, os.stat_result] | None:
        """Open a listed directory relative to its parent, without following
        a link, if it is still the one listed."""
        try:
            fd = os.open(name, _OPEN_DIR, dir_fd=parent_fd)
        except OSError:
            return None
        fst = os.fstat(fd)
        if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            os.close(fd)
            return None
        return fd, fst

    def _namespace(
        self, root_fd: int, name: str, st: os.stat_result, parsed: NamespaceName
    ) -> None:
        opened = self._open(root_fd, name, st)
        if opened is None:
            return
        path = os.path.join(self.scan.root, name)
        manifest = _parse_manifest(_read_manifest_doc(MANIFEST, opened[0]), name)
        ns = NamespaceScan(name, path, parsed, manifest)
        self.scan.namespaces[name] = ns
        frame = _Frame(
            opened[0], path, st.st_mtime, "ns", 0, ns, ChunkShape.of(parsed, manifest)
        )
        stack = [frame]
        try:
            self._fill(frame)
            # Iterative, depth first: at most one open directory per level.
            while stack:
                top = stack[-1]
                if top.subdirs:
                    sub, sub_st, zone, level = top.subdirs.pop()
                    opened = self._open(top.fd, sub, sub_st)
                    if opened is None:
                        top.keep += 1  # gone or replaced: leave it be
                        continue
                    child = _Frame(
                        opened[0],
                        os.path.join(top.path, sub),
                        sub_st.st_mtime,
                        zone,
                        level,
                        ns,
                        top.shape,
                    )
                    stack.append(child)
                    self._fill(child)
                    continue
                stack.pop()
                os.close(top.fd)
                emptiable = top.keep == 0
                if emptiable or self.all_dirs:
                    self.scan.dirs.append(DirRecord(top.path, top.mtime, top.entries))
                if stack and not emptiable:
                    stack[-1].keep += 1
        finally:
            for f in stack:
                os.close(f.fd)

    def _fill(self, frame: _Frame) -> None:
        """Sort a directory's entries: chunks, leftovers, subdirectories to
        scan, and what is not the cache's."""
        listed = self._list(frame.fd, frame.path)
        if listed is None:
            frame.entries = frame.keep = 1  # unreadable: never emptied
            return
        frame.entries = len(listed)
        for name, st in listed:
            if not self._sort(frame, name, st):
                frame.keep += 1

    def _sort(self, frame: _Frame, name: str, st: os.stat_result) -> bool:
        """Sort one entry; whether it may go (a leftover, or a directory to
        scan that may turn out emptiable)."""
        ns, zone, mode = frame.ns, frame.zone, st.st_mode
        path = os.path.join(frame.path, name)
        if stat.S_ISDIR(mode) and st.st_dev != self.dev:
            self._foreign(path, st, "another filesystem mounted here", ns.name)
        elif stat.S_ISDIR(mode) and (
            zone == "temp" or (zone == "ns" and name == TEMP_DIR)
        ):
            frame.subdirs.append((name, st, "temp", 0))
            return True
        elif stat.S_ISDIR(mode) and zone != "temp" and _HEX2.fullmatch(name):
            if frame.level < 3:
                frame.subdirs.append((name, st, "chunks", frame.level + 1))
                return True
            self._foreign(path, st, "a directory where a chunk file belongs", ns.name)
        elif not stat.S_ISREG(mode):
            self._foreign(path, st, "not a name the cache uses here", ns.name)
        elif zone == "temp" or (zone == "ns" and _MANIFEST_TEMP.fullmatch(name)):
            self._leftover(path, ns, "temp", st)
            return True
        elif zone == "ns" and name == MANIFEST:
            ns.manifest_file = path
        elif zone == "chunks" and frame.level == 3 and _HEX2.fullmatch(name):
            if st.st_size == 0:  # vineyard's placeholder before a rename
                self._leftover(path, ns, "placeholder", st)
                return True
            self._chunk(frame, name, path, st)
        else:
            self._foreign(path, st, "not a name the cache uses here", ns.name)
        return False

    def _leftover(
        self, path: str, ns: NamespaceScan, kind: str, st: os.stat_result
    ) -> None:
        ns.leftovers += 1
        self.scan.leftovers.append(
            Leftover(path, ns.name, kind, st.st_mtime, disk_bytes(st), st.st_ino)
        )

    def _chunk(self, frame: _Frame, name: str, path: str, st: os.stat_result) -> None:
        ns = frame.ns
        if frame.shape.entry_bytes is not None:
            why = frame.shape.mismatch(st.st_size, None)  # by its size alone
        else:
            why = self._read_shape(frame, name, st)
        if why is not None:
            self._foreign(path, st, f"not chunk-shaped: {why}", ns.name, True)
            return
        size = disk_bytes(st)
        self.scan.chunks.append(
            ChunkFile(path, ns.name, st.st_mtime, size, st.st_size, st.st_ino)
        )
        ns.chunks += 1
        ns.bytes += size
        if ns.last_use is None or st.st_mtime > ns.last_use:
            ns.last_use = st.st_mtime

    @staticmethod
    def _read_shape(frame: _Frame, name: str, st: os.stat_result) -> str | None:
        try:
            fd = os.open(name, _OPEN_FILE, dir_fd=frame.fd)
        except OSError as e:
            return f"unreadable ({e.strerror})"
        try:
            if os.fstat(fd).st_ino != st.st_ino:
                return "replaced while scanned"
            return frame.shape.mismatch(st.st_size, _read_at(fd))
        except OSError as e:
            return f"unreadable ({e.strerror})"
        finally:
            os.close(fd)


def scan_root(root: str, all_dirs: bool = False) -> RootScan:
    """One pass over a cache root: one ``lstat`` per entry (and, in a
    namespace without a manifest, a read of each chunk file's header and
    tail). Does not descend into what is not the cache's."""
    return _Scanner(root, all_dirs).run()


# --------------------------------------------------------------------------
# Removals.
# --------------------------------------------------------------------------


def _remove(root: str, path: str, check: Callable[[os.stat_result], bool]) -> bool:
    """Remove ``path`` (below ``root``) if ``check`` accepts its ``lstat``,
    reaching it through directories opened without following links (a
    directory swapped for a link meanwhile is not followed)."""
    rel = os.path.relpath(path, root)
    parts = rel.split(os.sep)
    if rel.startswith(os.pardir) or os.path.isabs(rel) or rel == os.curdir:
        return False
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        for part in parts[:-1]:
            sub = os.open(part, _OPEN_DIR, dir_fd=fd)
            os.close(fd)
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
        os.close(fd)


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


# --------------------------------------------------------------------------
# Lookups (by the scheduler's lookup process, or in-process).
# --------------------------------------------------------------------------


def count_cached_chunks(
    rank_files: list[chunks.ChunkFiles],
    ids: list[int],
    max_chunks: int,
    counts: dict[str, int],
    log: LogLimiter,
) -> int:
    """How many leading chunks of ``ids`` (up to ``max_chunks``) every
    rank's namespace holds whole, by ``stat`` alone (the minimum over
    ranks). Adds to ``counts``: ``lookup_stats``, and ``corrupt_chunks`` or
    ``path_collisions`` for a file where a rank's lookup stopped (see
    :func:`_remove_if_damaged`)."""
    bpc = rank_files[0].blocks_per_chunk if rank_files else 1
    cached = max_chunks
    for files in rank_files:
        found = files.count_complete(ids, cached)
        counts["lookup_stats"] = counts.get("lookup_stats", 0) + min(found + 1, cached)
        if found < cached:
            _remove_if_damaged(files, ids[: (found + 1) * bpc], counts, log)
        cached = found
    return cached


def _remove_if_damaged(
    files: chunks.ChunkFiles,
    ids: list[int],
    counts: dict[str, int],
    log: LogLimiter,
) -> None:
    """A regular file where a lookup stopped, of neither vineyard's
    placeholder size (0) nor the chunk's, is a damaged chunk (vineyard
    renames whole chunks into place, so no write is ever seen half done):
    remove it, so that the next save writes the chunk again (vineyard keeps
    a file it finds at a chunk's path). Unless it is another prefix's chunk
    whose ids hash to the same path: that one is valid, and left alone."""
    path = files.path(ids)
    try:
        st = os.lstat(path)
    except OSError:
        return  # missing: the common miss
    if not stat.S_ISREG(st.st_mode) or st.st_size in (0, files.file_bytes(len(ids))):
        return
    try:
        collision = files.holds_other_prefix(ids)
    except OSError:
        return  # cannot be read now: not known to be bad
    if collision:
        counts["path_collisions"] = counts.get("path_collisions", 0) + 1
        log.warning(
            "collision",
            "vineyard cache chunk of another prefix at this prefix's path "
            "(a hash collision; left in place, the tokens are recomputed): %s",
            path,
        )
    elif remove_file(files.root, path, st.st_ino):
        counts["corrupt_chunks"] = counts.get("corrupt_chunks", 0) + 1
        log.warning(
            "wrong-size",
            "vineyard cache chunk of the wrong size (%d bytes, not %d) was "
            "removed; it is written again by the next save: %s",
            st.st_size,
            files.file_bytes(len(ids)),
            path,
        )


# --------------------------------------------------------------------------
# The root itself.
# --------------------------------------------------------------------------


def check_root(root: str, group_access: bool, setting: str) -> str:
    """Resolve a cache root once, create it if missing (private, or group
    accessible with ``group_access``), and refuse one that others could
    turn against this process: the root must be this user's and not
    writable by others (nor by its group without ``group_access``), and
    every folder above it must be this user's or root's and not writable
    by others unless sticky (as ``/tmp`` is), so nobody else can swap the
    root for their own. Returns the resolved path; raises ``ValueError``
    naming ``setting`` and saying why (``OSError`` if it cannot be made)."""
    resolved = os.path.realpath(root)
    # OSError (cannot create, e.g. a read-only filesystem) goes to the
    # caller: that is backend trouble, not a setting to refuse.
    os.makedirs(resolved, mode=0o770 if group_access else 0o700, exist_ok=True)
    st = os.stat(resolved)
    me = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{setting}={root}: {resolved} is not a directory")
    if st.st_uid != me:
        raise ValueError(
            f"{setting}={root}: {resolved} belongs to uid {st.st_uid}, not to "
            f"this user (uid {me}); use a root of your own"
        )
    writable_by = stat.S_IWOTH | (0 if group_access else stat.S_IWGRP)
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
