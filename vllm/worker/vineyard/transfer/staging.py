# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The staging memory the cache shares with its backend processes: buffers
of KV entries in a ``memfd`` that both sides map, page-locked for the
device's copies when there is a device (:func:`pin`), and the read
buffers of loads (:class:`ReadBuffers`)."""

from __future__ import annotations

import contextlib
import mmap
import os

import torch
from vllm.logger import init_logger

logger = init_logger(__name__)


def pin(tensor: torch.Tensor) -> bool:
    """Page-lock a CPU tensor in place so that device copies are async."""
    if not torch.cuda.is_available():
        return False
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 0)
    if int(err) != 0:
        logger.warning(
            "cudaHostRegister failed (%s); copies into the vineyard staging "
            "buffer will be synchronous",
            err,
        )
        return False
    return True


def unpin(tensor: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


class StagingMemory:
    """``count`` buffers of ``[max_blocks, entry]`` in shared memory (a
    ``memfd`` the backend maps too), viewed as one tensor. An entry is one
    KV block of every layer, then a trailer the backend fills in. Pages are
    backed only once touched, and freed when the last process closes them,
    crash or not."""

    def __init__(
        self, count: int, max_blocks: int, entry_bytes: int, dtype: torch.dtype
    ):
        element = torch.empty((), dtype=dtype).element_size()
        self.count = count
        self.max_blocks = max_blocks
        self.buffer_bytes = max_blocks * entry_bytes
        self.fd = os.memfd_create("vineyard-cache", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, count * self.buffer_bytes)
        self._mmap = mmap.mmap(self.fd, count * self.buffer_bytes)
        flat = torch.frombuffer(
            self._mmap, dtype=dtype, count=count * self.buffer_bytes // element
        )
        self.tensor = flat.view(count, max_blocks, entry_bytes // element)

    def close(self) -> None:
        del self.tensor
        # A view may still be alive; then the GC unmaps it later.
        with contextlib.suppress(BufferError):
            self._mmap.close()
        os.close(self.fd)


class ReadBuffers:
    """The readers' buffers, one segment each: one more than the readers,
    so that while one buffer's blocks are copied into place every reader
    can read the next segment; backed (and on a device, pinned) at once."""

    def __init__(
        self,
        count: int,
        segment_blocks: int,
        entry_bytes: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.memory = StagingMemory(count, segment_blocks, entry_bytes, dtype)
        # Back the read buffers now: a first load that faults in hundreds
        # of MiB of pages measured 4x slower than the next ones.
        self.memory.tensor.view(torch.uint8).fill_(0)
        self._pinned = device.type == "cuda" and all(
            [pin(self.memory.tensor[i]) for i in range(count)]
        )

    def close(self) -> None:
        if self._pinned:
            for i in range(self.memory.count):
                unpin(self.memory.tensor[i])
        self.memory.close()
