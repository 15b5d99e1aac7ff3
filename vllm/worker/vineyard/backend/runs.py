# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A backend process's runs (:class:`BackendRun`: a restart starts another)
and their ends: a process given up on is killed, and waited for
(:func:`reap`) or, for callers that must never wait, reaped on a thread of
its own (:func:`reap_later`).

A process killed in the middle of a filesystem call (uninterruptible) exits
only when the call returns, and a read then still lands in the buffer it
was given: memory a request named is the process's until it answers or is
gone, whatever its handle gave up on.

Imports neither vLLM nor torch.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import threading

logger = logging.getLogger(__name__)


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


def reap(proc: subprocess.Popen[bytes], exit_wait_s: float) -> None:
    """Kill ``proc`` and wait up to ``exit_wait_s`` for it to exit (one stuck
    in the kernel is then left to exit by itself)."""
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=exit_wait_s)
    except subprocess.TimeoutExpired:
        logger.warning("vineyard backend pid %d did not exit", proc.pid)


def reap_later(proc: subprocess.Popen[bytes], name: str, exit_wait_s: float) -> None:
    """Kill ``proc`` (of the ``name`` backend) and return at once; a thread
    of its own waits for it to exit (for as long as it takes: one stuck in
    the kernel exits when its call returns; past ``exit_wait_s`` that is
    logged)."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(OSError):
        proc.kill()

    def wait() -> None:
        try:
            proc.wait(timeout=exit_wait_s)
        except subprocess.TimeoutExpired:
            logger.warning(
                "vineyard %s backend pid %d did not exit %.0f s after it "
                "was killed (stuck in the kernel?); waiting for it",
                name,
                proc.pid,
                exit_wait_s,
            )
            proc.wait()

    # Without a thread (none can start), whoever asks BackendRun.gone()
    # reaps it.
    with contextlib.suppress(RuntimeError):
        threading.Thread(target=wait, name=f"vineyard-{name}-reap", daemon=True).start()
