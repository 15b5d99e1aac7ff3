# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the tool's commands take: the cache root argument, sizes and
numbers, and the usage error (exit code 2) that names a bad argument."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable

from vllm.worker.vineyard.storage.namespaces import is_namespace_name

_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([kmgtp]?)(?:i?b)?\s*", re.I)


class UsageError(Exception):
    """A bad argument: exit code 2, the message names the argument."""


def parse_size(text: str) -> int:
    """``10G``, ``500M``, ``1.5T``, ``4096`` (bytes): binary units
    (``10G`` is 10 GiB, as ``VINEYARD_CACHE_DISK_LIMIT_GB``)."""
    m = _SIZE.fullmatch(text)
    if m is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size (e.g. 500M, 10G, 1.5T, or bytes)"
        )
    return int(float(m[1]) * 1024 ** _UNITS[m[2].lower()])


def number(zero_allowed: bool) -> Callable[[str], float]:
    """An argparse type: a number > 0 (or >= 0 with ``zero_allowed``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (value >= 0 if zero_allowed else value > 0):
            what = "a number >= 0" if zero_allowed else "a positive number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    return parse


def root_argument(path: str) -> str:
    """The ROOT argument: a directory, and not one of a root's namespace
    directories (a likely slip); else a :class:`UsageError`. Unlike the
    cache's :func:`~vllm.worker.vineyard.storage.root.check_root`, it
    creates nothing and lets an operator inspect any root they can read."""
    if not os.path.isdir(path):
        raise UsageError(f"ROOT: {path!r} is not a directory")
    name = os.path.basename(os.path.normpath(path))
    if is_namespace_name(name):
        raise UsageError(
            f"ROOT: {path!r} is a namespace directory; give the cache root "
            f"that holds it ({os.path.dirname(os.path.abspath(path))!r})"
        )
    return path
