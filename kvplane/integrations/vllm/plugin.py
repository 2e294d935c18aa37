"""The ``vllm.general_plugins`` entry point: registers ``KVPlaneConnector`` with vLLM's ``KVConnectorFactory``.

vLLM calls ``register()`` in every process it starts (API server, engine core, workers), so it must be cheap
and idempotent: the class is registered lazily (imported only when chosen) and an existing registration, ours
from an earlier call or another package's under the same name, is left as it is.
"""

from __future__ import annotations

import logging

from kvplane.integrations.vllm import CONNECTOR_MODULE, CONNECTOR_NAME

logger = logging.getLogger("kvplane.vllm")


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        logger.debug("%s is already registered with KVConnectorFactory; leaving it", CONNECTOR_NAME)
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:  # registered between the check and here (another plugin, another thread)
        logger.debug("%s was registered concurrently; leaving it", CONNECTOR_NAME)
