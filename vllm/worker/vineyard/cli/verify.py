# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``verify``: read every chunk file of a root and check every entry as a
load does (:class:`ChunkChecker`), at a bounded rate beside live
instances; ``--remove`` deletes the bad ones."""

from __future__ import annotations

import argparse
import os
import stat
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from vllm.worker.vineyard.cli.arguments import UsageError, root_argument
from vllm.worker.vineyard.cli.output import human, print_json
from vllm.worker.vineyard.storage.chunks import (
    ChunkFiles,
    chunk_file_bytes,
    entries_at,
    header_count,
    header_ids,
)
from vllm.worker.vineyard.storage.digests import FORMAT_VERSION, key_id, load_auth_key
from vllm.worker.vineyard.storage.removal import remove_file
from vllm.worker.vineyard.storage.safe_io import OPEN_FILE
from vllm.worker.vineyard.storage.scan import NamespaceScan, RootScan, scan_root
from vllm.worker.vineyard.storage.sealing import TRAILER_BYTES, Sealer, claimed_id


class _Vanished(Exception):
    """The file went meanwhile (evicted, or repaired by a reader)."""


class RateLimit:
    """Sleeps so that reads average at most ``bytes_per_s``."""

    def __init__(self, bytes_per_s: float | None):
        self.bytes_per_s = bytes_per_s
        self.start = time.monotonic()
        self.done = 0

    def add(self, n: int) -> None:
        self.done += n
        if self.bytes_per_s:
            ahead = self.done / self.bytes_per_s - (time.monotonic() - self.start)
            if ahead > 0:
                time.sleep(ahead)


class Progress:
    """A one-line progress indicator on a terminal (nothing otherwise)."""

    def __init__(self, total: int, total_bytes: int, stream: TextIO):
        self.total, self.total_bytes, self.stream = total, total_bytes, stream
        self.enabled = stream.isatty()
        self.shown_at = 0.0

    def update(self, done: int, done_bytes: int, bad: int, last: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not last and now - self.shown_at < 0.2):
            return
        self.shown_at = now
        self.stream.write(
            f"\r\033[Kverify: {done}/{self.total} chunks, {human(done_bytes)} of "
            f"{human(self.total_bytes)}, {bad} bad" + ("\n" if last else "")
        )
        self.stream.flush()

    def clear(self) -> None:
        """Clear the line (before another line is printed)."""
        if self.enabled:
            self.stream.write("\r\033[K")
            self.stream.flush()


@dataclass
class ChunkChecker:
    """Checks a namespace's chunk files entry by entry, as a load does:
    header and size, the path (vineyard's hash of the header's ids), each
    entry's trailer (its digest must be that of its id) and checksum or
    MAC. Without a manifest the entries' layout is inferred from the
    first chunk that shows it."""

    ns_dir: str
    sealer: Sealer
    geometry: tuple[int, int] | None  # blocks per chunk, entry bytes
    chunk_tokens: int | None  # from the namespace's name
    keyed: bool
    limit: RateLimit
    bytes_read: int = 0
    _buf: bytearray = field(default_factory=bytearray)

    def check(self, path: str) -> tuple[str | None, int]:
        """Why the file at ``path`` is bad (``None``: it verifies) and its
        inode; raises :class:`_Vanished` if it is gone."""
        try:
            fd = os.open(path, OPEN_FILE)
        except FileNotFoundError:
            raise _Vanished from None
        except OSError as e:
            return f"cannot be opened ({e.strerror})", 0
        with open(fd, "rb", buffering=0) as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return "not a regular file", st.st_ino
            try:
                return self._check(fd, f, st.st_size, path), st.st_ino
            except OSError as e:
                return f"read error ({e.strerror})", st.st_ino

    def _read(self, f: Any, n: int) -> bytes:
        data = f.read(n)
        self.bytes_read += len(data)
        self.limit.add(len(data))
        return data

    def _check(self, fd: int, f: Any, size: int, path: str) -> str | None:
        """Why the open file is bad: its header, size and path, then (by
        :meth:`_check_entries`) each entry."""
        n = header_count(self._read(f, 4))
        if n < 1 or entries_at(n) > size:
            return (
                f"its header (n={n}) does not fit its {size} bytes "
                "(truncated, or no chunk)"
            )
        raw = self._read(f, 4 * n)
        if len(raw) != 4 * n:
            return "short read (the file shrank)"
        ids = header_ids(raw)
        geometry = self.geometry or self._infer(fd, size, ids)
        if geometry is None:
            return (
                "no manifest, and the layout of its entries cannot be told "
                "from it (truncated or damaged)"
            )
        bpc, entry_bytes = geometry
        want = chunk_file_bytes(n, bpc, entry_bytes)
        if size != want:
            what = "truncated" if size < want else "bytes past its end"
            return (
                f"size {size}, but {n} ids and {bpc} entries of {entry_bytes} "
                f"bytes make {want} ({what})"
            )
        if n % bpc:
            return f"its header holds {n} ids, not whole chunks of {bpc} blocks"
        flat = os.sep not in os.path.relpath(path, self.ns_dir)
        if ChunkFiles(self.ns_dir, bpc, entry_bytes, flat).path(ids) != path:
            return "its path is not the hash of its header's ids (misplaced)"
        return self._check_entries(f, ids[n - bpc :], entry_bytes)

    def _check_entries(
        self, f: Any, block_ids: list[int], entry_bytes: int
    ) -> str | None:
        """Why one of the entries (of ``block_ids``, read from ``f``) is
        bad, or ``None``."""
        if len(self._buf) != entry_bytes:
            self._buf = bytearray(entry_bytes)
        view = memoryview(self._buf)
        for i, block_id in enumerate(block_ids):
            got = f.readinto(view)
            while got is not None and 0 < got < entry_bytes:
                more = f.readinto(view[got:])
                if not more:
                    break
                got += more
            self.bytes_read += got or 0
            self.limit.add(got or 0)
            if got != entry_bytes:
                return f"entry {i}: short read (the file shrank)"
            claimed = claimed_id(view)
            if claimed is None:
                return f"entry {i}: no entry trailer (overwritten or not sealed)"
            if claimed != block_id:
                return (
                    f"entry {i}: its digest is not that of its id {block_id} "
                    "(a block of another prefix)"
                )
            if not self.sealer.verify(view, Sealer.digest_of(view)):
                what = "MAC" if self.keyed else "checksum"
                return f"entry {i}: {what} does not match (its bytes changed)"
        return None

    def _infer(self, fd: int, size: int, ids: list[int]) -> tuple[int, int] | None:
        """Blocks per chunk and entry bytes of a namespace without manifest:
        the largest split of the file's data into entries whose trailers
        all name their blocks. (One entry of all the data always does: its
        trailer is the last one, so smaller splits must lose.)"""
        n, data = len(ids), size - entries_at(len(ids))
        for bpc in range(min(n, self.chunk_tokens or n), 0, -1):
            if n % bpc or data % bpc or (self.chunk_tokens or 0) % bpc:
                continue
            entry_bytes = data // bpc
            if entry_bytes > TRAILER_BYTES and all(
                self._names_its_block(
                    fd, entries_at(n) + (i + 1) * entry_bytes, ids[i - bpc]
                )
                for i in range(bpc)
            ):
                self.geometry = (bpc, entry_bytes)
                return self.geometry
        return None

    @staticmethod
    def _names_its_block(fd: int, entry_end: int, block_id: int) -> bool:
        trailer = os.pread(fd, TRAILER_BYTES, entry_end - TRAILER_BYTES)
        return len(trailer) == TRAILER_BYTES and claimed_id(trailer) == block_id


def _skip_reason(ns: NamespaceScan, key: bytes | None, key_file: str) -> str | None:
    if ns.parsed.legacy:
        return "old format (1): never read by the cache; the sweeper evicts it"
    if ns.parsed.format_version != FORMAT_VERSION:
        return (
            f"format {ns.parsed.format_version}: not this version's ({FORMAT_VERSION})"
        )
    ns_key = _namespace_key(ns)
    if ns_key == "nokey" or (key is not None and key_id(key) == ns_key):
        return None
    given = (
        f"--key-file {key_file!r} is key {key_id(key)}"
        if key
        else ("no --key-file given")
    )
    return f"sealed with another key (key {ns_key}; {given})"


def _namespace_key(ns: NamespaceScan) -> str | None:
    if ns.manifest is not None:
        return str(ns.manifest.layout.get("key_id", ns.parsed.key_id))
    return ns.parsed.key_id


def _checkers(
    scan: RootScan, key: bytes | None, key_file: str, limit: RateLimit
) -> tuple[dict[str, ChunkChecker], list[dict[str, Any]]]:
    """A checker for each namespace that can be verified, and why the
    others are skipped."""
    checkers: dict[str, ChunkChecker] = {}
    skipped = []
    for name, ns in sorted(scan.namespaces.items()):
        why = _skip_reason(ns, key, key_file)
        if why is not None:
            skipped.append({"namespace": name, "reason": why, "chunks": ns.chunks})
            continue
        keyed = _namespace_key(ns) != "nokey"
        m = ns.manifest
        checkers[name] = ChunkChecker(
            ns.path,
            Sealer(key if keyed else None, name),
            (m.blocks_per_chunk, m.entry_bytes) if m is not None else None,
            ns.parsed.chunk_size,
            keyed,
            limit,
        )
    return checkers, skipped


@dataclass
class _Verified:
    """What a ``verify`` run found."""

    bad: list[dict[str, Any]] = field(default_factory=list)
    good: int = 0
    vanished: int = 0
    bytes_read: int = 0
    seconds: float = 0.0


def cmd_verify(args: argparse.Namespace, out: TextIO) -> int:
    root = root_argument(args.root)
    try:
        key = load_auth_key(args.key_file or "", setting="--key-file")
    except ValueError as e:
        raise UsageError(str(e)) from None
    scan = scan_root(root)
    rate = args.rate_mb_s * (1 << 20) if args.rate_mb_s else None
    checkers, skipped = _checkers(scan, key, args.key_file or "", RateLimit(rate))
    found = _verify(args, root, scan, checkers, out)
    num_removed = sum(b["removed"] for b in found.bad)
    if args.json:
        doc = {
            "root": root,
            "checked": found.good + len(found.bad),
            "good": found.good,
            "bad": found.bad,
            "removed": num_removed,
            "vanished": found.vanished,
            "skipped": skipped,
            "bytes_read": found.bytes_read,
            "seconds": round(found.seconds, 3),
        }
        print_json(doc, out)
    else:
        for s in skipped:
            print(f"SKIPPED {s['namespace']}: {s['reason']}", file=out)
        print(
            f"verified {found.good + len(found.bad)} chunks "
            f"({human(found.bytes_read)} read) in {found.seconds:.1f} s: "
            f"{found.good} good, {len(found.bad)} bad ({num_removed} removed)"
            + (f", {found.vanished} gone meanwhile" if found.vanished else "")
            + (f"; {len(skipped)} namespace(s) skipped" if skipped else ""),
            file=out,
        )
    return 1 if found.bad else 0


def _verify(
    args: argparse.Namespace,
    root: str,
    scan: RootScan,
    checkers: dict[str, ChunkChecker],
    out: TextIO,
) -> _Verified:
    """Check the chunk files of the namespaces that have a checker (and
    remove the bad ones with ``--remove``)."""
    # Chunk-shaped files, and files where chunks belong that are not (a
    # truncated chunk is the likeliest).
    todo = [(c.path, c.namespace, c.size) for c in scan.chunks]
    todo += [
        (f.path, f.namespace, 0)
        for f in scan.foreign
        if f.at_chunk_path and f.namespace is not None
    ]
    todo = sorted(t for t in todo if t[1] in checkers)
    progress = Progress(len(todo), sum(t[2] for t in todo), sys.stderr)
    start = time.monotonic()
    found = _Verified()
    for i, (path, name, _) in enumerate(todo):
        try:
            reason, ino = checkers[name].check(path)
        except _Vanished:
            found.vanished += 1
            continue
        if reason is None:
            found.good += 1
        else:
            removed = bool(args.remove) and remove_file(root, path, ino)
            found.bad.append(
                {"path": path, "namespace": name, "reason": reason, "removed": removed}
            )
            if not args.json:
                note = " (removed)" if removed else ""
                progress.clear()
                print(f"BAD {path}: {reason}{note}", file=out, flush=True)
        read = sum(c.bytes_read for c in checkers.values())
        progress.update(i + 1, read, len(found.bad))
    found.bytes_read = sum(c.bytes_read for c in checkers.values())
    progress.update(len(todo), found.bytes_read, len(found.bad), last=True)
    found.seconds = time.monotonic() - start
    return found
