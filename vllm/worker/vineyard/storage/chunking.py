# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How many KV blocks a chunk file holds when the user sets no chunk size
(:func:`blocks_per_chunk_of`): chosen from the root's measured round trip
and recorded in the root (:data:`CHUNKING`), so that every instance on it
agrees (the chunk size is part of the namespace: instances that chose
differently would share nothing).

Each chunk file costs a fixed number of round trips to write (create,
sync, rename, ...) and one ``stat`` to look up, whatever its size; on a
root a network away those dominate a save unless a file holds enough
tokens. Larger chunks make hits coarser (a prompt's last partial chunk is
not cached), so a local disk keeps one block per chunk, and the target is
in tokens, not blocks: files per prompt is what the round trips multiply,
and a KV block holds 16 tokens on a GPU but 128 on vLLM's CPU backend
(eight of those would leave a 1,000-token prompt nothing cached).

Imports neither vLLM nor torch.
"""

from __future__ import annotations

import os
import socket
import statistics
import time

from vllm.worker.vineyard.storage.file_modes import OWNER_ONLY, FileModes
from vllm.worker.vineyard.storage.root_files import (
    CHUNKING,
    CLOCK_PROBE,
    open_root_file,
)
from vllm.worker.vineyard.storage.safe_io import read_json, write_json

#: (round trip below this many seconds, tokens per chunk), in order.
TOKENS_BY_ROUND_TRIP = ((0.001, 16), (0.004, 32), (0.016, 64))
#: Beyond the last round trip above.
MOST_TOKENS_PER_CHUNK = 128
#: The largest recorded choice trusted (a planted one is measured again).
MAX_CHUNK_TOKENS = 1 << 13
_PROBES = 5


def tokens_for_round_trip(round_trip_s: float) -> int:
    for below, tokens in TOKENS_BY_ROUND_TRIP:
        if round_trip_s < below:
            return tokens
    return MOST_TOKENS_PER_CHUNK


def _whole_blocks(tokens: int, block_size: int) -> int:
    """The blocks of ``block_size`` tokens that fit in ``tokens``, at least
    one."""
    return max(1, tokens // block_size)


def blocks_per_chunk_of(
    root: str, block_size: int, modes: FileModes = OWNER_ONLY
) -> int:
    """Blocks of ``block_size`` tokens per chunk: the tokens per chunk
    recorded for ``root``, or (none yet) chosen from its measured round trip
    and recorded (the first recorder wins), in whole blocks, at least one.
    Raises ``OSError`` when the root can be neither read nor measured."""
    recorded = _read(root, block_size)
    if recorded is not None:
        return recorded
    round_trip_s = measure_round_trip(root)
    tokens = tokens_for_round_trip(round_trip_s)
    doc = {
        "chunk_tokens": tokens,
        # What an earlier version reads (with this recorder's blocks).
        "blocks_per_chunk": _whole_blocks(tokens, block_size),
        "round_trip_ms": round(1e3 * round_trip_s, 3),
        "recorded_at": time.time(),
        "recorded_by": f"{socket.gethostname()} pid {os.getpid()}",
    }
    write_json(root, CHUNKING, doc, modes, replace=False)
    recorded = _read(root, block_size)
    return recorded if recorded is not None else _whole_blocks(tokens, block_size)


def measure_round_trip(root: str) -> float:
    """Seconds one metadata round trip to the root's server takes: the
    median of a few opens of a file (an open revalidates with the server,
    where a ``stat`` may be answered from a client's cache). Raises
    ``OSError``."""
    times = []
    for _ in range(_PROBES):
        start = time.perf_counter()
        os.close(open_root_file(root, CLOCK_PROBE, writable=True))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _read(root: str, block_size: int) -> int | None:
    try:
        doc = read_json(os.path.join(root, CHUNKING), 1 << 16)
        if "chunk_tokens" in doc:
            tokens = doc["chunk_tokens"]
            if type(tokens) is not int or not 1 <= tokens <= MAX_CHUNK_TOKENS:
                return None
            return _whole_blocks(tokens, block_size)
        blocks = doc["blocks_per_chunk"]  # recorded by an earlier version
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, OSError):
        return None  # unreadable or planted: measured again (not recorded)
    if type(blocks) is not int or not 1 <= blocks <= 64:
        return None
    return blocks
