# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared by every test directory. ``tests`` is a package: helpers import
as ``tests.<module>`` (pytest puts the repository root on ``sys.path``)."""

import os
import shutil
import tempfile

import pytest

_CACHE_ROOT = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """Each run, and each xdist worker, gets a folder of its own for vLLM's
    cache (``VLLM_CACHE_ROOT``, inherited by the engines the tests start):
    the cache remembers link prices and weight digests there, keyed by
    paths that recur from run to run (``/tmp/pytest-of-root/pytest-0/...``),
    so a folder kept from an earlier run would price a new test's empty
    root by an old one's loads."""
    folder = tempfile.mkdtemp(prefix="vllm-cache-root-")
    config.stash[_CACHE_ROOT] = folder
    os.environ["VLLM_CACHE_ROOT"] = folder


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_CACHE_ROOT, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (the default, see pyproject.toml): one pytest-xdist worker
    per core, at most four. Engine tests compute on their worker's core
    (``vineyard_testing.engine_cpu``); more workers than cores would only
    make them wait for each other, and each worker's engines take a few GiB.
    """
    return max(1, min(len(os.sched_getaffinity(0)), 4))
