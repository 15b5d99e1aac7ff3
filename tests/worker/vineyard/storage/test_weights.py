# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The identity of model weights covers every byte of their config and
weight files, is remembered per file across restarts, and takes a Hub
cache's content addresses as they are."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from vllm.worker.vineyard.storage import weights
from vllm.worker.vineyard.storage.weights import (
    FileDigests,
    WeightsUnidentified,
    checkpoint_identity,
)

MiB = 1 << 20


def make_checkpoint(path: Path, middle: bytes = b"m") -> Path:
    """A 4 MiB weights file whose first and last MiB never change."""
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"hidden_size": 64}')
    (path / "model.safetensors").write_bytes(
        b"a" * MiB + middle * (2 * MiB) + b"z" * MiB
    )
    (path / "tokenizer.json").write_text("{}")  # not weights: not identified
    return path


@pytest.fixture
def digests(tmp_path: Path) -> FileDigests:
    return FileDigests(str(tmp_path / "digests.json"))


def test_every_byte_counts_and_the_place_does_not(
    tmp_path: Path, digests: FileDigests
) -> None:
    model = make_checkpoint(tmp_path / "model")
    first = checkpoint_identity(str(model), digests)
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    assert checkpoint_identity(str(copy), digests) == first
    # A middle tensor changed in place: same size, same first and last MiB.
    with open(model / "model.safetensors", "r+b") as f:
        f.seek(2 * MiB)
        f.write(b"M")
    assert checkpoint_identity(str(model), digests) != first
    (copy / "tokenizer.json").write_text('{"changed": true}')
    assert checkpoint_identity(str(copy), digests) == first
    (copy / "config.json").write_text('{"hidden_size": 65}')
    assert checkpoint_identity(str(copy), digests) != first


def test_a_file_is_hashed_once_across_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_checkpoint(tmp_path / "model")
    hashed: list[str] = []
    real = weights.blake3.blake3.update_mmap

    def counting(self: object, path: str) -> object:
        hashed.append(os.path.basename(path))
        return real(self, path)  # type: ignore[arg-type]

    monkeypatch.setattr(weights.blake3.blake3, "update_mmap", counting)
    memo = str(tmp_path / "memo" / "digests.json")
    first = checkpoint_identity(str(model), FileDigests(memo))
    assert sorted(hashed) == ["config.json", "model.safetensors"]
    hashed.clear()
    # A restart: a new process reads the digests back.
    assert checkpoint_identity(str(model), FileDigests(memo)) == first
    assert hashed == []
    # A file rewritten with the same bytes (new mtime) is hashed again.
    data = (model / "config.json").read_bytes()
    os.utime(model / "config.json", ns=(1, 1))
    (model / "config.json").write_bytes(data)
    assert checkpoint_identity(str(model), FileDigests(memo)) == first
    assert hashed == ["config.json"]
    assert json.loads(Path(memo).read_text())  # shared by every process


def make_hub_snapshot(hub: Path, revision: str, files: dict[str, bytes]) -> Path:
    """A Hugging Face Hub cache snapshot: links to blobs named by hash."""
    snapshot = hub / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (hub / "blobs").mkdir(exist_ok=True)
    for name, data in files.items():
        blob = hub / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def test_a_hub_snapshot_is_named_by_its_blobs(
    tmp_path: Path, digests: FileDigests, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = tmp_path / "models--org--adapter"
    old = make_hub_snapshot(
        hub, "a" * 40, {"adapter_config.json": b"{}", "adapter_model.bin": b"v1"}
    )
    new = make_hub_snapshot(
        hub, "b" * 40, {"adapter_config.json": b"{}", "adapter_model.bin": b"v2"}
    )

    def no_hashing(path: str) -> str:
        raise AssertionError(f"{path} hashed: its blob's name is its digest")

    monkeypatch.setattr(digests, "digest", no_hashing)
    assert checkpoint_identity(str(old), digests) != checkpoint_identity(
        str(new), digests
    )
    same = make_hub_snapshot(
        tmp_path / "elsewhere", "c" * 40, {"adapter_config.json": b"{}",
                                          "adapter_model.bin": b"v1"}
    )  # fmt: skip
    assert checkpoint_identity(str(same), digests) == checkpoint_identity(
        str(old), digests
    )


def test_a_single_weights_file(tmp_path: Path, digests: FileDigests) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"x" * 100)
    first = checkpoint_identity(str(gguf), digests)
    gguf.write_bytes(b"GGUF" + b"y" * 100)
    assert checkpoint_identity(str(gguf), digests) != first


def test_what_cannot_be_identified_says_so(
    tmp_path: Path, digests: FileDigests, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(WeightsUnidentified, match="neither a file nor a folder"):
        checkpoint_identity(str(tmp_path / "missing"), digests)
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsUnidentified, match="no config or weight file"):
        checkpoint_identity(str(tmp_path / "empty"), digests)
    # A folder replaced while it is read: an error of its own, never OSError.
    model = make_checkpoint(tmp_path / "model")
    real_open = open

    def vanishing(path: str, *args: object, **kwargs: object) -> object:
        if str(path).endswith("model.safetensors"):
            raise FileNotFoundError(2, "No such file or directory", path)
        return real_open(path, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr("builtins.open", vanishing)
    with pytest.raises(WeightsUnidentified, match="cannot read"):
        checkpoint_identity(str(model), digests)
