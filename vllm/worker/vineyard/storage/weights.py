# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What identifies model weights (a base model's or a LoRA adapter's): a
digest of every byte that vLLM loads, so that weights changed in place (the
same path, name or Hub id) never share KV with the old ones.

:func:`checkpoint_identity` takes the local folder or file vLLM loads (the
caller resolves Hub ids, ``~`` and relative paths as vLLM does) and digests
its config files and weight files whole. A file in a Hugging Face Hub cache
is a link to a blob named by its content hash: that name is its digest.
Other files are hashed (BLAKE3) once; :class:`FileDigests` remembers each
digest by the file's device, inode, size, mtime and ctime, so a restart
does not hash unchanged files again.

Imports neither vLLM nor torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import threading

import blake3

#: Files of a checkpoint whose bytes vLLM loads as weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
#: Files that configure the weights (also ``*index.json``).
CONFIG_FILES = ("config.json", "adapter_config.json", "params.json")
#: A Hub cache blob's name: the SHA-256 of an LFS file, else a git SHA-1.
_HUB_BLOB = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
#: Digests a :class:`FileDigests` file remembers, at most (newest kept).
MAX_REMEMBERED = 4096


class WeightsUnidentified(Exception):
    """The weights cannot be identified: the cache is not used for them."""


def _is_checkpoint_file(name: str) -> bool:
    return (
        name in CONFIG_FILES
        or name.endswith("index.json")
        or name.endswith(WEIGHT_SUFFIXES)
    )


def hub_blob_digest(path: str) -> str | None:
    """The content hash that names ``path``'s blob, if ``path`` is a link
    into a Hugging Face Hub cache's ``blobs/`` folder."""
    if not os.path.islink(path):
        return None
    target = os.path.realpath(path)
    name = os.path.basename(target)
    parent = os.path.basename(os.path.dirname(target))
    if parent == "blobs" and _HUB_BLOB.fullmatch(name):
        return f"hub:{name}"
    return None


class FileDigests:
    """BLAKE3 digests of files, remembered (in memory and, with ``path``,
    in a JSON file shared by every process) by device, inode, size, mtime
    and ctime: a file is hashed again only when one of them changed."""

    def __init__(self, path: str | None = None):
        self._path = path
        self._lock = threading.Lock()
        self._known: dict[str, str] | None = None

    @staticmethod
    def _signature(st: os.stat_result) -> str:
        return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"

    def _load(self) -> dict[str, str]:
        if self._known is None:
            self._known = {}
            if self._path:
                with contextlib.suppress(OSError, ValueError):
                    with open(self._path) as f:
                        loaded = json.load(f)
                    if isinstance(loaded, dict):
                        self._known = {str(k): str(v) for k, v in loaded.items()}
        return self._known

    def _save(self, known: dict[str, str]) -> None:
        """Best effort: another process's digests written meanwhile are
        kept; a file that cannot be written costs a hash after restart."""
        if not self._path:
            return
        folder = os.path.dirname(self._path) or "."
        with contextlib.suppress(OSError, ValueError):
            os.makedirs(folder, exist_ok=True)
            with contextlib.suppress(OSError, ValueError), open(self._path) as f:
                theirs = json.load(f)
                if isinstance(theirs, dict):
                    known = {**theirs, **known}
            items = list(known.items())[-MAX_REMEMBERED:]
            fd, tmp = tempfile.mkstemp(prefix=".digests-", dir=folder)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(dict(items), f)
                os.replace(tmp, self._path)
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def digest(self, path: str) -> str:
        """The digest of the file at ``path`` (hashed only if it changed
        since it was last hashed). Raises ``OSError``."""
        with open(path, "rb") as f:
            before = os.fstat(f.fileno())
            signature = self._signature(before)
            with self._lock:
                known = self._load().get(signature)
            if known is not None:
                return known
            hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
            if before.st_size:
                hasher.update_mmap(path)
            after = os.fstat(f.fileno())
        if self._signature(after) != signature:
            raise OSError(f"{path} changed while it was hashed")
        digest = "blake3:" + hasher.hexdigest()
        with self._lock:
            known_now = self._load()
            known_now[signature] = digest
            self._save(dict(known_now))
        return digest


def checkpoint_identity(path: str, digests: FileDigests) -> str:
    """The identity of the weights at ``path`` (a checkpoint folder, or one
    weights file such as a GGUF): a digest over the names and digests of
    its config and weight files. Raises :class:`WeightsUnidentified`."""
    try:
        if os.path.isfile(path):
            files = [(os.path.basename(path), path)]
        elif os.path.isdir(path):
            files = [
                (name, os.path.join(path, name))
                for name in sorted(os.listdir(path))
                if _is_checkpoint_file(name)
                and os.path.isfile(os.path.join(path, name))
            ]
        else:
            raise WeightsUnidentified(f"{path!r} is neither a file nor a folder")
        if not files:
            raise WeightsUnidentified(f"{path!r} holds no config or weight file")
        h = blake3.blake3()
        for name, file in files:
            digest = hub_blob_digest(file) or digests.digest(file)
            h.update(f"{name}\0{digest}\0".encode())
    except OSError as e:
        raise WeightsUnidentified(f"cannot read {path!r}: {e}") from e
    return "weights:" + h.hexdigest()[:32]
