# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared by every test directory: with this file pytest puts ``tests/`` on
``sys.path``, so helpers such as :mod:`script_testing` import by name."""
