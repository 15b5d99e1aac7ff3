# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The roots the several-instance chats run on (``serve_chats.py``): as is,
a FUSE mount some milliseconds away (``slow_fs.py``), or a GlusterFS volume
with one client mount per instance, each as a context that yields the
instances' environments."""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve_harness import favour, pin_off
from slow_fs import SlowFs

#: Round trips timed per kind of call in the GlusterFS probe.
PROBE_CALLS = 50
#: A configuration: the instances' environments (one each), the servers'
#: arguments, and facts to record with its result.
Config = tuple[list[dict[str, str]], list[str], dict[str, Any]]


@dataclass
class SharedVolume:
    """A distributed filesystem's client mounts (one per instance, in turn)
    and its measured round trips (ms)."""

    mounts: tuple[Path, ...]
    round_trip_ms: dict[str, float]
    #: The cores its servers and clients were moved to (None: left as is).
    cores: list[int] | None = None
    #: Their nice value where they stayed on the instances' cores (None: as is).
    nice: int | None = None


def probe_round_trips(
    mounts: tuple[Path, ...], calls: int = PROBE_CALLS
) -> dict[str, float]:
    """What a ``stat`` and an ``open`` cost through a mount (ms): files one
    client wrote, called through another (the last mount): the first
    ``stat`` of each (new to that client), ``calls`` more of one, and
    ``calls`` ``open`` + ``close``."""
    folder = f"probe-{os.getpid()}"
    (mounts[0] / folder).mkdir()
    try:
        for k in range(calls):
            (mounts[0] / folder / f"f{k}").write_bytes(b"x")
        there = mounts[-1] / folder

        def per_call_ms(call: Callable[[int], object]) -> float:
            start = time.perf_counter()
            for k in range(calls):
                call(k)
            return 1e3 * (time.perf_counter() - start) / calls

        return {
            "stat_new_ms": per_call_ms(lambda k: os.stat(there / f"f{k}")),
            "stat_ms": per_call_ms(lambda k: os.stat(there / "f0")),
            "open_close_ms": per_call_ms(
                lambda k: os.close(os.open(there / "f0", os.O_RDONLY))
            ),
        }
    finally:
        for k in range(calls):
            (mounts[0] / folder / f"f{k}").unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            (mounts[0] / folder).rmdir()


@contextlib.contextmanager
def glusterfs_roots(base: Path, busy: set[int]) -> Iterator[SharedVolume | str]:
    """A fresh GlusterFS replica-2 volume on two local bricks, mounted twice
    under ``base`` (two clients, as two hosts), its servers and clients
    moved off the ``busy`` cores where a core is free (else given a kernel
    client's priority: :func:`~serve_harness.favour`); or why it cannot be
    set up here."""
    # The tests' helper, which reports what is missing as a pytest skip.
    import pytest

    from tests.worker.vineyard_glusterfs_testing import glusterfs_volume

    with contextlib.ExitStack() as stack:
        try:
            volume = stack.enter_context(glusterfs_volume(base))
            pids = [pid for pid in volume.brick_pids() if pid]
            for mount in volume.mounts:
                found = subprocess.run(
                    ["pgrep", "-f", f"glusterfs.*{mount}$"],
                    capture_output=True, text=True, check=False,
                )  # fmt: skip
                pids += [int(pid) for pid in found.stdout.split()]
            cores = pin_off(pids, busy)
            nice = None if cores else favour(pids)
            shared: SharedVolume | str = SharedVolume(
                volume.mounts, probe_round_trips(volume.mounts), cores, nice
            )
        except (pytest.skip.Exception, Exception) as e:  # noqa: BLE001
            why = str(e).strip() or type(e).__name__
            shared = f"GlusterFS cannot be set up here: {why}"
        yield shared


@contextlib.contextmanager
def as_is(
    instances: int, env: dict[str, str], args: list[str] | None = None
) -> Iterator[Config]:
    """Every instance with ``env`` and ``args``."""
    yield [env] * instances, args or [], {}


@contextlib.contextmanager
def far_root(
    instances: int, busy: set[int], folder: Path, latency_ms: float,
    cache_env: Callable[[Path], dict[str, str]],
) -> Iterator[Config]:  # fmt: skip
    """The cache root on a FUSE mount of its own, ``latency_ms`` away, its
    daemon off the ``busy`` cores where a core is free (else given a kernel
    client's priority: :func:`~serve_harness.favour`)."""
    fs = SlowFs(folder, latency_ms=latency_ms, io_latency_ms=latency_ms)
    try:
        cores = pin_off([fs.proc.pid], busy)
        facts: dict[str, Any] = {"latency_ms": latency_ms}
        facts["daemon_nice"] = None if cores else favour([fs.proc.pid])
        facts["stat_ms"] = fs.stat_latency_ms()
        yield [cache_env(fs.mount / "root")] * instances, [], facts
    finally:
        fs.close()


@contextlib.contextmanager
def shared_volume(
    instances: int, volume: SharedVolume, run: int,
    cache_env: Callable[[Path], dict[str, str]],
) -> Iterator[Config]:  # fmt: skip
    """One folder of the volume, each instance through its own client
    mount, with a POD_NAME of its own (writers of one root need one)."""
    envs = [
        {
            **cache_env(volume.mounts[k % len(volume.mounts)] / f"root-{run}"),
            "POD_NAME": f"chats-{run}-instance-{k}",
        }
        for k in range(instances)
    ]
    yield envs, [], {}


def describe_roots(result: dict[str, Any]) -> list[str]:
    """What the rows beyond no cache and the local root ran on."""
    p, lines = result["plan"], []
    if p.get("root_latency_ms"):
        lines.append(
            "root L ms away: the root on a FUSE mount (slow_fs.py) adding L ms to "
            "every stat and open and to every fsync and first read of a file; "
            "0 ms: the same mount adding nothing (the FUSE daemon's own cost)"
        )
        busy = ", ".join(map(str, result["instance_cores"]))
        cores = result.get("fuse_daemon_cores")
        if cores:
            where = ", ".join(map(str, cores))
            lines.append(f"FUSE daemon on cores {where}, off the instances' ({busy})")
        else:
            nices = {
                r.get("daemon_nice") for run in result["runs"] for r in run.values()
            }
            nices.discard(None)
            priority = (
                f", at nice {min(nices)} (a kernel client's work runs ahead of user "
                "processes)"
                if nices
                else ", at their priority"
            )
            lines.append(
                f"FUSE daemon NOT moved off the instances' cores ({busy}): no other "
                f"core on this {os.cpu_count()}-core machine, it competes with them"
                + priority
            )
        stats: dict[float, list[float]] = {}
        for run in result["runs"]:
            for r in run.values():
                if "stat_ms" in r:
                    stats.setdefault(r["latency_ms"], []).append(r["stat_ms"])
        if stats:
            measured = ", ".join(
                f"{ms:g} ms away: {statistics.mean(v):.1f} ms"
                for ms, v in sorted(stats.items())
            )
            lines.append(f"a stat through the mount (lookup + getattr): {measured}")
    g = result.get("glusterfs")
    if g and "skipped" in g:
        lines.append(f"GlusterFS row skipped: {g['skipped']}")
    elif g:
        rt = g["round_trip_ms"]
        where = (
            f"moved to cores {', '.join(map(str, g['cores']))}"
            if g.get("cores")
            else "on the instances' cores (none free)"
            + (f", at nice {g['nice']}" if g.get("nice") is not None else "")
        )
        lines.append(
            "GlusterFS: a replica-2 volume, two bricks on this host, each "
            "instance on its own client mount with a POD_NAME of its own; its "
            f"servers and clients {where}"
        )
        lines.append(
            f"GlusterFS round trip through a client ({PROBE_CALLS} calls each): "
            f"stat {rt['stat_ms']:.3f} ms (of a file new to the client "
            f"{rt['stat_new_ms']:.3f} ms), open+close {rt['open_close_ms']:.3f} ms"
        )
    return lines
