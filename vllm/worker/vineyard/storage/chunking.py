# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How many KV blocks a chunk file holds when the user sets no chunk size
(:func:`blocks_per_chunk_of`): chosen from the root's measured round trip
and recorded in the root (:data:`CHUNKING`), so that every instance on it
agrees (the chunk size is part of the namespace: instances that chose
differently would share nothing).

Each chunk file costs a fixed number of round trips to write (create,
sync, rename, ...) and one ``stat`` to look up, whatever its size; on a
root a network away those dominate a save unless a file holds several
blocks. Larger chunks make hits coarser (a prompt's last partial chunk is
not cached), so a local disk keeps one block per chunk.

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

#: (round trip below this many seconds, blocks per chunk), in order.
BLOCKS_BY_ROUND_TRIP = ((0.001, 1), (0.004, 2), (0.016, 4))
#: Beyond the last round trip above.
MOST_BLOCKS_PER_CHUNK = 8
_PROBES = 5


def blocks_for_round_trip(round_trip_s: float) -> int:
    for below, blocks in BLOCKS_BY_ROUND_TRIP:
        if round_trip_s < below:
            return blocks
    return MOST_BLOCKS_PER_CHUNK


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


def blocks_per_chunk_of(root: str, modes: FileModes = OWNER_ONLY) -> int:
    """The blocks per chunk recorded for ``root``, or (none yet) chosen
    from its measured round trip and recorded (the first recorder wins).
    Raises ``OSError`` when the root can be neither read nor measured."""
    recorded = _read(root)
    if recorded is not None:
        return recorded
    round_trip_s = measure_round_trip(root)
    blocks = blocks_for_round_trip(round_trip_s)
    doc = {
        "blocks_per_chunk": blocks,
        "round_trip_ms": round(1e3 * round_trip_s, 3),
        "recorded_at": time.time(),
        "recorded_by": f"{socket.gethostname()} pid {os.getpid()}",
    }
    write_json(root, CHUNKING, doc, modes, replace=False)
    recorded = _read(root)
    return recorded if recorded is not None else blocks


def _read(root: str) -> int | None:
    try:
        doc = read_json(os.path.join(root, CHUNKING), 1 << 16)
        blocks = doc["blocks_per_chunk"]
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, OSError):
        return None  # unreadable or planted: measured again (not recorded)
    if type(blocks) is not int or not 1 <= blocks <= 64:
        return None
    return blocks
