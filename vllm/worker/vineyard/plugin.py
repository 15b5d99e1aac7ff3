# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``vllm.general_plugins`` entry point, loaded by every vLLM process.

It registers ``VineyardConnector`` by name (lazily: nothing of the cache is
imported until an engine asks for the connector) and, when
``VLLM_USE_VINEYARD_CACHE=1`` and no ``kv_transfer_config`` is given, supplies
one, so ``vllm serve MODEL`` and ``LLM(model=...)`` need no other flag.
"""

from vllm.worker.vineyard.config import vineyard_cache_requested

CONNECTOR_NAME = "VineyardConnector"
CONNECTOR_MODULE = "vllm.worker.vineyard.connector.vineyard_connector"


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
