# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Whether a backend process is still working on the request in flight, as
``/proc`` tells (:class:`ProgressWatch`): a backend that makes progress,
however slowly, is waited for; one that makes none for a timeout is taken
for hung.

- Progress is anything that changes while the process serves a request:
  its main thread's CPU time, bytes read and written, context switches;
  while it waits for the disk, the I/O the disk completes; while it waits
  for a CPU, always.
- A request's time counts only the CPU it got while runnable: a backend
  starved by busy engines is slow, not hung. One that keeps making progress
  is still taken for hung after :data:`MAX_BUSY_TIMEOUTS` timeouts of its
  own time (a loop that never finishes).
- A backend that waited for a CPU during one request for
  :data:`STARVED_S` (:data:`WAITED_FOR_STARVED_S` where requests wait for
  it) may run on every core from then on.

Imports neither vLLM nor torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

#: A backend that keeps making progress is waited for up to this many
#: timeouts of its own time (not counting its waits for a CPU) before it is
#: taken for hung (a loop that never finishes).
MAX_BUSY_TIMEOUTS = 10
#: A backend that waited this long for a CPU during one request may run on
#: every core from then on, beside its own engine's forward pass (it starts
#: on the cores the worker does not use).
STARVED_S = 1.0
#: The same for a backend that requests wait for (a reader, a lookup
#: process): each such wait is a request's.
WAITED_FOR_STARVED_S = 0.05
#: A sample this recent stands for :meth:`ProgressWatch.cpu_wait_s` (a load
#: waiting on a read asks every poll: every few milliseconds on an engine
#: with nothing else to run).
RESAMPLE_S = 0.01


def run_queue_wait_s(pid: int | None) -> float | None:
    """The time all of ``pid``'s threads spent runnable without a CPU (the
    scheduler's ``run_delay``), or ``None`` where ``/proc`` does not tell."""
    if pid is None:
        return None
    waited_ns = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with (
                contextlib.suppress(OSError, ValueError, IndexError),
                open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f,
            ):
                waited_ns += int(f.read().split()[1])
    except OSError:
        return None
    return waited_ns / 1e9


def disk_stat_path(path: str) -> str | None:
    """The I/O counters of the block device ``path`` is on, if it is on one
    (not a network or FUSE filesystem)."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    stat_path = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat"
    return stat_path if os.path.exists(stat_path) else None


@dataclass(frozen=True)
class _Sample:
    """What ``/proc`` tells of a backend process at one moment."""

    #: What changes while it serves a request, however slowly: its main
    #: thread's CPU time, bytes read and written, and context switches
    #: (each blocking call that returns is one, so a filesystem that answers
    #: slowly counts); while the thread waits for the disk, the I/O the disk
    #: completes; while a thread waits for a CPU, always new. It stands
    #: still while the thread is stopped, blocked in the kernel on a
    #: filesystem that hangs, or waiting for something that does not come.
    progress: tuple[int, ...]
    ran_s: float  # the CPU time all its threads have had (the scheduler's)
    #: Whether a thread waits for a CPU: the main thread, or another one
    #: while the main thread sleeps (it may wait for the GIL that a starved
    #: thread holds).
    runnable: bool
    waited_s: float  # all its threads' time runnable without a CPU


def _sample(pid: int | None, disk_stat: str | None = None) -> _Sample | None:
    """One reading of process ``pid`` (``disk_stat``: the counters of the
    block device its root is on), each thread's files read once: the
    forward thread takes it every step while a request is in flight.
    ``None`` where ``/proc`` does not tell."""
    if pid is None:
        return None
    task = f"/proc/{pid}/task/{pid}"
    try:
        tids = os.listdir(f"/proc/{pid}/task")
        with open(f"{task}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        state = fields[0]
        # A stopped thread or one in uninterruptible I/O (see the disk) is
        # not waiting for a CPU, whatever its other threads do.
        runnable = state == b"R"
        ran_ns = waited_ns = 0
        for tid in tids:
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                    ran, waited = f.read().split()[:2]
                ran_ns, waited_ns = ran_ns + int(ran), waited_ns + int(waited)
                if state == b"S" and not runnable and tid != str(pid):
                    with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                        thread_state = f.read().rsplit(b")", 1)[1].split()[0]
                    runnable = thread_state == b"R"
        disk: tuple[int, ...] = ()
        if runnable:
            # Waiting for a CPU that busy engines keep: starved, which is
            # slow, not hung (an always-new value: progress).
            disk = (time.monotonic_ns(),)
        elif disk_stat is not None and state == b"D":
            # Waiting for the disk (fsync, writeback): its progress counts.
            with open(disk_stat, "rb") as f:
                counts = f.read().split()
            disk = (int(counts[0]), int(counts[4]))  # reads, writes completed
        with open(f"{task}/status", "rb") as f:
            status = dict(line.split(b":", 1) for line in f.read().splitlines())
        with open(f"{task}/io", "rb") as f:
            io = dict(line.split(b":", 1) for line in f.read().splitlines())
        progress = (
            int(fields[11]),  # utime (field 14; the state is field 3)
            int(fields[12]),  # stime
            int(status[b"voluntary_ctxt_switches"]),
            int(status[b"nonvoluntary_ctxt_switches"]),
            int(io[b"rchar"]),
            int(io[b"wchar"]),
            *disk,
        )
    except (OSError, ValueError, KeyError, IndexError):
        return None
    return _Sample(progress, ran_ns / 1e9, runnable, waited_ns / 1e9)


@dataclass
class _Watch:
    """The progress of the request in flight."""

    mark: tuple[int, ...] | None  # its process's progress as last seen
    quiet_since: float  # when that last changed
    checked_at: float
    ran_s: float | None  # its process's CPU time at ``checked_at``
    #: Time the request has had: while its process is runnable, only the
    #: CPU time it got. Busy engines can starve a backend for tens of
    #: seconds, and a starved backend is slow, not hung.
    busy_s: float = 0.0
    starved_s: float = 0.0  # the rest: runnable, without a CPU
    #: Its threads' waits for a CPU that ended, by the kernel's count.
    counted_wait_s: float = 0.0


class ProgressWatch:
    """The progress of one backend handle's request in flight (one at a
    time), for the handle to tell slow from hung. Not thread-safe: the
    handle calls it under its lock."""

    def __init__(
        self, name: str, disk_stat: str | None, waited_for: bool = False
    ) -> None:
        #: The backend's name, in what is logged.
        self.name = name
        self._waited_for = waited_for  # see WAITED_FOR_STARVED_S
        self._run_queue_wait_s: float | None = None  # when the request went
        #: The I/O counters of the block device of the root (see
        #: :func:`disk_stat_path`), whose progress counts as the backend's.
        self._disk_stat = disk_stat
        self._watch = _Watch(None, 0.0, 0.0, None)
        self._everywhere = False  # the process may run on every core

    def new_process(self) -> None:
        """A new process runs: it starts off the worker's cores."""
        self._everywhere = False

    def start(self, pid: int | None) -> None:
        """A request was sent to process ``pid``: its progress from now."""
        now = time.monotonic()
        seen = _sample(pid, self._disk_stat)
        self._run_queue_wait_s = seen.waited_s if seen else None
        self._watch = _Watch(
            seen.progress if seen else None,
            now,
            now,
            seen.ran_s if seen else None,
        )

    def cpu_wait_s(self, pid: int | None) -> float:
        """How long process ``pid``, still at the request, has waited for a
        CPU since it was sent: the kernel's count of the waits that ended
        (its threads' waits add up), or the time it was found runnable
        without gaining CPU time, up to now (within :data:`RESAMPLE_S`; the
        kernel counts a wait once it ends). One that waited
        :meth:`_starved_s` may run on every core from now on."""
        watch = self._watch
        if time.monotonic() - watch.checked_at >= RESAMPLE_S:
            self._account(pid)
        waited_s = max(watch.starved_s, watch.counted_wait_s)
        self._move_if_starved(pid, waited_s)
        return waited_s

    def answered(self, pid: int | None) -> None:
        """The request was answered: a process that waited
        :meth:`_starved_s` for a CPU meanwhile (the kernel's count; short
        as the request may have been) may run on every core from now on."""
        before, now = self._run_queue_wait_s, run_queue_wait_s(pid)
        if before is not None and now is not None:
            self._move_if_starved(pid, now - before)

    def _move_if_starved(self, pid: int | None, waited_s: float) -> None:
        if waited_s >= self._starved_s() and pid is not None and not self._everywhere:
            self._run_everywhere(pid, waited_s)

    def stall(self, pid: int | None, quiet_s: float) -> str | None:
        """Why the request in flight is taken for hung, or ``None``: its
        process made no progress for ``quiet_s``, or has been busy with it
        for :data:`MAX_BUSY_TIMEOUTS` times that, not counting its waits
        for a CPU. A process starved of CPU or waiting for a busy disk is
        slow, not hung: it goes on."""
        watch = self._watch
        self._account(pid)
        self._move_if_starved(pid, watch.starved_s)
        if watch.checked_at - watch.quiet_since >= quiet_s:
            return f"no progress for {quiet_s:g} s"
        if watch.busy_s >= MAX_BUSY_TIMEOUTS * quiet_s:
            return (
                f"still busy after {watch.busy_s:.0f} s (not counting its "
                "waits for a CPU)"
            )
        return None

    def _account(self, pid: int | None) -> None:
        """Sample ``pid`` and book the time since the last sample as had
        (its CPU time, while runnable) or starved (the rest of it)."""
        watch, now = self._watch, time.monotonic()
        seen = _sample(pid, self._disk_stat)
        if seen is not None and seen.progress != watch.mark:
            watch.mark, watch.quiet_since = seen.progress, now
        elapsed_s = had_s = now - watch.checked_at
        if seen is not None and watch.ran_s is not None and seen.runnable:
            # Runnable: the CPU it got, not the time it waited for one.
            had_s = min(had_s, max(0.0, seen.ran_s - watch.ran_s))
        watch.busy_s += had_s
        watch.starved_s += elapsed_s - had_s
        watch.checked_at, watch.ran_s = now, (seen.ran_s if seen else None)
        if seen is not None and self._run_queue_wait_s is not None:
            watch.counted_wait_s = seen.waited_s - self._run_queue_wait_s

    def _starved_s(self) -> float:
        return WAITED_FOR_STARVED_S if self._waited_for else STARVED_S

    def _run_everywhere(self, pid: int, starved_s: float) -> None:
        """Let a starved backend run on every core. The cores the worker
        does not use can be as busy as its own (another instance's engine
        there, every core bound to an engine), and Linux shares a core
        among groups of processes (sessions, cgroups) by each group's load
        on it: alone on another group's busy core, a backend can get no CPU
        for many seconds, while beside its own engine its group has its
        share (and the writer's nice 10 lets the pass win)."""
        self._everywhere = True
        every = range(os.cpu_count() or 1)
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), every)
        logger.info(
            "%s vineyard backend waited %.1f s for a CPU on the cores the "
            "worker does not use; it may run on every core now",
            self.name,
            starved_s,
        )
