# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An operator's view of ``vllm serve`` with the cache: KV events for
routers and vLLM's cache reset.

One server (the real model, vLLM's own prefix cache on, ``--kv-events-config``
publishing over ZMQ, the dev endpoints on) and a ZMQ subscriber in the test:

- a chat's document is saved: the subscriber gets ``BlockStored`` with medium
  ``STORAGE`` for its blocks, with the block hashes and token ids that vLLM's
  own (GPU) events give the same blocks;
- ``POST /reset_prefix_cache?reset_external=true`` removes this instance's
  chunks (``BlockRemoved`` for every announced block; a file of another
  namespace on the same root stays), so the next chat misses in vineyard;
- that chat saves the document again, and after vLLM's own prefix cache is
  reset alone, a chat loads it from vineyard.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import (
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from tests.vineyard_serve_testing import (
    DOCUMENT_TOKENS,
    QUESTIONS,
    STARTUP_TIMEOUT_S,
    Server,
    free_port,
    prepare_model,
)
from tests.vineyard_testing import engine_cpu

pytestmark = pytest.mark.engine

TOPIC = "kv-events"
#: How long events of one step take to reach the subscriber, at most.
EVENT_WAIT_S = 10.0


class Subscriber:
    """A router's view: every KV event batch the server publishes."""

    def __init__(self, port: int):
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.connect(f"tcp://127.0.0.1:{port}")
        self._socket.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list[object] = []

    def drain(self, wait_s: float = EVENT_WAIT_S) -> list[object]:
        """The events that arrive within ``wait_s`` (after the last one)."""
        new: list[object] = []
        while self._socket.poll(int(wait_s * 1000)):
            _, _, payload = self._socket.recv_multipart()
            new.extend(self._decoder.decode(payload).events)
        self.events.extend(new)
        return new

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


def stored(events: list[object], medium: str | None) -> dict[object, list[int]]:
    """Block hash -> token ids of the ``BlockStored`` events of a medium."""
    blocks: dict[object, list[int]] = {}
    for event in events:
        if isinstance(event, BlockStored) and event.medium == medium:
            bs = event.block_size
            for i, h in enumerate(event.block_hashes):
                blocks[h] = event.token_ids[i * bs : (i + 1) * bs]
    return blocks


def removed(events: list[object], medium: str) -> set[object]:
    return {
        h
        for event in events
        if isinstance(event, BlockRemoved) and event.medium == medium
        for h in event.block_hashes
    }


def post(url: str) -> dict[str, object]:
    request = urllib.request.Request(url, b"", method="POST")
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.load(r)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Server, Subscriber, Path]]:
    port = free_port()
    events_config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "topic": TOPIC,
    }
    root = tmp_path / "cache"
    server = Server(
        "cache",
        prepare_model(),
        tmp_path,
        root,
        engine_cpu(),
        prefix_caching=True,
        extra_args=["--kv-events-config", json.dumps(events_config)],
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},  # /reset_prefix_cache
    )
    subscriber = Subscriber(port)
    try:
        server.wait_ready(time.monotonic() + STARTUP_TIMEOUT_S)
        yield server, subscriber, root
    finally:
        subscriber.close()
        server.stop()


def chunk_files(namespace: Path) -> list[Path]:
    """Chunk files: flat ones (eight hex digits) or nested under folders."""
    return [
        p
        for p in namespace.rglob("*")
        if p.is_file()
        and (p.parent != namespace or re.fullmatch("[0-9a-f]{8}", p.name))
    ]


@pytest.mark.timeout(900)
def test_events_and_reset(served: tuple[Server, Subscriber, Path]) -> None:
    server, subscriber, root = served
    other = root / "v2-other-model-0123456789abcdef-c128-tp1r0-nokey"
    (other / "ab" / "cd" / "ef").mkdir(parents=True)
    (other / "ab" / "cd" / "ef" / "01").write_bytes(b"not ours to remove")

    # A chat computes the document and saves it: vLLM announces its GPU
    # blocks at once, the cache its stored blocks once every write is in.
    server.ask(QUESTIONS[0])
    assert server.settle(), "background writes were not reported in time"
    server.complete_one_token()  # a step that carries the last report
    events = subscriber.drain()
    gpu = stored(events, None) | stored(events, "GPU")
    saved = stored(events, MEDIUM_STORAGE)
    block_size = next(e.block_size for e in events if isinstance(e, BlockStored))
    assert len(saved) >= DOCUMENT_TOKENS // block_size, saved.keys()
    for block_hash, token_ids in saved.items():
        # The same hash for the same tokens as vLLM's own event.
        assert gpu.get(block_hash) == token_ids
    (namespace,) = [p for p in root.iterdir() if p.is_dir() and p != other]
    assert chunk_files(namespace)

    # The reset removes this instance's chunks and says so.
    assert post(f"{server.url}/reset_prefix_cache?reset_external=true") == {
        "success": True
    }
    server.complete_one_token()  # vLLM publishes events with a step
    assert removed(subscriber.drain(), MEDIUM_STORAGE) == set(saved)
    assert chunk_files(namespace) == []
    assert (other / "ab" / "cd" / "ef" / "01").read_bytes() == b"not ours to remove"

    # The next chat misses in vineyard (and locally: both were reset).
    hits = server.metric("hit_tokens")
    server.ask(QUESTIONS[1])
    assert server.metric("hit_tokens") == hits
    assert server.settle(), "background writes were not reported in time"
    assert chunk_files(namespace)

    # Saved again: with vLLM's own prefix cache reset alone, the document
    # comes from vineyard.
    assert post(f"{server.url}/reset_prefix_cache") == {"success": True}
    server.ask(QUESTIONS[0])
    assert server.metric("hit_tokens") >= hits + DOCUMENT_TOKENS
