# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vineyard-llm-cache``: see, check and steer a cache root from a shell.

::

    vineyard-llm-cache ls ROOT [--json]
    vineyard-llm-cache verify ROOT [--key-file F] [--remove] [--rate-mb-s R] [--json]
    vineyard-llm-cache purge ROOT (--namespace N | --model M) [--dry-run] [--json]
    vineyard-llm-cache evict ROOT --to SIZE [--dry-run] [--json]
    vineyard-llm-cache settings ROOT [--disk-limit SIZE] [--ttl-s S] [--json]

Exit codes: 0 done (``verify``: nothing bad found), 1 ``verify`` found bad
chunks (removed or not), 2 a usage error (the message names the argument).

It works beside live instances and touches only the cache's own entries,
as :mod:`~vllm.worker.vineyard.storage.scan` tells them (the sweeper's
rules); ``verify`` checks each entry as a load does. Also runs as ``python
-m vllm.worker.vineyard.cli``, or through ``vllm/worker/vineyard/launch.py
cli`` (which skips vLLM's import: it needs neither vLLM nor torch).

One module per command (``ls``, ``verify``, ``purge``, ``evict``,
``settings``); :mod:`.main` parses the command line.
"""

from __future__ import annotations

from vllm.worker.vineyard.cli.main import main

__all__ = ["main"]
