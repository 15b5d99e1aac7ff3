# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engine-side handle of a vineyard backend process
(:mod:`~vllm.worker.vineyard.backend.server`): it starts the process, sends it
requests over a socket (:mod:`~vllm.worker.vineyard.backend.protocol`),
waits for answers with a timeout, and restarts or disables a process that
dies or stalls.

Imports neither vLLM nor torch.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from vllm.worker.vineyard import launch
from vllm.worker.vineyard.backend.protocol import BackendError, BackendSpec, Request

logger = logging.getLogger(__name__)

ReplyT = TypeVar("ReplyT")

#: How often a wait for an answer looks at the backend's progress.
PROGRESS_POLL_S = 0.25
#: A backend that keeps making progress is waited for up to this many
#: timeouts of its own time (not counting its waits for a CPU) before it is
#: taken for hung (a loop that never finishes).
MAX_BUSY_TIMEOUTS = 10
#: A backend that waited this long for a CPU during one request may run on
#: every core from then on, beside its own engine's forward pass (it starts
#: on the cores the worker does not use).
STARVED_S = 1.0


def _disk_stat_path(path: str) -> str | None:
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
        ran_ns = 0
        for tid in tids:
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                    ran_ns += int(f.read().split()[0])
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
    return _Sample(progress, ran_ns / 1e9, runnable)


@dataclass
class _Watch:
    """The progress of the request in flight."""

    mark: tuple[int, ...] | None  # its process's progress as last seen
    quiet_since: float  # when that last changed
    checked_at: float
    ran_s: float | None  # its process's CPU time at ``checked_at``
    #: Time the request has had: while its process is runnable, only the
    #: CPU time it got. Busy engines can starve a backend for tens of
    #: seconds (measured with two instances on two cores), and a starved
    #: backend is slow, not hung.
    busy_s: float = 0.0
    starved_s: float = 0.0  # the rest: runnable, without a CPU


class BackendRun:
    """One run of a backend process (a restart starts another), as the
    requests sent to it see it: the shared memory a request names (a buffer
    to read into) is the process's until it answers, or, if it was given up
    on first, until it is gone. A process killed in the middle of a
    filesystem call (uninterruptible) exits only when the call returns, and
    a read then still lands in its buffer."""

    def __init__(self, proc: subprocess.Popen[bytes]):
        self._proc = proc
        #: Stopped (killed, or found dead) by its handle: a request in
        #: flight then was never answered.
        self.stopped = False

    @property
    def pid(self) -> int:
        return self._proc.pid

    def gone(self) -> bool:
        """Whether the process has exited, every thread of it (``waitpid``
        says so: its memory is unmapped). Never waits."""
        return self._proc.poll() is not None

    def may_still_write(self) -> bool:
        """Whether memory a request named may still be written by this
        process: it was stopped before it answered, and is not gone."""
        return self.stopped and not self.gone()


#: Longest close() waits for a call or start that holds the handle after
#: the process was killed (a kill ends them at once unless the process is
#: stuck in the kernel, e.g. on a dead filesystem).
CLOSE_WAIT_S = 5.0


class BackendProcess:
    """Engine-side handle of one backend process.

    :meth:`call` is thread-safe and never waits longer than ``timeout_s``;
    :meth:`send` and :meth:`receive` split it, so the caller can work while
    the backend does (one request in flight at a time). When the process
    dies, answers garbage or stalls, it is killed and restarted on the next
    call. After ``max_restarts`` restarts within ``restart_window_s`` it is
    disabled for that long: every call fails at once with
    :class:`BackendError` and the cache degrades to recompute; then it is
    tried again (a filesystem that recovers gets its cache back).
    """

    def __init__(
        self,
        name: str,
        spec: BackendSpec,
        shm_fd: int | None,
        timeout_s: float,
        max_restarts: int = 3,
        startup_timeout_s: float = 60.0,
        nice: int = 0,
        wait: bool = True,
        restart_in_background: bool = False,
        restart_window_s: float = 600.0,
        exit_wait_s: float = 2.0,
        disk_progress: bool = False,
    ):
        """Starts the process; with ``wait=False`` returns at once and
        :meth:`wait_ready` waits (so several backends start in parallel)."""
        self.name = name
        self._spec, self._shm_fd = spec, shm_fd
        self._timeout_s = timeout_s
        self._startup_timeout_s = startup_timeout_s
        self._max_restarts = max_restarts
        self._nice = nice
        # With ``disk_progress``, I/O the root's block device completes
        # counts as the backend's progress: a write waiting seconds in
        # ``fsync`` on a busy disk is slow, not hung. Found once, here (a
        # lookup process's handle must never touch the root).
        self._disk_stat = _disk_stat_path(spec.cache_root) if disk_progress else None
        self._watch = _Watch(None, 0.0, 0.0, None)
        self._everywhere = False  # the process may run on every core
        # Callers that must never wait (the forward thread) get an error at
        # once while the process is restarted on a thread of its own, and a
        # process given up on is killed without waiting: a thread of its own
        # reaps it (see :class:`BackendRun`).
        self._restart_in_background = restart_in_background
        self._restarter: threading.Thread | None = None
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._run: BackendRun | None = None  # of ``_proc``
        self._conn: Connection | None = None
        self._in_flight: str | None = None  # the op sent and not yet received
        # Spawned, not yet ready (see ``wait``).
        self._starting: tuple[subprocess.Popen[bytes], Connection] | None = None
        self._restart_window_s = restart_window_s
        # How long a killed process is waited for (one stuck in the kernel
        # is then left to exit by itself).
        self._exit_wait_s = exit_wait_s
        self._recent_restarts: collections.deque[float] = collections.deque()
        self.restarts = 0  # in the process's lifetime (for the metrics)
        self._disabled: tuple[str, float] | None = None  # why, since when
        self._closed = False
        with self._lock:
            self._spawn_locked()
            if wait:
                self._await_ready_locked()

    @property
    def disabled_reason(self) -> str | None:
        """Why calls fail at once now, or ``None``; a backend disabled for
        the restart window is enabled again."""
        disabled = self._disabled
        if disabled is None:
            return None
        reason, since = disabled
        if time.monotonic() - since < self._restart_window_s:
            return reason
        logger.info("Enabling the %s vineyard backend again", self.name)
        self._disabled = None
        return None

    @property
    def available(self) -> bool:
        """Whether a call would be served now: not closed, not disabled and
        not restarting (read without the lock: a hint, not a promise)."""
        restarter = self._restarter
        return (
            not self._closed
            and self.disabled_reason is None
            and (restarter is None or not restarter.is_alive())
            and self._starting is None
        )

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _start_locked(self) -> None:
        self._spawn_locked()
        self._await_ready_locked()

    def wait_ready(self) -> None:
        """Wait for a backend started with ``wait=False`` to be ready;
        raises :class:`BackendError` if it cannot start."""
        with self._lock:
            if self._starting is not None:
                self._await_ready_locked()

    def _spawn_locked(self) -> None:
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        # vineyard names its temp files by PID; PIDs repeat across
        # containers sharing a root, so give every backend a unique name.
        env.setdefault("POD_NAME", f"{socket.gethostname()}-{os.getpid()}-{id(self):x}")
        cmd = [
            *launch.command("backend"),
            "--conn-fd",
            str(child_sock.fileno()),
            "--shm-fd",
            str(-1 if self._shm_fd is None else self._shm_fd),
            "--spec",
            self._spec.to_json(),
            "--nice",
            str(self._nice),
        ]
        try:
            proc = subprocess.Popen(
                cmd,
                pass_fds=tuple(
                    fd for fd in (child_sock.fileno(), self._shm_fd) if fd is not None
                ),
                stdin=subprocess.DEVNULL,
                env=env,
                # Own process group: a terminal's Ctrl-C goes to vLLM, which
                # then shuts us down in order. Not a session of its own:
                # Linux schedules each session as one group (autogroup), and
                # a fresh group on a loaded core was seen to wait 20 s and
                # more before its first run there.
                process_group=0,
            )
        finally:
            child_sock.close()
        self._starting = (proc, Connection(parent_sock.detach()))

    def _await_ready_locked(self) -> None:
        assert self._starting is not None
        proc, conn = self._starting
        try:
            if not conn.poll(self._startup_timeout_s):
                raise BackendError(
                    f"{self.name} backend did not start within "
                    f"{self._startup_timeout_s:.0f} s"
                )
            status, payload = conn.recv()
            if status != "ready":
                raise BackendError(f"{self.name} backend failed to start: {payload}")
        except (EOFError, OSError) as e:
            conn.close()
            self._reap(proc)
            raise BackendError(
                f"{self.name} backend exited during startup "
                f"(exit code {proc.returncode}): {e}"
            ) from e
        except BackendError:
            conn.close()
            self._reap(proc)
            raise
        finally:
            # Set while it starts: close() kills it from another thread.
            self._starting = None
        self._proc, self._conn = proc, conn
        self._run = BackendRun(proc)
        self._everywhere = False  # a new process starts off the worker's cores

    def _reap(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(timeout=self._exit_wait_s)
        except subprocess.TimeoutExpired:
            logger.warning("vineyard backend pid %d did not exit", proc.pid)

    def _reap_later(self, proc: subprocess.Popen[bytes]) -> None:
        """Kill ``proc`` and return at once; a thread of its own waits for
        it to exit (for as long as it takes: one stuck in the kernel exits
        when its call returns)."""
        if proc.poll() is not None:
            return
        with contextlib.suppress(OSError):
            proc.kill()

        def reap() -> None:
            try:
                proc.wait(timeout=self._exit_wait_s)
            except subprocess.TimeoutExpired:
                logger.warning(
                    "vineyard %s backend pid %d did not exit %.0f s after it "
                    "was killed (stuck in the kernel?); waiting for it",
                    self.name,
                    proc.pid,
                    self._exit_wait_s,
                )
                proc.wait()

        # Without a thread (none can start), whoever asks BackendRun.gone()
        # reaps it.
        with contextlib.suppress(RuntimeError):
            threading.Thread(
                target=reap, name=f"vineyard-{self.name}-reap", daemon=True
            ).start()

    def _stop_locked(self, wait: bool = True) -> None:
        """Stop the process; ``wait=False``: never wait for it to exit
        (for the callers of a backend restarted in the background)."""
        self._in_flight = None
        if self._starting is not None:
            proc, conn = self._starting
            self._starting = None
            conn.close()
            self._reap(proc)
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            if self._run is not None:
                self._run.stopped = True
            if wait:
                self._reap(self._proc)
            else:
                self._reap_later(self._proc)
            self._proc = None

    def _ensure_running_locked(self) -> Connection:
        if self._closed:
            raise BackendError(f"{self.name} backend is closed")
        if self.disabled_reason is not None:
            raise BackendError(self.disabled_reason)
        if self._running_locked():
            assert self._conn is not None
            return self._conn
        self._stop_locked()
        now = time.monotonic()
        recent = self._recent_restarts
        while recent and now - recent[0] >= self._restart_window_s:
            recent.popleft()  # forgiven after a period of success
        if len(recent) >= self._max_restarts:
            reason = (
                f"{self.name} backend disabled for "
                f"{self._restart_window_s:.0f} s after {len(recent)} restarts; "
                "the cache recomputes instead meanwhile"
            )
            self._disabled = (reason, now)
            recent.clear()
            logger.warning("%s", reason)
            raise BackendError(reason)
        recent.append(now)
        self.restarts += 1
        logger.warning(
            "Restarting the %s vineyard backend (restart %d of %d allowed "
            "within %.0f s)",
            self.name,
            len(recent),
            self._max_restarts,
            self._restart_window_s,
        )
        self._start_locked()
        assert self._conn is not None
        return self._conn

    def _fail_locked(self, error: Exception) -> BackendError:
        code = self._proc.poll() if self._proc else None
        self._stop_locked(wait=not self._restart_in_background)
        return BackendError(f"{self.name} backend died (exit code {code}): {error}")

    def send(self, request: Request[Any]) -> BackendRun:
        """Send a request; :meth:`receive` gets its answer. Returns the run
        of the process it went to. With ``restart_in_background`` a dead
        process is restarted on another thread, and calls fail at once
        until it is up."""
        if self._restart_in_background:
            if not self._lock.acquire(blocking=False):
                raise BackendError(f"{self.name} backend is restarting")
        else:
            self._lock.acquire()
        try:
            assert self._in_flight is None, "one request at a time"
            if self._restart_in_background and not self._running_locked():
                self._restart_later_locked()
            conn = self._ensure_running_locked()
            try:
                conn.send(request)
            except (EOFError, OSError) as e:
                raise self._fail_locked(e) from e
            self._in_flight = request.op
            assert self._run is not None
            run = self._run
            now = time.monotonic()
            seen = _sample(self._pid(), self._disk_stat)
            self._watch = _Watch(
                seen.progress if seen else None,
                now,
                now,
                seen.ran_s if seen else None,
            )
        finally:
            self._lock.release()
        return run

    def _pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _stall_locked(self, quiet_s: float) -> str | None:
        """Why the request in flight is taken for hung, or ``None``: its
        process made no progress for ``quiet_s``, or has been busy with it
        for :data:`MAX_BUSY_TIMEOUTS` times that, not counting its waits
        for a CPU. A process starved of CPU or waiting for a busy disk is
        slow, not hung: it goes on."""
        watch, now, pid = self._watch, time.monotonic(), self._pid()
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
        if watch.starved_s >= STARVED_S and pid is not None and not self._everywhere:
            self._run_everywhere(pid, watch.starved_s)
        if now - watch.quiet_since >= quiet_s:
            return f"no progress for {quiet_s:g} s"
        if watch.busy_s >= MAX_BUSY_TIMEOUTS * quiet_s:
            return (
                f"still busy after {watch.busy_s:.0f} s (not counting its "
                "waits for a CPU)"
            )
        return None

    def _run_everywhere(self, pid: int, starved_s: float) -> None:
        """Let a starved backend run on every core. The cores the worker
        does not use can be as busy as its own (another instance's engine
        there, every core bound to an engine), and Linux shares a core
        among groups of processes (sessions, cgroups) by each group's load
        on it: alone on another group's busy core, a backend was measured
        to get no CPU for 12-20 s, while beside its own engine its group
        has its share (and the writer's nice 10 lets the pass win)."""
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

    def stalled(self, quiet_s: float | None = None) -> str | None:
        """For a caller that must not wait (the forward thread): why the
        request in flight is taken for hung (see :meth:`receive`), or
        ``None`` while it is answered or making progress."""
        with self._lock:
            if self._in_flight is None:
                return None
            return self._stall_locked(self._timeout_s if quiet_s is None else quiet_s)

    def _running_locked(self) -> bool:
        return (
            self._conn is not None
            and self._proc is not None
            and self._proc.poll() is None
        )

    def _restart_later_locked(self) -> None:
        """Start the restart on a thread of its own and fail this call."""
        if self._closed or self.disabled_reason is not None:
            return  # _ensure_running_locked says why
        if self._restarter is None or not self._restarter.is_alive():

            def restart() -> None:
                with self._lock, contextlib.suppress(BackendError):
                    self._ensure_running_locked()

            self._restarter = threading.Thread(
                target=restart, name=f"vineyard-{self.name}-restart", daemon=True
            )
            self._restarter.start()
        raise BackendError(f"{self.name} backend is restarting")

    def ready(self) -> bool:
        """Whether :meth:`receive` would return (or fail) without waiting:
        the answer to the request sent last has arrived, or there is none
        to wait for."""
        with self._lock:
            conn = self._conn
            if self._in_flight is None or conn is None:
                return True
            try:
                return conn.poll(0)
            except (EOFError, OSError):
                return True  # receive() reports it

    def receive(
        self, reply_type: type[ReplyT], timeout_s: float | None = None
    ) -> ReplyT:
        """The answer to the request sent last, a ``reply_type``."""
        timeout = self._timeout_s if timeout_s is None else timeout_s
        with self._lock:
            op, conn = self._in_flight, self._conn
            if op is None or conn is None:
                raise BackendError(f"{self.name} backend lost the request")
            try:
                late = self._wait_for_answer_locked(conn, timeout)
                if late is not None:
                    # A late answer would be read as the next request's.
                    self._stop_locked(wait=not self._restart_in_background)
                    raise BackendError(
                        f"{self.name} backend did not answer {op!r}: {late}"
                    )
                status, payload = conn.recv()
            except (EOFError, OSError) as e:
                raise self._fail_locked(e) from e
            self._in_flight = None
        if status != "ok":
            raise BackendError(f"{self.name} backend error: {payload}")
        if not isinstance(payload, reply_type):
            raise BackendError(
                f"{self.name} backend answered {op!r} with a {type(payload).__name__}"
            )
        return payload

    def _wait_for_answer_locked(self, conn: Connection, quiet_s: float) -> str | None:
        """Wait for the answer while the process makes progress (see
        :meth:`_stall_locked`). ``None`` once it has come, else why not;
        ``quiet_s`` 0 gives up at once."""
        while True:
            if conn.poll(min(quiet_s, PROGRESS_POLL_S)):
                return None
            if quiet_s <= 0:
                return "given up on"
            why = self._stall_locked(quiet_s)
            if why is not None:
                return why

    def call(self, request: Request[ReplyT], timeout_s: float | None = None) -> ReplyT:
        """Send one request and wait for its answer."""
        self.send(request)
        reply: ReplyT = self.receive(request.reply_type, timeout_s)
        return reply

    def close(self) -> None:
        """Stop the process, bounded whatever it is doing (starting,
        restarting, hung in the kernel on a dead filesystem)."""
        self._closed = True
        # Kill first, without the lock: a call in flight, or a start or
        # restart waiting for readiness, then fails at once instead of
        # holding the lock until its timeout. The whole process group: what
        # the backend started goes too.
        starting = self._starting
        for proc in (self._proc, starting[0] if starting else None):
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
        if not self._lock.acquire(timeout=CLOSE_WAIT_S):
            logger.warning(
                "%s vineyard backend still busy %.0f s after it was killed "
                "(hung in the kernel?): abandoned",
                self.name,
                CLOSE_WAIT_S,
            )
            return
        try:
            self._stop_locked()
        finally:
            self._lock.release()
