# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The staging memory the cache shares with its backend processes: buffers
of KV entries in a ``memfd`` that both sides map, page-locked for the
device's copies when there is a device (:func:`pin`), backed ahead of need
(:class:`BufferBacking`), and the read buffers of loads
(:class:`ReadBuffers`)."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Callable

import torch
from vllm.logger import init_logger

from vllm.worker.vineyard.cores import move_off_the_workers_cores

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


class BufferBacking:
    """Backs the buffers of a :class:`StagingMemory` ahead of need: touches
    their pages (and pins them where there is a device), so that a burst
    does not fault them in on the forward thread.

    ``first`` buffers are backed at once, on the caller's thread; the rest,
    up to ``count``, by a background thread (``ahead``) that runs at the
    lowest priority, off the cores the forward thread uses where there are
    any, a slice at a time (backing a large buffer costs hundreds of ms of
    a core, which must not be the engine's). Each buffer the thread backs
    goes to ``on_backed``. :meth:`take` hands out a buffer not handed out
    yet: one the thread started is taken over and finished on the caller's
    thread (waiting at most for the slice the thread is on), else a new
    one is backed there; ``None`` once every buffer was handed out.
    """

    #: Bytes backed per step.
    SLICE_BYTES = 4 << 20

    def __init__(
        self,
        memory: StagingMemory,
        count: int,
        first: int,
        on_backed: Callable[[int], None],
        ahead: bool = True,
    ):
        assert 1 <= first <= count <= memory.tensor.shape[0]
        self._memory = memory
        self.count = count
        self._on_backed = on_backed
        self._lock = threading.Lock()
        self._backed = threading.Condition(self._lock)
        nbytes = memory.tensor[0].numel() * memory.tensor.element_size()
        self._num_slices = max(1, -(-nbytes // self.SLICE_BYTES))
        # Buffers being backed: slices claimed and slices done; a take()
        # that took one over (``_taken``) receives it, not on_backed.
        self._backing: dict[int, list[int]] = {}
        self._taken: set[int] = set()
        self._num_claimed = 0  # buffers being backed or backed
        self.num_backed = 0
        self._pinned: list[torch.Tensor] = []
        self._closing = False
        taken = [self.take() for _ in range(first)]  # for the caller
        self.first = [b for b in taken if b is not None]
        self._thread: threading.Thread | None = None
        if ahead and count > first:
            self._thread = threading.Thread(
                target=self._back_the_rest, name="vineyard-pool-backer", daemon=True
            )
            self._thread.start()

    @property
    def num_not_handed_out(self) -> int:
        """Buffers neither handed to a taker nor to ``on_backed`` yet."""
        with self._lock:
            started = sum(b not in self._taken for b in self._backing)
            return started + self.count - self._num_claimed

    def take(self) -> int | None:
        """A buffer not handed out yet, backed on this thread if need be;
        ``None`` once every buffer was handed out."""
        with self._lock:
            buffer_id = self._buffer_to_back()
            if buffer_id is None:
                return None
            self._taken.add(buffer_id)  # handed to this caller when backed
        return self._back_here(buffer_id)

    def _claim_buffer(self) -> int:
        buffer_id = self._num_claimed
        self._num_claimed += 1
        self._backing[buffer_id] = [0, 0]
        return buffer_id

    def _buffer_to_back(self) -> int | None:
        """(Lock held.) The buffer started and not taken, else a newly
        claimed one; ``None`` when every buffer is claimed."""
        for buffer_id in self._backing:
            if buffer_id not in self._taken:
                return buffer_id
        if self._num_claimed < self.count:
            return self._claim_buffer()
        return None

    def _claim_slice(self, buffer_id: int) -> int | None:
        progress = self._backing.get(buffer_id)
        if progress is None or progress[0] >= self._num_slices:
            return None
        progress[0] += 1
        return progress[0] - 1

    def _back_slice(self, buffer_id: int, index: int) -> None:
        """Touch one slice of a claimed buffer; whoever backs its last
        slice pins it and hands it on (to its taker, or ``on_backed``)."""
        flat = self._memory.tensor[buffer_id].view(-1).view(torch.uint8)
        at = index * self.SLICE_BYTES
        flat[at : at + self.SLICE_BYTES].fill_(0)  # back the pages now
        with self._lock:
            self._backing[buffer_id][1] += 1
            if self._backing[buffer_id][1] < self._num_slices:
                return
        buffer = self._memory.tensor[buffer_id]
        pinned = pin(buffer)
        with self._lock:
            del self._backing[buffer_id]
            if pinned:
                self._pinned.append(buffer)
            self.num_backed += 1
            taken = buffer_id in self._taken
            self._taken.discard(buffer_id)
            self._backed.notify_all()
        if not taken:
            self._on_backed(buffer_id)

    def _back_here(self, buffer_id: int) -> int:
        """Back what is left of a claimed buffer on this thread and wait
        for any slice another thread is on."""
        while True:
            with self._lock:
                index = self._claim_slice(buffer_id)
            if index is None:
                break
            self._back_slice(buffer_id, index)
        with self._lock:
            while buffer_id in self._backing:
                self._backed.wait()
        return buffer_id

    def _back_the_rest(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        # As the backends: the engine's startup keeps its own core busy, and
        # a first burst must find the buffers backed.
        move_off_the_workers_cores()
        while True:
            with self._lock:
                if self._closing:
                    return
                buffer_id = self._buffer_to_back()
                if buffer_id is None:
                    return
                index = self._claim_slice(buffer_id)
            # Not taken: no other thread backs its slices.
            assert index is not None
            self._back_slice(buffer_id, index)

    def close(self) -> None:
        """Stop the background thread (at most one slice away) and unpin
        the buffers: their copies must be done."""
        with self._lock:
            self._closing = True
            self._backed.notify_all()
        if self._thread is not None:
            self._thread.join()
        for buffer in self._pinned:
            unpin(buffer)
        self._pinned.clear()
