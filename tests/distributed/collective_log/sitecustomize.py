# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Logs every ``torch.distributed`` collective of every Python process that
starts with this directory on ``PYTHONPATH`` and
``VINEYARD_TEST_COLLECTIVE_LOG`` set: one line per call, marked ``cache``
when the vineyard connector's code is on the stack. The TP=2 engine test
counts them (decode steps must run none of the connector's)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import traceback
from typing import Any

_LOG = os.environ.get("VINEYARD_TEST_COLLECTIVE_LOG")
_MODULE = "torch.distributed.distributed_c10d"
_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "reduce",
    "gather",
    "scatter",
    "reduce_scatter",
    "all_to_all",
    "monitored_barrier",
)


def _write(line: str) -> None:
    assert _LOG is not None
    with open(_LOG, "a") as f:
        f.write(f"{os.getpid()} {line}\n")


def _wrap(module: Any) -> None:
    import torch.distributed as dist

    for name in _COLLECTIVES:
        original = getattr(module, name, None)
        if original is None:
            continue

        def logged(*args: Any, _original: Any = original, _name: str = name, **kw):
            stack = "".join(traceback.format_stack(limit=40))
            where = "cache" if "vllm/worker/vineyard_" in stack else "other"
            _write(f"{where} {_name}")
            return _original(*args, **kw)

        setattr(module, name, logged)
        if getattr(dist, name, None) is original:
            setattr(dist, name, logged)


class _Finder(importlib.abc.MetaPathFinder):
    """Patches the module right after it is first imported."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module: Any) -> None:
            exec_module(module)
            _wrap(module)

        spec.loader.exec_module = exec_and_wrap  # type: ignore[method-assign]
        return spec


if _LOG:
    _write("started")
    sys.meta_path.insert(0, _Finder())
