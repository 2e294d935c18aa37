"""The ``vllm.general_plugins`` entry point: registers ``KVPlaneConnector`` with vLLM's ``KVConnectorFactory``,
and ``KVPlaneStoreTier`` with its ``SecondaryTierFactory`` (vLLM 0.27.1 loads a secondary tier only by a registered
type; 0.33 also by ``module_path``).

vLLM calls ``register()`` in every process it starts (API server, engine core, workers), so it must be cheap
and idempotent: the class is registered lazily (imported only when chosen) and an existing registration, ours
from an earlier call or another package's under the same name, is left as it is.
"""

from __future__ import annotations

import logging

from kvplane.integrations.vllm import CONNECTOR_MODULE, CONNECTOR_NAME

logger = logging.getLogger("kvplane.vllm")


TIER_NAME = "KVPlaneStoreTier"  # the secondary tier's type: its class name, so 0.33's module_path finds it too
TIER_MODULE = "kvplane.integrations.vllm_tier"


def register() -> None:
    _register_connector()
    _register_tier()


def _register_tier() -> None:
    try:
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    except ImportError:  # a vLLM without secondary tiers
        return
    if TIER_NAME not in SecondaryTierFactory._registry:
        try:
            SecondaryTierFactory.register_tier(TIER_NAME, TIER_MODULE, TIER_NAME)
        except ValueError:  # registered between the check and here
            logger.debug("%s was registered concurrently; leaving it", TIER_NAME)


def _register_connector() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        logger.debug("%s is already registered with KVConnectorFactory; leaving it", CONNECTOR_NAME)
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:  # registered between the check and here (another plugin, another thread)
        logger.debug("%s was registered concurrently; leaving it", CONNECTOR_NAME)
