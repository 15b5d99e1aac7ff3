# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Runs one of the cache's programs without importing vLLM.

The backend processes (and the operator's tool) need neither vLLM nor torch,
but importing any ``vllm.*`` module runs vLLM's ``__init__`` first, which
imports torch: seconds and hundreds of MiB per process. Run by path, this
file puts an empty stand-in for the ``vllm`` package, rooted at the tree it
lives in, in place of the real one, then imports the program's module
normally; a backend so runs exactly the code of the engine that started it.

::

    python .../vllm/worker/vineyard/launch.py {backend,cli} ARGS...
"""

from __future__ import annotations

import importlib
import os
import sys
import types

PROGRAMS = {
    "backend": "vllm.worker.vineyard.backend.server",
    "cli": "vllm.worker.vineyard.cli",
}


def command(program: str) -> list[str]:
    """The command line that runs ``program`` (a key of :data:`PROGRAMS`)."""
    assert program in PROGRAMS, program
    return [sys.executable, os.path.abspath(__file__), program]


def stand_in_for_vllm() -> None:
    """Make ``vllm`` an empty package rooted at this tree's ``vllm`` folder
    (unless vLLM is imported already)."""
    here = os.path.dirname(os.path.realpath(__file__))
    # The script's folder is not a place to import from (its modules are
    # package modules).
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != here]
    if "vllm" not in sys.modules:
        stand_in = types.ModuleType("vllm")
        stand_in.__path__ = [os.path.dirname(os.path.dirname(here))]
        sys.modules["vllm"] = stand_in


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in PROGRAMS:
        print(f"usage: {sys.argv[0]} {{{','.join(PROGRAMS)}}} ARGS...", file=sys.stderr)
        return 2
    stand_in_for_vllm()
    program = importlib.import_module(PROGRAMS[sys.argv[1]])
    return int(program.main(sys.argv[2:]))


if __name__ == "__main__":
    sys.exit(main())
