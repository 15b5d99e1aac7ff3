# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``python -m vllm.worker.vineyard.cli``: the operator's tool."""

from __future__ import annotations

import sys

from vllm.worker.vineyard.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
