# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``vllm.general_plugins`` entry point, loaded by every vLLM process.

It registers ``VineyardConnector`` by name (lazily: nothing of the cache is
imported until an engine asks for the connector) and, when
``VLLM_USE_VINEYARD_CACHE=1`` and no ``kv_transfer_config`` is given, supplies
one, so ``vllm serve MODEL`` and ``LLM(model=...)`` need no other flag.
"""

import os

CONNECTOR_NAME = "VineyardConnector"
CONNECTOR_MODULE = "vllm.worker.vineyard_connector"
ENABLE_VAR = "VLLM_USE_VINEYARD_CACHE"


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
BOOL_ALLOWED = "1 or 0 (also true/false, yes/no, on/off)"


def parse_bool(name: str, raw: str) -> bool:
    """Parse a boolean environment variable; the error names it."""
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean; allowed: {BOOL_ALLOWED}")


def vineyard_cache_requested() -> bool:
    return parse_bool(ENABLE_VAR, os.environ.get(ENABLE_VAR, "0"))


def default_kv_transfer_config():
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
    )


def _supply_default_kv_transfer_config() -> None:
    """vLLM has no hook for a plugin to default an engine argument: wrap
    ``EngineArgs.create_engine_config`` (the frontend builds the config
    there, before any engine process starts)."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, "_vineyard_default", False):
        return

    def create_engine_config(self, *args, **kwargs):
        if self.kv_transfer_config is None and vineyard_cache_requested():
            self.kv_transfer_config = default_kv_transfer_config()
        return original(self, *args, **kwargs)

    create_engine_config._vineyard_default = True  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME
        )
    if vineyard_cache_requested():
        _supply_default_kv_transfer_config()
