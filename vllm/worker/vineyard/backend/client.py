# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engine-side handle of a vineyard backend process
(:mod:`~vllm.worker.vineyard.backend.server`): it starts the process, sends it
requests over a socket (:mod:`~vllm.worker.vineyard.backend.protocol`),
waits for answers while the process makes progress
(:mod:`~vllm.worker.vineyard.backend.progress`), and restarts or disables a
process that dies or stalls (its runs:
:mod:`~vllm.worker.vineyard.backend.runs`).

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
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from vllm.worker.vineyard import launch
from vllm.worker.vineyard.backend.progress import ProgressWatch, disk_stat_path
from vllm.worker.vineyard.backend.protocol import BackendError, BackendSpec, Request
from vllm.worker.vineyard.backend.runs import BackendRun, reap, reap_later
from vllm.worker.vineyard.cores import move_off_the_workers_cores

logger = logging.getLogger(__name__)

ReplyT = TypeVar("ReplyT")

#: How often a wait for an answer looks at the backend's progress.
PROGRESS_POLL_S = 0.25


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
        waited_for: bool = False,
    ):
        """Starts the process; with ``wait=False`` returns at once and
        :meth:`wait_ready` waits (so several backends start in parallel).
        ``waited_for``: requests wait for its answers (a reader, a lookup
        process): it may run on every core once it waited
        :data:`~.progress.WAITED_FOR_STARVED_S` for a CPU during one."""
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
        disk_stat = disk_stat_path(spec.cache_root) if disk_progress else None
        self._progress = ProgressWatch(name, disk_stat, waited_for)
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
                # a fresh group on a loaded core can wait tens of seconds
                # before its first run there.
                process_group=0,
            )
            move_off_the_workers_cores(proc.pid)
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
            reap(proc, self._exit_wait_s)
            raise BackendError(
                f"{self.name} backend exited during startup "
                f"(exit code {proc.returncode}): {e}"
            ) from e
        except BackendError:
            conn.close()
            reap(proc, self._exit_wait_s)
            raise
        finally:
            # Set while it starts: close() kills it from another thread.
            self._starting = None
        self._proc, self._conn = proc, conn
        self._run = BackendRun(proc)
        self._progress.new_process()

    def _stop_locked(self, wait: bool = True) -> None:
        """Stop the process; ``wait=False``: never wait for it to exit
        (for the callers of a backend restarted in the background)."""
        self._in_flight = None
        if self._starting is not None:
            proc, conn = self._starting
            self._starting = None
            conn.close()
            reap(proc, self._exit_wait_s)
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            if self._run is not None:
                self._run.stopped = True
            if wait:
                reap(self._proc, self._exit_wait_s)
            else:
                reap_later(self._proc, self.name, self._exit_wait_s)
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
            self._progress.start(self._pid())
        finally:
            self._lock.release()
        return run

    def _pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def stalled(self, quiet_s: float | None = None) -> str | None:
        """For a caller that must not wait (the forward thread): why the
        request in flight is taken for hung (see :meth:`receive`), or
        ``None`` while it is answered or making progress."""
        with self._lock:
            if self._in_flight is None:
                return None
            quiet_s = self._timeout_s if quiet_s is None else quiet_s
            return self._progress.stall(self._pid(), quiet_s)

    def cpu_wait_s(self) -> float:
        """How long the process has waited for a CPU since the request in
        flight was sent (see :meth:`ProgressWatch.cpu_wait_s`)."""
        with self._lock:
            return self._progress.cpu_wait_s(self._pid())

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
            self._progress.answered(self._pid())
        if status != "ok":
            raise BackendError(f"{self.name} backend error: {payload}")
        if not isinstance(payload, reply_type):
            raise BackendError(
                f"{self.name} backend answered {op!r} with a {type(payload).__name__}"
            )
        return payload

    def _wait_for_answer_locked(self, conn: Connection, quiet_s: float) -> str | None:
        """Wait for the answer while the process makes progress (see
        :meth:`ProgressWatch.stall`). ``None`` once it has come, else why not;
        ``quiet_s`` 0 gives up at once."""
        while True:
            if conn.poll(min(quiet_s, PROGRESS_POLL_S)):
                return None
            if quiet_s <= 0:
                return "given up on"
            why = self._progress.stall(self._pid(), quiet_s)
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
