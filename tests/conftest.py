# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared by every test directory. ``tests`` is a package: helpers import
as ``tests.<module>`` (pytest puts the repository root on ``sys.path``)."""

import os

import pytest


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (the default, see pyproject.toml): one pytest-xdist worker
    per core, at most four. Engine tests compute on their worker's core
    (``vineyard_testing.engine_cpu``); more workers than cores would only
    make them wait for each other, and each worker's engines take a few GiB.
    """
    return max(1, min(len(os.sched_getaffinity(0)), 4))
